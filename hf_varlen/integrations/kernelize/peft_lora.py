"""peft's LoRA ``Linear`` layers on hf_varlen's one-op LoRA projection (``ops.lora.lora_linear``).

``kernelize(model, lora=True)`` binds ``fused_lora_forward`` to every qualifying peft
``lora.Linear`` (q/k/v/o and gate/up/down under ``target_modules="all-linear"``) as an instance
attribute (``module.forward = MethodType(fused_lora_forward, module)``, what ``kernels`` does for
its layers); deleting the attribute (``undo``) gives peft's class forward back. peft's own
forward is never changed and nothing is imported from peft here: layers are told by their class.

A layer qualifies (checked at install; otherwise left alone with the reason) when its base layer
is a plain ``nn.Linear`` (not a 4-bit or 8-bit one, not ``fan_in_fan_out``) and every adapter is
vanilla LoRA: no variant (DoRA, ...), no ``lora_bias``, dropout 0. At call time the fused path
runs for one active adapter, adapters enabled and not merged, no extra forward arguments; any
other state (``merge_adapter``, ``disable_adapter()``, several active adapters, a
``adapter_names`` batch) runs peft's own forward, which is what that state means.

Precision: under autocast the op runs in the autocast dtype (x, the base weight and the adapters
cast to it, as autocast casts each matmul's inputs); without autocast in the base weight's dtype,
so fp32 adapters of a bf16 model are cast to bf16, where peft computes the adapter branch in fp32
(casting x up). The op keeps no fp32 copy of x; the adapter gradients come back in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from ...ops.lora import lora_linear

LEFT_ALONE_PREFIX = "lora."  # every reason ``problem`` gives starts with it
_PEFT_LAYER = ("peft.tuners.lora.layer", "LoraLayer")
_PEFT_LINEAR = ("peft.tuners.lora.layer", "Linear")


def _has_class(module: nn.Module, qual: tuple[str, str]) -> bool:
    return any((c.__module__, c.__name__) == qual for c in type(module).__mro__)


def is_peft_lora_layer(module: nn.Module) -> bool:
    """Any peft LoRA layer (Linear, Embedding, Conv, the bitsandbytes ones), told by class."""
    return _has_class(module, _PEFT_LAYER)


def problem(module: nn.Module) -> str | None:
    """None when the layer's adapters can run on the op, else why not."""
    cls = type(module).__name__
    if not _has_class(module, _PEFT_LINEAR):
        return f"lora.{cls}: not peft's lora.Linear (e.g. a 4-bit, embedding or conv LoRA layer)"
    base = getattr(module, "base_layer", None)
    if not isinstance(base, nn.Linear) or type(base).forward is not nn.Linear.forward:
        return f"lora.{cls}: the base layer is {type(base).__name__}, not a plain nn.Linear"
    if not base.weight.is_floating_point():
        return f"lora.{cls}: the base weight is {base.weight.dtype} (quantised)"
    if getattr(module, "fan_in_fan_out", False):
        return f"lora.{cls}: fan_in_fan_out=True (a transposed base weight)"
    for name in module.lora_A:
        if name in getattr(module, "lora_variant", {}):
            variant = type(module.lora_variant[name]).__name__
            return f"lora.{cls}: adapter {name!r} is a LoRA variant ({variant}, e.g. DoRA)"
        if module.lora_B[name].bias is not None:
            return f"lora.{cls}: adapter {name!r} has lora_bias=True"
        dropout = module.lora_dropout[name]
        if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0.0) > 0.0:
            return f"lora.{cls}: adapter {name!r} has lora_dropout={dropout.p} (the op has none)"
    return None


def _fused_adapter(layer: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """The one adapter the op computes for this call, or None for peft's own forward."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A:
        return None
    return active[0]


def fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft ``lora.Linear.forward`` on ``lora_linear``: ``base(x) + scaling * B(A(x))``."""
    name = _fused_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else base.weight.dtype

    def cast(t):
        return t if t is None or t.dtype == dtype else t.to(dtype)

    tensors = (
        cast(x) if autocast else x,
        cast(base.weight),
        cast(base.bias),
        cast(self.lora_A[name].weight),
        cast(self.lora_B[name].weight),
    )
    if not autocast:
        return lora_linear(*tensors, self.scaling[name])
    with torch.autocast(device_type, enabled=False):  # inputs cast already: no second dispatch
        return lora_linear(*tensors, self.scaling[name])


def is_ours(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is fused_lora_forward


def install(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Bind the fused forward to every qualifying LoRA Linear: (names, {name: why left alone})."""
    from types import MethodType

    done: list[str] = []
    left: dict[str, str] = {}
    for name, module in model.named_modules():
        if not is_peft_lora_layer(module):
            continue
        why = problem(module)
        if why is not None:
            left[name] = why
            continue
        module.forward = MethodType(fused_lora_forward, module)
        done.append(name)
    return done, left


def uninstall(model: nn.Module) -> None:
    for module in model.modules():
        if is_ours(module):
            del module.__dict__["forward"]
