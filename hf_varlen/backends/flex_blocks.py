"""FlexAttention block tables of a packed document mask, computed from ``cu_seqlens`` alone.

``document_block_tables(cu_q, cu_k, total_q, total_k, left, right, block)`` returns the eight
tensors of a ``BlockMask`` (partial and full blocks, KV-major and Q-major) for the mask "same
document, key inside the window around the bottom-right-aligned diagonal" that the flex backend's
``mask_mod`` evaluates, exactly as ``create_block_mask`` would find them by evaluating that
``mask_mod`` on every (q, kv) pair, but in O(T + blocks^2) work: each query row sees one contiguous
key interval, so per-block counts of the rows that touch / fully cover each key block are two
difference arrays and a cumulative sum.

It is an opaque ``torch.library`` op with a fake, so torch.compile never traces it: Inductor's
lowering of ``create_block_mask`` under dynamic token counts fails in torch 2.11 (``CantSplit`` on
the ``(blocks, blocks)`` tables, H200, commit a4f1b57), and the eager build needs no compile of
its own either.

Shapes (``nq = total_q // block``, ``nk = total_k // block``; totals are multiples of ``block``;
tokens past ``cu[-1]`` form one trailing padding document)::

    cu_q, cu_k                       (N + 1,) int32   cumulative document lengths
    kv_num_blocks, full_kv_num_blocks (1, 1, nq)      int32
    kv_indices, full_kv_indices       (1, 1, nq, nk)  int32
    q_num_blocks, full_q_num_blocks   (1, 1, nk)      int32
    q_indices, full_q_indices         (1, 1, nk, nq)  int32
"""

from __future__ import annotations

import torch

from ..ops.library import qualname

OP = qualname("flex_document_block_tables")


def _extended(cu: torch.Tensor, total: int) -> torch.Tensor:
    """cu with the trailing padding document's end appended: (N + 2,) int64."""
    return torch.cat([cu.long(), cu.new_full((1,), total).long()])


def _row_intervals(cu_q, cu_k, total_q, total_k, left, right):
    """Per query token, the half-open global key interval [a, b) it may attend (b <= a: none)."""
    eq, ek = _extended(cu_q, total_q), _extended(cu_k, total_k)
    tok = torch.arange(total_q, device=cu_q.device)
    doc = torch.searchsorted(eq[1:], tok, right=True)  # (T_q,) document of each query token
    len_q, len_k = eq.diff(), ek.diff()
    start_k, n_k = ek[doc], len_k[doc]
    diag = tok - eq[doc] + (n_k - len_q[doc])  # key position on the bottom-right diagonal
    lo = (diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(diag)
    hi = torch.minimum(diag + right + 1, n_k) if right >= 0 else n_k
    return start_k + lo, start_k + hi.clamp(min=0)


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
def document_block_tables(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    total_q: int,
    total_k: int,
    left: int,
    right: int,
    block: int,
) -> list[torch.Tensor]:
    a, b = _row_intervals(cu_q, cu_k, total_q, total_k, left, right)
    partial, full = _dense_blocks(a, b, total_q // block, total_k // block, block)
    return [*_ordered(partial), *_ordered(full), *_ordered(partial.T), *_ordered(full.T)]


@document_block_tables.register_fake
def _(cu_q, cu_k, total_q, total_k, left, right, block):
    nq, nk = total_q // block, total_k // block

    def pair(rows, cols):
        return cu_q.new_empty((rows,), dtype=torch.int32), cu_q.new_empty(
            (rows, cols), dtype=torch.int32
        )

    return [*pair(nq, nk), *pair(nq, nk), *pair(nk, nq), *pair(nk, nq)]
