"""Kernel-hub layers: Hugging Face module forwards rebuilt on hf_varlen's fused ops.

Each class is a ``kernels`` layer: an ``nn.Module`` subclass with no ``__init__`` and no members
beyond ``has_backward`` / ``can_torch_compile``, whose ``forward`` has the signature of the HF
forward it replaces. It reads the host module's own state (``weight``, eps, ``gate_proj``, ...):
``kernels.kernelize`` (or hf_varlen's fallback wiring) binds ``Layer.forward`` to the host instance.

    layer          replaces                         computes
    RMSNorm        LlamaRMSNorm (Qwen2/3, Mistral)  w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)
    GemmaRMSNorm   Gemma/Gemma2RMSNorm              (x * rsqrt(mean(x^2) + eps) * (1+w)).to(x.dtype)
    RotaryPosEmb   apply_rotary_pos_emb             q * cos + rotate_half(q) * sin, same for k
    SwiGLUMLP      *MLP with act_fn = silu          down(silu(gate(x)) * up(x))
    GeGLUMLP       *MLP with act_fn = gelu(, tanh)  down(gelu(gate(x), approximate) * up(x))

Shapes: hidden_states, x (B, T, H) (any leading dims); q (B, Hq, T, D), k (B, Hk, T, D);
cos, sin (B, T, D) (``unsqueeze_dim=1`` inserts the head axis).

This file is copied verbatim into the generated hub kernel package (``package.py``) next to a
copy of ``hf_varlen/ops``, so it imports only ``...ops`` (relative) and torch.
"""

from __future__ import annotations

import torch
from torch import nn

from ...ops.glu import geglu, swiglu
from ...ops.rmsnorm import rms_norm
from ...ops.rope import rotary_pos_emb

# Activation modules by class name (no transformers import: the hub package must not need it).
_SILU = {"SiLUActivation", "SiLU"}
_GELU_ERF = {"GELUActivation"}
_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation"}


def activation_kind(act_fn) -> str | None:
    """The activation the GLU kernels reproduce: "silu", "gelu" (erf), "gelu_tanh"; else None."""
    name = type(act_fn).__name__
    if name in _SILU:
        return "silu"
    if name in _GELU_TANH:
        return "gelu_tanh"
    if name in _GELU_ERF:
        return "gelu"
    if isinstance(act_fn, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act_fn.approximate)
    return None


def norm_eps(module: nn.Module) -> float:
    """The epsilon of an HF RMSNorm module (``variance_epsilon`` in Llama, ``eps`` in Gemma)."""
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, float | int):
            return float(eps)
    raise TypeError(f"{type(module).__name__} has no float `variance_epsilon` or `eps` attribute")


def _gelu_approximate(act_fn) -> str:
    kind = activation_kind(act_fn)
    if kind == "gelu":
        return "none"
    if kind == "gelu_tanh":
        return "tanh"
    raise ValueError(f"GeGLUMLP needs a GELU act_fn; got {type(act_fn).__name__}")


class RMSNorm(nn.Module):
    """Llama-style RMSNorm (weight multiplies the normalised row after rounding to x.dtype)."""

    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, norm_eps(self))


class GemmaRMSNorm(nn.Module):
    """Gemma-style RMSNorm: scale by ``1 + weight`` in fp32, round once."""

    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, norm_eps(self), add_unit_offset=True)


class RotaryPosEmb(nn.Module):
    """The ``rotary_pos_emb`` function entry: HF's ``apply_rotary_pos_emb``, fused."""

    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the fused SwiGLU kernel in the middle."""

    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class GeGLUMLP(nn.Module):
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))``; erf or tanh GELU as the host's ``act_fn``."""

    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        approximate = _gelu_approximate(self.act_fn)
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), approximate=approximate))
