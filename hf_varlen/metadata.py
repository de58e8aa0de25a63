"""VarlenMetadata: where each packed document starts, built once per batch.

Sources, in the order the attention function tries them:
  * collator kwargs: ``cu_seq_lens_q/k`` (int32) + ``max_length_q/k`` (int)      -> no sync
  * a 2-D padding mask (B, T_k) of 1 = token, 0 = pad                           -> unpad (one sync)
  * packed ``position_ids`` (1, T): a new document wherever positions do not go up by one -> one sync
  * nothing: every row of the batch is one causal sequence                      -> no sync
Each derived result is cached on the identity of its source tensor, so all layers of a forward pass
(which receive the same tensor objects) share one computation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .backends._common import _IdentityCache


@dataclass(frozen=True)
class VarlenMetadata:
    """Packed-layout description of a (B, T) batch.

    cu_seqlens_q/k: (n + 1,) int32 offsets into the packed token axis.
    max_seqlen_q/k: Python ints.
    indices_q/k: (T_q_real,) / (T_k_real,) int64 positions of the real tokens in the flattened (B*T)
        axis, or None when every token is real (no unpadding needed).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    indices_q: torch.Tensor | None = None
    indices_k: torch.Tensor | None = None


def _to_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def from_lengths(lengths, device=None) -> VarlenMetadata:
    """Metadata for documents of the given lengths (a host list), e.g. from a collator."""
    lengths = [int(n) for n in lengths]
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    m = max(lengths) if lengths else 0
    return VarlenMetadata(cu, cu, m, m)


_KWARGS_CACHE = _IdentityCache()


def from_collator_kwargs(cu_q, cu_k, max_q, max_k) -> VarlenMetadata:
    """Use collator-provided offsets as they are (max lengths may be ints or 0-d tensors)."""
    hit = _KWARGS_CACHE.get(cu_q, extra=id(cu_k))
    if hit is not None:
        return hit
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise TypeError(
            f"cu_seq_lens_q/k must be int32, got {cu_q.dtype}/{cu_k.dtype}: the collator should emit int32"
        )
    meta = VarlenMetadata(cu_q.reshape(-1), cu_k.reshape(-1), _to_int(max_q), _to_int(max_k))
    return _KWARGS_CACHE.put(cu_q, meta, extra=id(cu_k))


_POS_CACHE = _IdentityCache()


def from_position_ids(position_ids: torch.Tensor) -> VarlenMetadata:
    """(1, T) packed position_ids -> documents start where positions do not increase by exactly 1."""
    hit = _POS_CACHE.get(position_ids)
    if hit is not None:
        return hit
    pos = position_ids.reshape(-1)
    total = pos.numel()
    starts = torch.ones(total, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = starts.nonzero().flatten().to(torch.int32)
    cu = torch.cat([idx, torch.tensor([total], dtype=torch.int32, device=pos.device)])
    max_len = int(cu.diff().max().item())  # the one host sync of this batch
    meta = VarlenMetadata(cu, cu, max_len, max_len)
    return _POS_CACHE.put(position_ids, meta)


_MASK_CACHE = _IdentityCache()


def from_padding_mask(attention_mask: torch.Tensor, q_len: int) -> VarlenMetadata:
    """(B, T_k) 0/1 mask -> unpadding indices; queries are the last ``q_len`` columns (decoding)."""
    hit = _MASK_CACHE.get(attention_mask, extra=q_len)
    if hit is not None:
        return hit
    mask_k = attention_mask.bool()
    mask_q = mask_k[:, -q_len:]
    lens_k = mask_k.sum(-1, dtype=torch.int32)
    lens_q = mask_q.sum(-1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=mask_k.device)
    cu_k = torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)])
    cu_q = torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)])
    both = torch.stack([lens_q.max(), lens_k.max()]).tolist()  # one host sync
    meta = VarlenMetadata(
        cu_q,
        cu_k,
        int(both[0]),
        int(both[1]),
        indices_q=mask_q.flatten().nonzero().flatten(),
        indices_k=mask_k.flatten().nonzero().flatten(),
    )
    return _MASK_CACHE.put(attention_mask, meta, extra=q_len)


@functools.lru_cache(maxsize=16)
def from_rows(batch: int, q_len: int, kv_len: int, device: torch.device) -> VarlenMetadata:
    """Each of ``batch`` rows is one sequence (bottom-right aligned when q_len < kv_len).

    Cached: every layer of a forward pass asks for the same shapes, so the offsets are built once.
    """
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    cu_k = (
        cu_q
        if kv_len == q_len
        else torch.arange(0, (batch + 1) * kv_len, kv_len, dtype=torch.int32, device=device)
    )
    return VarlenMetadata(cu_q, cu_k, q_len, kv_len)
