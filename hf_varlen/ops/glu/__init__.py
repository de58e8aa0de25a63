"""Gated linear units: ``swiglu(gate, up)`` = silu(gate) * up and ``geglu(gate, up)`` =
gelu(gate) * up, one Triton kernel each way (``function.py``: kernels, launch, autograd,
``torch.library`` registration)."""

from __future__ import annotations

from .function import geglu, glu_backward, glu_forward, swiglu

__all__ = ["geglu", "glu_backward", "glu_forward", "swiglu"]
