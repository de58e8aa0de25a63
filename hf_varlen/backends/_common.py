"""Small helpers shared by the backend adapters (no backend imports here)."""

from __future__ import annotations

import torch

from ..ops import common
from ..ops.common import TensorCache, check_offsets, clamp_offsets

_HOST = TensorCache(size=2)  # cu_q and cu_k of the current batch
_SAFE = TensorCache(size=2)


def expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """(T, H_kv, D) -> (T, H_kv * group, D), each kv head repeated for the query heads it serves."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def host_offsets_qk(q, k, metadata) -> tuple[list[int], list[int]]:
    """Both checked offset lists of one call (``host_offsets`` for cu_seqlens_q and _k)."""
    bq = host_offsets(metadata.cu_seqlens_q, "cu_seqlens_q", q.shape[0], metadata.max_seqlen_q)
    bk = host_offsets(metadata.cu_seqlens_k, "cu_seqlens_k", k.shape[0], metadata.max_seqlen_k)
    return bq, bk


def host_offsets(cu_seqlens: torch.Tensor, name: str, total: int, max_len: int) -> list[int]:
    """cu_seqlens as a checked Python list: one device sync per batch, cached across layers.

    The offsets are on the host here anyway, so the full check (starts at 0, non-decreasing, ends at
    ``total``, no document longer than ``max_len``) is always on; bad offsets raise ValueError.
    """

    if common.capturing((cu_seqlens,)):  # the read below would fail inside CUDA with no reason
        raise RuntimeError(
            f"{name}: this attention backend reads the offsets on the host (sdpa, reference and "
            "xformers do), which a CUDA graph being captured cannot do; capture with a backend "
            "that keeps them on the device (hf_varlen.set_backend('triton', model=model))"
        )

    def build() -> list[int]:
        # Host read, intended (never while capturing, above): only the host-offset backends
        # (sdpa, reference, xformers) call this, once per batch; under torch.compile they run
        # inside the opaque op (backends/opaque.py), so the read happens at run time, outside the
        # traced graph.
        host = cu_seqlens.tolist()
        check_offsets(name, host, total, max_len)
        return host

    return _HOST.get_or_compute(cu_seqlens, build, extra=(total, max_len))


def safe_offsets(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Offsets clamped into [0, total] and made non-decreasing, on the device (no sync; cached per
    batch). Valid offsets come back unchanged; invalid ones can no longer send a kernel that trusts
    them (FlashAttention's) outside the packed tensors."""

    def build() -> torch.Tensor:
        return clamp_offsets(cu_seqlens, total).to(torch.int32)

    return _SAFE.get_or_compute(cu_seqlens, build, extra=total)
