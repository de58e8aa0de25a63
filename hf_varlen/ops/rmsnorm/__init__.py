"""RMSNorm: ``rms_norm(x, weight, eps, add_unit_offset=False)`` (Llama; True: Gemma's (1 + w)),
one Triton kernel each way (``function.py``: kernels, launch, autograd, ``torch.library``
registration)."""

from __future__ import annotations

from .function import rms_norm, rms_norm_backward, rms_norm_forward

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_forward"]
