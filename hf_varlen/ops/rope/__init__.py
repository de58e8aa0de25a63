"""Fused QK rotary position embedding: ``apply_rotary_qk(q, k, cos, sin, ...)`` (in place, varlen
positions) and ``rotary_pos_emb`` (drop-in for HF's ``apply_rotary_pos_emb``).

    function.py   the math and layouts, launch, autograd, ``torch.library`` registration
    kernel.py     the Triton kernel
"""

from __future__ import annotations

from .function import apply_rotary_qk, rotary_pos_emb

__all__ = ["apply_rotary_qk", "rotary_pos_emb"]
