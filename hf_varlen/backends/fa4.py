"""`fa4`: FlashAttention-4 (`flash_attn.cute.flash_attn_varlen_func`, CuTe DSL; Hopper/Blackwell).

FA4 takes windows as (left, right) with None for unbounded and returns (out, lse). It JIT-compiles
each kernel variant on first use (a few seconds).
"""

from __future__ import annotations

import torch

from ._common import safe_offsets
from .registry import BackendSpec, register_backend


def _fa4_func():
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def fa4_backend(q, k, v, metadata, params):
    left, right = params.window
    if params.causal:  # FA4 spells "causal, no window" as (None, None)
        window = (left, 0) if left >= 0 else (None, None)
    else:
        window = (None if left < 0 else left, None if right < 0 else right)
    out = _fa4_func()(
        q,
        k,
        v,
        cu_seqlens_q=safe_offsets(metadata.cu_seqlens_q, q.shape[0]),
        cu_seqlens_k=safe_offsets(metadata.cu_seqlens_k, k.shape[0]),
        max_seqlen_q=metadata.max_seqlen_q,
        max_seqlen_k=metadata.max_seqlen_k,
        softmax_scale=params.softmax_scale,
        causal=params.causal,
        window_size=window,
        softcap=params.softcap,
        deterministic=params.deterministic,
    )
    return out[0] if isinstance(out, tuple) else out


def _probe() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (sm90 or newer)"
    if torch.cuda.get_device_capability()[0] < 9:
        return f"needs sm90+, this GPU is sm{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        _fa4_func()
    except ImportError as exc:
        return f"flash-attn-4 (flash_attn.cute) not importable: {exc}"
    return None


register_backend(BackendSpec(
    name="fa4", fn=fa4_backend, probe=_probe, description="FlashAttention-4 (flash_attn.cute), CuTe DSL kernels "
    "for sm90/sm100",
    requires="pip install flash-attn-4 (+ nvidia-cutlass-dsl); Hopper or Blackwell GPU",
    max_head_dim=256, head_dim_multiple=8, sliding_window=True, softcap=True,
    traceable=False,  # CuTe JIT from Python: an opaque op under torch.compile
))  # fmt: skip
