"""`flash_attn`: FlashAttention-3 (`flash_attn_interface`, Hopper build) when installed, else
FlashAttention-2 (`flash_attn.flash_attn_varlen_func`).

FA3 has no dropout; FA2 has. The spec registered here describes whichever is installed (decided
without importing either: importing CUDA extensions at `import hf_varlen` time would be slow).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ._common import safe_offsets
from .registry import BackendSpec, register_backend


def _has_fa3() -> bool:
    return importlib.util.find_spec("flash_attn_interface") is not None


def _fa_func():
    if _has_fa3():
        return importlib.import_module("flash_attn_interface").flash_attn_varlen_func, 3
    return importlib.import_module("flash_attn").flash_attn_varlen_func, 2


def flash_attn_backend(q, k, v, metadata, params):
    fn, major = _fa_func()
    kw = dict(
        softmax_scale=params.softmax_scale,
        causal=params.causal,
        window_size=params.window,
        softcap=params.softcap,
        deterministic=params.deterministic,
    )
    if major == 2:
        kw["dropout_p"] = params.dropout_p
    cu_q = safe_offsets(metadata.cu_seqlens_q, q.shape[0])
    cu_k = safe_offsets(metadata.cu_seqlens_k, k.shape[0])
    out = fn(q, k, v, cu_q, cu_k, metadata.max_seqlen_q, metadata.max_seqlen_k, **kw)
    return out[0] if isinstance(out, tuple) else out


def _probe() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        fn, _ = _fa_func()
    except (ImportError, AttributeError) as exc:
        return f"flash-attn (FA2) / flash_attn_interface (FA3) not importable: {exc}"
    return None if callable(fn) else "flash_attn_varlen_func not found"


register_backend(BackendSpec(
    name="flash_attn", fn=flash_attn_backend, probe=_probe,
    description="FlashAttention-3 (Hopper) if installed, else FlashAttention-2",
    requires="pip install flash-attn (FA2) or the FA3 hopper build; CUDA",
    dropout=not _has_fa3(),  # FA3 has no dropout
    max_head_dim=256, head_dim_multiple=8, sliding_window=True, softcap=True,
))  # fmt: skip
