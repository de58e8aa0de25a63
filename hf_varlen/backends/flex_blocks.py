"""FlexAttention's inputs for a packed document mask, computed from ``cu_seqlens`` alone.

``document_tables(cu_q, cu_k, total_q, total_k, left, right, block)`` returns what the flex
backend's ``mask_mod`` reads (each token's document and position in it, each document's diagonal
shift) and the eight block tables of its ``BlockMask`` (partial and full blocks, KV-major and
Q-major) for the mask "same document, key inside the window around the bottom-right-aligned
diagonal": exactly the tables ``create_block_mask`` finds by evaluating that ``mask_mod`` on every
(q, kv) pair, but in O(T + blocks^2) work. Each query row sees one contiguous key interval (the
triton backend's ``row_bounds``), so per-block counts of the rows that touch / fully cover each
key block are two difference arrays and a cumulative sum.

It is one opaque ``torch.library`` op with a fake, so torch.compile traces none of it. Inductor in
torch 2.11 (H200) fails on both halves of the traced build under dynamic token counts:
``create_block_mask``'s tables (``CantSplit`` on the ``(blocks, blocks)`` reshapes)
and ``searchsorted`` over offsets computed in the graph (``NotImplementedError: SliceView``).
Eager, the mask build needs no compile of its own either.

Shapes (``nq = total_q // block``, ``nk = total_k // block``; totals are multiples of ``block``;
tokens past ``cu[-1]`` form one trailing padding document, so N + 1 documents in all)::

    cu_q, cu_k                              (N + 1,)         int32  cumulative document lengths
    outputs, in order, all int32:
    doc_q, pos_q / doc_k, pos_k             (total_q,) / (total_k,)  document, position in it
    shift                                   (N + 1,)         len_k - len_q of each document
    kv_num_blocks, kv_indices               (nq,), (nq, nk)  partial blocks, KV-major
    full_kv_num_blocks, full_kv_indices     (nq,), (nq, nk)  full blocks, KV-major
    q_num_blocks, q_indices                 (nk,), (nk, nq)  partial blocks, Q-major
    full_q_num_blocks, full_q_indices       (nk,), (nk, nq)  full blocks, Q-major

The tables come without BlockMask's leading (1, 1) dims (the caller adds them as views): a 4-D
op output guards on blocks > 1 under dynamic shapes (its memory-format check).
"""

from __future__ import annotations

import torch

from ..ops.attention.schedule import row_bounds
from ..ops.library import qualname

OP = qualname("flex_document_tables")


def _documents(cu: torch.Tensor, total: int):
    """Per token: document id and position inside it, (total,) int64 each; and the offsets with
    the padding document's end appended, (N + 2,) int64."""
    ends = torch.cat([cu.long(), cu.new_full((1,), total).long()])
    tok = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(ends[1:], tok, right=True)
    return doc, tok - ends[doc], ends


def _dense_blocks(a, b, nq, nk, block):
    """(nq, nk) int32 counts of the rows of each query block that touch / fully cover a key block."""
    empty = b <= a
    rows = torch.arange(a.shape[0], device=a.device) // block

    def count(first, end):
        end = torch.where(empty | (end < first), first, end)  # empty ranges add nothing
        diff = torch.zeros(nq, nk + 1, dtype=torch.int32, device=a.device)
        ones = torch.ones_like(rows, dtype=torch.int32)
        diff.index_put_((rows, first), ones, accumulate=True)
        diff.index_put_((rows, end), -ones, accumulate=True)
        return diff.cumsum(-1, dtype=torch.int32)[:, :nk]

    first_any = (a // block).clamp(max=nk)
    touch = count(first_any, (b + block - 1) // block)
    cover = count(((a + block - 1) // block).clamp(max=nk), b // block)
    full = cover == block
    return touch.gt(0) & ~full, full


def _ordered(dense: torch.Tensor):
    """Dense (rows, cols) bools -> (rows,) counts and (rows, cols) column order, as FlexAttention
    orders them (set columns first, ascending; stable)."""
    dense = dense.to(torch.int32)
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


@torch.library.custom_op(OP, mutates_args=())
def document_tables(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    total_q: int,
    total_k: int,
    left: int,
    right: int,
    block: int,
) -> list[torch.Tensor]:
    doc_q, pos_q, ends_q = _documents(cu_q, total_q)
    doc_k, pos_k, ends_k = _documents(cu_k, total_k)
    shift = ends_k.diff() - ends_q.diff()
    # Each row's visible keys as the triton backend's plan finds them (one rule for both), with
    # the padding document as a real one: the mask_mod lets padding rows see padding keys.
    lo, hi, _, _ = row_bounds(ends_q, ends_k, total_q, total_k, left, right)
    a, b = lo.long(), hi.long() + 1  # half-open; an empty row is (EMPTY_LO, 0): b <= a
    partial, full = _dense_blocks(a, b, total_q // block, total_k // block, block)
    index = [t.to(torch.int32) for t in (doc_q, pos_q, doc_k, pos_k, shift)]
    return [*index, *_ordered(partial), *_ordered(full), *_ordered(partial.T), *_ordered(full.T)]


@document_tables.register_fake
def _(cu_q, cu_k, total_q, total_k, left, right, block):
    nq, nk = total_q // block, total_k // block

    def empty(*shape):
        return cu_q.new_empty(shape, dtype=torch.int32)

    index = [empty(total_q), empty(total_q), empty(total_k), empty(total_k), empty(cu_q.shape[0])]
    tables = [
        t
        for rows, cols in ((nq, nk),) * 2 + ((nk, nq),) * 2
        for t in (empty(rows), empty(rows, cols))
    ]
    return index + tables
