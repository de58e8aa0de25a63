"""Collator offsets must cover the batch: the eager check of ``cu_seq_lens_q/k`` against T.

A packed batch's offsets must start at 0, never decrease, end at the batch's token count and fit
``max_length_q/k``; ``metadata.from_collator_kwargs`` checks that once per batch (never per layer).
The check is eight tiny reductions whose result must reach the host, and how it gets there
decides its cost (docs/BENCHMARKS.md, "The eager coverage check": a synchronous read costs 15% of
a 1B-shape step at 2.8K tokens, where the CPU would otherwise run ahead of the GPU):

  * synchronous (``check_now``, one host sync) for CPU tensors (free there), when a max length is a
    0-d tensor (its value is needed as an int anyway), and for the first CUDA batch of the process,
    so that a systematic mistake (a collator that never covers the batch) fails before any update;
  * deferred (``DEFERRED``) for every later CUDA batch: the stats are copied to pinned host memory
    without a sync and read once the copy has landed, at the next batch's check or at
    ``check_pending_offsets()`` (``hf-varlen train`` calls it after each step's loss read, before
    the optimizer step; the read is free there). The batch itself runs with its offsets clamped
    on the device (``backends._common``), so it never reads out of bounds while its check is in
    flight;
  * not at all while a CUDA graph is being captured (a host read is illegal there; the eager
    warm-up before capture checked the same shapes) or while torch.compile traces (the caller
    skips it).
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from .ops.common import offsets_violation

__all__ = ["DEFERRED", "DeferredChecks", "check_now", "check_pending_offsets", "coverage_error"]

DEFER_DEVICES = {"cuda"}  # device types whose checks are read back without a sync


def _stats(cu_q: torch.Tensor, cu_k: torch.Tensor, extra=()) -> torch.Tensor:
    """(8 + len(extra),) int64 on the offsets' device: first, last, smallest and largest step of
    each side, then the ``extra`` 0-d tensors."""
    dq, dk = cu_q.diff(), cu_k.diff()
    stats = [cu_q[0], cu_q[-1], dq.min(), dq.max(), cu_k[0], cu_k[-1], dk.min(), dk.max(), *extra]
    return torch.stack([t.reshape(()).to(torch.int64) for t in stats])


def coverage_error(host, total_q: int, total_k: int, max_q: int, max_k: int) -> str | None:
    """What is wrong with offsets whose ``_stats`` are ``host`` (a list of ints), or None: the
    rule of ``ops.common.offsets_violation``, worded for the collator's fields."""
    hint = (
        "the collator's documents must cover every token of the batch exactly once (did "
        "position_ids / input_ids change after collation, or was the batch truncated?)"
    )
    for side, (first, last, shortest, longest), total, max_len in (
        ("q", host[:4], total_q, max_q),
        ("k", host[4:8], total_k, max_k),
    ):
        broken = offsets_violation(first, last, shortest, longest, total, max_len)
        if broken == "max":
            return (
                f"max_length_{side} is {max_len} but cu_seq_lens_{side} holds a {longest}-token "
                f"document; max_length_{side} must be at least the longest document"
            )
        if broken is not None:
            return (
                f"cu_seq_lens_{side} runs from {first} to {last} (smallest step {shortest}) but "
                f"the batch has {total} tokens: it must start at 0, never decrease and end at "
                f"{total}; " + hint
            )
    return None


def check_now(cu_q, cu_k, max_q, max_k, total_q: int, total_k: int) -> tuple[int, int]:
    """The synchronous check: one host sync for both offset tensors (and any 0-d max_length
    tensors). Returns the max lengths as ints; raises ValueError naming the bad field."""
    extra = [m for m in (max_q, max_k) if isinstance(m, torch.Tensor)]
    host = _stats(cu_q, cu_k, extra).tolist()  # the one sync
    rest = iter(host[8:])
    mq, mk = (next(rest) if isinstance(m, torch.Tensor) else int(m) for m in (max_q, max_k))
    error = coverage_error(host, total_q, total_k, mq, mk)
    if error is not None:
        raise ValueError(error)
    if cu_q.device.type in DEFER_DEVICES:  # a CPU batch says nothing about the GPU's first one
        DEFERRED.armed = True
    return mq, mk


@dataclasses.dataclass
class _Pending:
    host: torch.Tensor  # (8,) int64, pinned when the offsets are on a GPU
    event: object  # torch.cuda.Event recorded after the copy, None on the CPU
    sizes: tuple[int, int, int, int]  # total_q, total_k, max_q, max_k
    batch: int  # serial number of the batch, for the message


class DeferredChecks:
    """Checks whose stats are on their way to the host; at most ``depth`` are left unread."""

    def __init__(self, depth: int = 2):
        self.depth = depth
        self.pending: collections.deque[_Pending] = collections.deque()
        self.batches = 0
        self.armed = False  # True once a synchronous check passed: later CUDA batches defer

    def wants(self, cu: torch.Tensor, max_q, max_k) -> bool:
        """Whether the check of this batch should be deferred (see the module doc)."""
        return (
            self.armed
            and cu.device.type in DEFER_DEVICES
            and not isinstance(max_q, torch.Tensor)
            and not isinstance(max_k, torch.Tensor)
        )

    def submit(self, cu_q, cu_k, max_q: int, max_k: int, total_q: int, total_k: int) -> None:
        self.batches += 1
        self.resolve(block=False)  # earlier batches' checks, before this one's joins them
        stats = _stats(cu_q, cu_k)
        on_gpu = stats.is_cuda
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=on_gpu)
        host.copy_(stats, non_blocking=on_gpu)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        sizes = (total_q, total_k, int(max_q), int(max_k))
        self.pending.append(_Pending(host, event, sizes, self.batches))

    def resolve(self, block: bool) -> None:
        """Read every check whose copy has landed (all of them with ``block``, and the oldest
        beyond ``depth`` in any case); raise ValueError for the first bad one."""
        while self.pending:
            item = self.pending[0]
            ready = item.event is None or item.event.query()
            if not (ready or block or len(self.pending) > self.depth):
                return
            if item.event is not None:
                item.event.synchronize()  # has landed (or is the oldest beyond depth): no stall
            self.pending.popleft()
            error = coverage_error(item.host.tolist(), *item.sizes)
            if error is not None:
                late = self.batches - item.batch
                self.pending.clear()
                raise ValueError(
                    f"{error} (found {late} batch(es) after that batch ran: its check is read back "
                    "without a host sync; it ran with its offsets clamped into the batch)"
                    if late
                    else error
                )

    def reset(self) -> None:
        self.pending.clear()
        self.batches = 0
        self.armed = False


DEFERRED = DeferredChecks()


def check_pending_offsets() -> None:
    """Read every deferred coverage check now (one sync; free right after a loss read) and raise
    ValueError if a batch's ``cu_seq_lens`` did not cover it. Call it before the optimizer step in
    your own loop to keep a bad batch from updating the weights; ``hf-varlen train`` does."""
    DEFERRED.resolve(block=True)
