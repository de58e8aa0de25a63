"""`reference`: the pure-PyTorch oracle as a backend (CPU and GPU, every feature, slow)."""

from __future__ import annotations

import torch

from ..reference.attention import attention_reference
from .registry import BackendSpec, register_backend


def reference_backend(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    softmax_scale,
    causal,
    window_size,
    softcap,
    dropout_p,
    deterministic,
):
    return attention_reference(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        dropout_p=dropout_p,
    )


register_backend(
    BackendSpec(
        name="reference",
        fn=reference_backend,
        description="pure PyTorch, one matmul-softmax-matmul per document (the test oracle)",
        requires="nothing (CPU or GPU)",
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        sliding_window=True,
        softcap=True,
        dropout=True,
    )
)
