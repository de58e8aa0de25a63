"""`torch`: torch.nn.attention.varlen.varlen_attn (PyTorch's bundled FlashAttention-2, CUDA).

The API changed between releases (torch 2.11 has no `enable_gqa`; 2.13 requires it for GQA), so
features are detected from the signature, never from the version string. Where `enable_gqa` is
missing, K/V are expanded to the query head count (what torch 2.11 needs for GQA).
"""

from __future__ import annotations

import inspect

import torch

from ._common import expand_kv, safe_offsets
from .registry import BackendSpec, register_backend


def _varlen_attn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _has_gqa_flag() -> bool:
    return "enable_gqa" in inspect.signature(_varlen_attn()).parameters


def torch_backend(q, k, v, metadata, params):
    extra = {}
    group = q.shape[1] // k.shape[1]
    if group > 1:
        if _has_gqa_flag():
            extra["enable_gqa"] = True
        else:
            k, v = expand_kv(k, group), expand_kv(v, group)
    return _varlen_attn()(
        q,
        k,
        v,
        safe_offsets(metadata.cu_seqlens_q, q.shape[0]),
        safe_offsets(metadata.cu_seqlens_k, k.shape[0]),
        metadata.max_seqlen_q,
        metadata.max_seqlen_k,
        scale=params.softmax_scale,
        window_size=params.window,
        **extra,
    )


def _probe() -> str | None:
    try:
        _varlen_attn()
    except ImportError as exc:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({exc})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


register_backend(BackendSpec(
    name="torch", fn=torch_backend, probe=_probe, requires="torch >= 2.11 with CUDA",
    description="torch.nn.attention.varlen.varlen_attn (FlashAttention-2 bundled in PyTorch)",
    max_head_dim=256, head_dim_multiple=8, sliding_window=True, deterministic=False,
))  # fmt: skip
