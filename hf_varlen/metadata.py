"""``VarlenMetadata``, the one description of a packed batch from collator to kernel, and its
builders: where each packed document starts, built and checked once per batch.

Sources, in the order the transformers attention function tries them:
  * collator kwargs: ``cu_seq_lens_q/k`` (int32) + ``max_length_q/k`` (int)     -> one check
    (a sync on the CPU and for the first CUDA batch, read back without one later: coverage.py)
  * a 2-D padding mask (B, T_k) of 1 = token, 0 = pad                           -> unpad (one sync)
  * packed ``position_ids`` (1, T): a new document wherever positions do not go up by one -> one sync
  * nothing: every row of the batch is one causal sequence                      -> no sync
Each derived result is cached on the identity of its source tensors (``ops.common.TensorCache``),
so all layers of a forward pass (which receive the same tensor objects) share one computation:
at most one host sync per forward, none per layer, and none while ``torch.compile`` traces.

Under torch.compile (and for fake tensors, e.g. FakeTensorMode shape propagation) nothing is read
back from a tensor: collator offsets are used as given (the
eager coverage check cu[-1] == T is skipped), position_ids become fixed-length (T + 1) offsets
built on the device (``device_offsets_from_position_ids``), and no cache is consulted.

Which inputs may be Python ints, and why: ``max_seqlen_q/k`` (the collator's ``max_length_q/k``)
and the token counts T. Kernels that take a Python max length (FlashAttention 2/3/4, torch's
varlen_attn) size their launch from it on the host, so it must be known without reading the
device; the collator knows it for free when it builds the batch. Under torch.compile they may be
SymInts (automatic dynamic shapes turn a changing int into one) and are passed on as such, never
through ``int()``, which would specialise the graph. Everything else that describes the documents
is a device tensor. Our triton kernel needs neither max length.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import coverage

# torch.compile helpers, re-exported for their old import path (hf_varlen.compile_support)
from .compile_support import (  # noqa: F401
    MAX_LENGTH_SOURCES,
    NUM_ITEMS_SOURCES,
    checkpointed_side_effects,
    mark_dynamic_pack,
    symbolic_batch_ints,
)
from .ops.common import TensorCache, env_flag, max_length_int, tracing

__all__ = [
    "VarlenMetadata",
    "device_offsets_from_position_ids",
    "from_collator_kwargs",
    "from_lengths",
    "from_padding_mask",
    "from_position_ids",
    "from_rows",
]


@dataclass(frozen=True)
class VarlenMetadata:
    """Packed-layout description of a batch.

    cu_seqlens_q/k: (n + 1,) int32 offsets into the packed token axis.
    max_seqlen_q/k: Python ints (an upper bound on the longest document).
    indices_q/k: (T_q_real,) / (T_k_real,) int64 positions of the real tokens in the flattened (B*T)
        axis, or None when every token is real (no unpadding needed).
    rows: every document is one whole row of a (B, L) batch, ``max_seqlen_q/k`` tokens each
        (``from_rows``): the offsets are known from the shapes, so a backend may lay the rows out
        as a batch without reading them, and "auto" may treat the call as plain dense attention.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    indices_q: torch.Tensor | None = None
    indices_k: torch.Tensor | None = None
    rows: bool = False


class BatchState:
    """Values derived from the current batch's ``VarlenMetadata`` and shared by its layers.

    ``metadata.py`` hands every layer of a forward pass the same metadata object (each builder
    caches it on the batch's own tensors, their identity and version: ``ops.common.TensorCache``),
    so whatever a layer derives from it plus its own call (the backend's ``AttentionParams``, the
    packed-row checks of the transformers integration) is computed by layer 1 and looked up by
    layers 2..N: keyed on the metadata object's identity (a weak reference: a recycled id is never
    mistaken for it) and a caller-given ``key``. One batch at a time: a new metadata object (the
    next batch, or offsets edited in place, for which the builders build a new one) drops the
    previous batch's values. Under torch.compile nothing is cached (a traced graph has no object
    identity to key on). ``key`` must hold everything the value is derived from besides the
    metadata; at most ``size`` keys are kept per batch.

        value = state.get_or_compute(metadata, (layer_kind, ...), lambda: derive(metadata))
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._ref = None  # weakref to the current batch's metadata
        self._values: dict = {}

    def get_or_compute(self, metadata: VarlenMetadata, key, compute):
        if tracing():
            return compute()
        ref = self._ref
        if ref is None or ref() is not metadata:
            self._ref, self._values = weakref.ref(metadata), {}
        values = self._values
        if key in values:
            return values[key]
        value = compute()
        if len(values) >= self.size:
            values.clear()
        values[key] = value
        return value

    def clear(self) -> None:
        self._ref, self._values = None, {}


def from_lengths(lengths, device=None) -> VarlenMetadata:
    """Metadata for documents of the given lengths (a host list), e.g. from a collator."""
    lengths = [int(n) for n in lengths]
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    m = max(lengths) if lengths else 0
    return VarlenMetadata(cu, cu, m, m)


_KWARGS_CACHE = TensorCache()


def _check_covers(cu_q, cu_k, max_q, max_k, total_q: int, total_k: int) -> tuple[int, int]:
    """The synchronous coverage check (``coverage.check_now``): one host sync for both offset
    tensors and any 0-d max lengths; returns the max lengths as ints."""
    return coverage.check_now(cu_q, cu_k, max_q, max_k, total_q, total_k)


def from_collator_kwargs(
    cu_q,
    cu_k,
    max_q,
    max_k,
    total_q: int | None = None,
    total_k: int | None = None,
    *,
    device: torch.device | None = None,
) -> VarlenMetadata:
    """Collator-provided offsets (max lengths may be ints or 0-d tensors).

    With ``total_q/k`` (the batch's token counts) the offsets are checked to cover the batch, in
    eager mode, once per batch (one host sync); while compiling nothing is read back. With
    ``device`` (the attention inputs' device) they must be on it. The result is what the backend
    gets, unchanged: int32 offsets on ``device`` describing one number of documents on each side,
    max lengths as ints (SymInts under torch.compile).
    """
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise TypeError(
            f"cu_seq_lens_q/k must be int32, got {cu_q.dtype}/{cu_k.dtype}: the collator should emit int32"
        )
    if cu_q.numel() < 2 or cu_k.numel() < 2:
        raise ValueError(
            f"cu_seq_lens_q/k need n_docs + 1 >= 2 offsets, got {cu_q.numel()} and {cu_k.numel()} "
            "(an empty batch: the collator received no tokens)"
        )
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seq_lens_q and cu_seq_lens_k must describe the same number of documents, got "
            f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
        )
    if device is not None and (cu_q.device != device or cu_k.device != device):
        raise ValueError(
            f"cu_seq_lens_q/k must be on the model's device ({device}), got {cu_q.device} and "
            f"{cu_k.device}: move the batch with the rest of the inputs"
        )

    def build() -> VarlenMetadata:
        flat_q, flat_k = cu_q.reshape(-1), cu_k.reshape(-1)
        if tracing(cu_q):  # no sync: ints as given, a 0-d tensor -> the bound T
            return VarlenMetadata(
                flat_q, flat_k, _max_traced(max_q, total_q), _max_traced(max_k, total_k)
            )
        if total_q is None:
            return VarlenMetadata(
                flat_q,
                flat_k,
                max_length_int("max_length_q", max_q, host_read=True),
                max_length_int("max_length_k", max_k, host_read=True),
            )
        if flat_q.is_cuda and torch.cuda.is_current_stream_capturing():
            # no host read inside a capture: checked in the eager warm-up of the same shapes
            if isinstance(max_q, torch.Tensor) or isinstance(max_k, torch.Tensor):
                raise TypeError(
                    "max_length_q/k must be Python ints while a CUDA graph is captured (a tensor "
                    "would need a host read); the collator emits ints"
                )
            return VarlenMetadata(flat_q, flat_k, int(max_q), int(max_k))
        if coverage.DEFERRED.wants(flat_q, max_q, max_k) and not env_flag("HF_VARLEN_VALIDATE"):
            # read back later, without a sync (HF_VARLEN_VALIDATE=1: checked now, for debugging)
            coverage.DEFERRED.submit(flat_q, flat_k, max_q, max_k, total_q, total_k)
            return VarlenMetadata(flat_q, flat_k, int(max_q), int(max_k))
        mq, mk = _check_covers(flat_q, flat_k, max_q, max_k, total_q, total_k)
        return VarlenMetadata(flat_q, flat_k, mq, mk)

    # keyed on the collator's own tensor objects (a reshape would be a new object per layer)
    return _KWARGS_CACHE.get_or_compute((cu_q, cu_k), build, extra=(total_q, total_k))


def _max_traced(x, total):
    """A max length under torch.compile: a Python int / SymInt as given (never int(): that would
    specialise the graph on it), a tensor replaced by the upper bound ``total`` (reading it would
    be a host sync and a graph break)."""
    if isinstance(x, torch.Tensor):
        if total is None:
            raise TypeError(
                "max_length_q/k must be Python ints under torch.compile (a tensor would need a "
                "host sync); the collator emits ints"
            )
        return total
    return x


_POS_CACHE = TensorCache()


def device_offsets_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(T + 1,) int32 document offsets built on the device from packed position_ids, no host sync.

    A document starts wherever positions do not increase by exactly 1 (and at token 0). The
    length is fixed by T alone, never by the number of documents: entry d is the start of
    document d, and the unused slots after the last document repeat T (zero-length documents).
    So under torch.compile the number of documents is never a shape (nothing to specialise on).
    """
    pos = position_ids.reshape(-1)
    total = pos.shape[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    doc = starts.cumsum(0) - 1  # document index of every token, 0 .. n_docs - 1
    tokens = torch.arange(total, device=pos.device, dtype=torch.int64)
    cu = torch.full((total + 1,), total, dtype=torch.int64, device=pos.device)
    # the smallest token index of each document is its start; unused slots keep T
    cu = cu.scatter_reduce(0, doc, tokens, reduce="amin", include_self=True)
    return cu.to(torch.int32)


def from_position_ids(position_ids: torch.Tensor) -> VarlenMetadata:
    """(1, T) packed position_ids -> documents start where positions do not increase by exactly 1.

    Eager: the exact offsets (n_docs + 1 entries) and the true longest document, for one host sync
    per batch (cached across layers). While compiling (or for fake tensors):
    ``device_offsets_from_position_ids`` (T + 1
    entries, zero-length documents after the last) and max_seqlen = T, an upper bound; no sync.
    """
    if tracing(position_ids):
        cu = device_offsets_from_position_ids(position_ids)
        total = position_ids.numel()
        return VarlenMetadata(cu, cu, total, total)

    def build() -> VarlenMetadata:
        pos = position_ids.reshape(-1)
        total = pos.numel()
        starts = torch.ones(total, dtype=torch.bool, device=pos.device)
        starts[1:] = pos[1:] != pos[:-1] + 1
        idx = starts.nonzero().flatten().to(torch.int32)
        cu = torch.cat([idx, torch.tensor([total], dtype=torch.int32, device=pos.device)])
        max_len = int(cu.diff().max().item())  # the one host sync of this batch
        return VarlenMetadata(cu, cu, max_len, max_len)

    return _POS_CACHE.get_or_compute(position_ids, build)


_MASK_CACHE = TensorCache()


def from_padding_mask(attention_mask: torch.Tensor, q_len: int) -> VarlenMetadata:
    """(B, T_k) or (B, 1, 1, T_k) 0/1 mask -> unpadding indices; queries are the last ``q_len``
    columns (decoding)."""

    def build() -> VarlenMetadata:
        mask_k = attention_mask.bool().reshape(attention_mask.shape[0], attention_mask.shape[-1])
        mask_q = mask_k[:, -q_len:]
        lens_k = mask_k.sum(-1, dtype=torch.int32)
        lens_q = mask_q.sum(-1, dtype=torch.int32)
        zero = torch.zeros(1, dtype=torch.int32, device=mask_k.device)
        cu_k = torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)])
        cu_q = torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)])
        both = torch.stack([lens_q.max(), lens_k.max()]).tolist()  # one host sync
        return VarlenMetadata(
            cu_q,
            cu_k,
            int(both[0]),
            int(both[1]),
            indices_q=mask_q.flatten().nonzero().flatten(),
            indices_k=mask_k.flatten().nonzero().flatten(),
        )

    return _MASK_CACHE.get_or_compute(attention_mask, build, extra=q_len)


# Vision encoders that split each layer's attention per window / image (transformers' non-flash
# route) ask for one shape per window or image size, in turn, every layer: the entries are a few
# ints each, so enough are kept that a forward pass finds each of its shapes again.
_ROWS_CACHE = TensorCache(size=64)


def from_rows(batch: int, q_len: int, kv_len: int, device: torch.device) -> VarlenMetadata:
    """Each of ``batch`` rows is one sequence (bottom-right aligned when q_len < kv_len); the
    metadata says so (``rows``).

    Cached on the shapes: every layer of a forward pass asks for the same ones, so the offsets are
    built once (and never cached while compiling: no eager tensors baked into a graph).
    """

    def build() -> VarlenMetadata:
        cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
        cu_k = (
            cu_q
            if kv_len == q_len
            else torch.arange(0, (batch + 1) * kv_len, kv_len, dtype=torch.int32, device=device)
        )
        return VarlenMetadata(cu_q, cu_k, q_len, kv_len, rows=True)

    return _ROWS_CACHE.get_or_compute((), build, extra=(batch, q_len, kv_len, torch.device(device)))
