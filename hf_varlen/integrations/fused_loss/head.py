"""The lm_head's effective (V, H) weight and bias inside its forward, for the fused loss.

Kinds: ``nn.Linear`` (weight possibly tied to the embeddings); a PEFT LoRA layer (effective weight
W + scale * B @ A, differentiable in A and B; DoRA/variants, lora_bias, fan_in_fan_out and
dropout > 0 while training raise); a PEFT ``ModulesToSaveWrapper`` (its active copy); an FSDP2
shard still a DTensor inside the forward (gathered with ``full_tensor()``, logged once).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("hf_varlen.integrations.fused_loss")


def _lora_effective(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    base = layer.get_base_layer()
    weight, bias = base.weight, base.bias
    if layer.disable_adapters or layer.merged:
        return weight, bias
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        problem = None
        if name in getattr(layer, "lora_variant", {}):
            problem = f"a LoRA variant ({type(layer.lora_variant[name]).__name__}, e.g. DoRA)"
        elif getattr(layer, "lora_bias", {}).get(name):
            problem = "lora_bias=True"
        elif getattr(layer, "fan_in_fan_out", False):
            problem = "fan_in_fan_out=True"
        elif layer.training and getattr(layer.lora_dropout[name], "p", 0.0) > 0.0:
            problem = (
                f"lora_dropout={layer.lora_dropout[name].p} while training (dropout is on x, not W)"
            )
        if problem:
            raise NotImplementedError(
                f"fused cross-entropy on a LoRA lm_head with {problem} is not supported; leave "
                "lm_head out of target_modules, or uninstall the fused loss"
            )
        delta = layer.lora_B[name].weight @ layer.lora_A[name].weight
        weight = weight + (delta * layer.scaling[name]).to(weight.dtype)
    return weight, bias


def _is_peft_lora_layer(head: torch.nn.Module) -> bool:
    """Whether ``head`` is a PEFT LoRA layer, told from its class, never by importing peft: a LoRA
    head means peft is already imported, and this runs inside the compiled forward, where an import
    (of a peft that fails to import against this transformers) would be a graph break."""
    return any(
        cls.__name__ == "LoraLayer" and cls.__module__.startswith("peft.tuners.lora")
        for cls in type(head).__mro__
    )


def head_params(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    if _is_peft_lora_layer(head):
        weight, bias = _lora_effective(head)
    else:  # nn.Linear, or a wrapper exposing its active module's weight (peft ModulesToSaveWrapper)
        weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(
            f"lm_head: expected a linear head with a floating (V, H) weight, got "
            f"{type(head).__name__} with weight {type(weight).__name__}"
            f"{tuple(getattr(weight, 'shape', ()))} (quantized heads are not supported)"
        )
    if type(weight).__name__ == "DTensor":
        _log_once(
            "lm_head weight is a sharded DTensor inside its forward; gathering it (full_tensor)"
        )
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    return weight, bias


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)
