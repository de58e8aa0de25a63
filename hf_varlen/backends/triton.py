"""`triton`: hf_varlen's own Triton varlen flash attention (hf_varlen/ops/attention.py).

Compact, heaviest-first tile schedule built on the device from cu_seqlens (no host sync), several
short documents per tile, GQA heads folded per tile, deterministic backward without atomics.
The kernel also runs under TRITON_INTERPRET=1 on CPU, but only for tests: the spec lists CUDA.
"""

from __future__ import annotations

import importlib.util

import torch

from .registry import BackendSpec, register_backend


def triton_backend(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale, causal,
    window_size, softcap, dropout_p, deterministic,
):  # fmt: skip
    from ..ops.attention import triton_varlen_attention

    return triton_varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        dropout_p=dropout_p, deterministic=deterministic,
    )  # fmt: skip


def _probe() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (the CPU interpreter path is for tests only)"
    if torch.cuda.get_device_capability() < (8, 0):
        return "needs an sm80+ GPU (Ampere or newer); its tile configs are tuned on Hopper"
    return None


register_backend(
    BackendSpec(
        name="triton",
        fn=triton_backend,
        description="hf_varlen's Triton varlen flash attention (compact heaviest-first tiles, "
        "several documents per tile, GQA folding, deterministic backward)",
        requires="triton >= 3.6 and a CUDA GPU",
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        sliding_window=True,
        softcap=True,
        dropout=False,
        non_causal=True,
        deterministic=True,
        probe=_probe,
    ),
    auto_rank=None,
)
