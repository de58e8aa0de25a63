"""`triton`: hf_varlen's own Triton varlen flash attention (hf_varlen/ops/attention/).

Compact, heaviest-first tile schedule built on the device from cu_seqlens (no host sync), several
short documents per tile, GQA heads folded per tile, deterministic backward without atomics.
The kernel also runs under TRITON_INTERPRET=1 on CPU, but only for tests: the spec lists CUDA.
"""

from __future__ import annotations

import importlib.util

import torch

from .registry import BackendSpec, register_backend


def triton_backend(q, k, v, metadata, params):
    from ..ops.attention import triton_attention

    if v.shape[-1] != q.shape[-1]:  # the one check the public layer leaves to backends
        raise ValueError(
            f"backend='triton' needs v's head_dim ({v.shape[-1]}) equal to q's ({q.shape[-1]})"
        )
    return triton_attention(
        q, k, v, metadata.cu_seqlens_q, metadata.cu_seqlens_k, softmax_scale=params.softmax_scale,
        window=params.window, softcap=params.softcap, deterministic=params.deterministic,
        sinks=params.sinks,
    )  # fmt: skip


def _probe() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (the CPU interpreter path is for tests only)"
    if torch.cuda.get_device_capability() < (8, 0):
        return "needs an sm80+ GPU (Ampere or newer); its tile configs are tuned on Hopper"
    return None


register_backend(BackendSpec(
    name="triton", fn=triton_backend, probe=_probe, requires="triton >= 3.6 and a CUDA GPU",
    description="hf_varlen's Triton varlen flash attention (compact heaviest-first tiles, "
    "several documents per tile, GQA folding, deterministic backward)",
    devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
    max_head_dim=256, sliding_window=True, softcap=True, sinks=True,
))  # fmt: skip
