"""Forward kernel of the Triton varlen attention (online softmax over a compact tile schedule).

One program = one tile: ``TILE = BLOCK_M // FOLD`` consecutive query tokens of the packed stream x
``FOLD`` query heads that share one KV head (GQA folding: K/V are loaded once for all of them). The
tile walks the keys [min lo, max hi] of its rows (schedule.py) in steps of BLOCK_N:

    s = (q . k) * scale                         (softcap: s = softcap * tanh(s / softcap))
    s = -inf where not (lo[row] <= key <= hi[row])   (block-diagonal x causal x window mask)
    m, l, acc = online-softmax update (base 2)
    o = acc / l,   lse = ln(sum_j exp(s_j)) = (m + log2 l) * ln 2

Key blocks that every row of the tile sees entirely skip the mask. Rows that see no key give o = 0
and lse = +inf (so the backward's exp(s - lse) is 0 there). Non-finite input stays inside its
document (docs/attention-numerics.md): masked blocks zero non-finite V rows (p is 0 on another
document's keys, but 0 * NaN is not) and make NaN the rows that see one; a row that sees keys
but ends with no positive weight (NaN, or only -inf scores) is NaN in o and lse. With
``KernelConfig.tma`` the K/V blocks come through tensor descriptors where the layout allows
(tma.py).

Shapes: q (T_q, H_q, D), k/v (T_k, H_kv, D), o (T_q, H_q, D), lse (H_q, T_q) fp32,
lo/hi (T_q,) int32, order (n_tiles + 1,) int32 (heaviest first, then one never-launched entry);
the grid is n_tiles * (H_q / FOLD) programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tma import stream_descriptors

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _scores(qk, scale_a, scale_b, SOFTCAP: tl.constexpr):
    """Base-2 logits from raw q.k: scale (and softcap) folded into two constants (see launcher)."""
    if SOFTCAP:
        return _tanh(qk * scale_a) * scale_b
    return qk * scale_a


@triton.jit
def _load(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows x head_dim) block; masks only what can be out of range (zeros there)."""
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_ok & d_ok, other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_ok, other=0.0)


@triton.jit
def _desc_rows(desc, tok, head, ROWS: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (ROWS x HEADS, D) block of a tensor descriptor at token ``tok``, head ``head``
    (tma.py): rows token-major, heads minor, as the folded tiles order them."""
    return desc.load([tok, head, 0]).reshape([ROWS * HEADS, BLOCK_D])


@triton.jit
def _keys_t(
    desc, base, start, kv_head_tma, cols, col_ok, d, d_ok, stride_t, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """A (D, BLOCK_N) block of K or V transposed: keys ``start`` .. of KV head ``kv_head_tma``,
    through the descriptor (TMA; keys past ``col_ok`` are loaded too: real rows, or zeros past T,
    which the caller's mask drops) or through pointers at ``base`` (zeros past ``col_ok``)."""
    if TMA:
        return tl.trans(_desc_rows(desc, start, kv_head_tma, BLOCK_N, 1, BLOCK_D))
    return _load(base + cols[None, :] * stride_t + d[:, None], col_ok[None, :], d_ok[:, None],
                 MASKED, EVEN_D)  # fmt: skip


@triton.jit
def _split(span_lo, span_hi, full_lo, full_hi, STEP: tl.constexpr):
    """Steps of STEP over [span_lo, span_hi]: n_head masked, then n_mid that lie inside
    [full_lo, full_hi] (seen by every row: no mask), then the rest masked."""
    n_all = tl.maximum(span_hi + 1 - span_lo + STEP - 1, 0) // STEP
    n_head = tl.minimum(tl.maximum(full_lo - span_lo + STEP - 1, 0) // STEP, n_all)
    mid = span_lo + n_head * STEP
    n_mid = tl.minimum(tl.maximum(full_hi + 1 - mid, 0) // STEP, n_all - n_head)
    return n_head, n_mid, n_all


@triton.jit
def _query_rows(
    work, ORDER, T_q, N_HEAD_BLOCKS, GROUP: tl.constexpr, FOLD: tl.constexpr,
    BLOCK_M: tl.constexpr, LONG_INDEXING: tl.constexpr,
):  # fmt: skip
    """The BLOCK_M rows of query work item ``work`` (tile ORDER[work // N_HEAD_BLOCKS] x head block
    work % N_HEAD_BLOCKS): FOLD query heads of one KV group per token, row r = token r // FOLD,
    head r % FOLD. Returns (tok, head, kv_head, kv_head_tma, row_ok); tok / head / kv_head are
    int64 with LONG_INDEXING, kv_head_tma stays int32 (descriptor coordinates are int32)."""
    TILE: tl.constexpr = BLOCK_M // FOLD
    tile = tl.load(ORDER + work // N_HEAD_BLOCKS)
    head_block = work % N_HEAD_BLOCKS
    r = tl.arange(0, BLOCK_M)
    tok = tile * TILE + r // FOLD
    head = head_block * FOLD + r % FOLD
    kv_head = (head_block * FOLD) // GROUP
    kv_head_tma = kv_head
    row_ok = (r < TILE * FOLD) & (tok < T_q)
    if LONG_INDEXING:
        tok = tok.to(tl.int64)
        head = head.to(tl.int64)
        kv_head = kv_head.to(tl.int64)
    return tok, head, kv_head, kv_head_tma, row_ok


@triton.jit
def _tile_bounds(LO, HI, rows, row_ok, STEP: tl.constexpr):
    """What a tile's rows see: per row [lo, hi] (from the plan's LO / HI; rows past T get the
    empty interval), the tile's span [span_lo, span_hi], and its steps of STEP split by ``_split``
    against the interval that every real row sees (rows past T compute garbage, never stored).
    Returns (lo, hi, span_lo, span_hi, n_head, n_mid, n_all)."""
    EMPTY: tl.constexpr = 2147483647
    lo = tl.load(LO + rows, mask=row_ok, other=EMPTY)
    hi = tl.load(HI + rows, mask=row_ok, other=-1)
    span_lo = tl.min(lo, 0)
    span_hi = tl.max(hi, 0)
    full_lo = tl.max(tl.where(row_ok, lo, -1), 0)
    full_hi = tl.min(tl.where(row_ok, hi, EMPTY), 0)
    n_head, n_mid, n_all = _split(span_lo, span_hi, full_lo, full_hi, STEP)
    return lo, hi, span_lo, span_hi, n_head, n_mid, n_all


@triton.jit
def _fwd_step(
    acc, m_i, l_i, q, k_base, v_base, start, span_hi, lo, hi, d, d_ok, stride_kt, stride_vt,
    scale_a, scale_b, K_DESC, V_DESC, kv_head_tma, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr, LONG_INDEXING: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols <= span_hi
    if LONG_INDEXING:
        cols = cols.to(tl.int64)
    kt = _keys_t(K_DESC, k_base, start, kv_head_tma, cols, col_ok, d, d_ok, stride_kt, BLOCK_N,
                 BLOCK_D, EVEN_D, MASKED, TMA)  # fmt: skip
    s = _scores(_dot(q, kt, IEEE), scale_a, scale_b, SOFTCAP)
    if MASKED:
        vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:  # p is 0 on the masked keys; their V rows are cleaned below
        v = _desc_rows(V_DESC, start, kv_head_tma, BLOCK_N, 1, BLOCK_D)
    else:
        v = _load(
            v_base + cols[:, None] * stride_vt + d[None, :],
            col_ok[:, None],
            d_ok[None, :],
            MASKED,
            EVEN_D,
        )
    if MASKED:
        # Only a masked block can hold keys of several documents. p is 0 on another document's
        # keys, but 0 * NaN (or inf) in the dot below is NaN: non-finite V rows are zeroed here,
        # and the rows that do see one are made NaN through l_i (sticky; the tile's end turns a
        # non-finite l_i into NaN o and lse). Unmasked blocks are seen whole by every row, so
        # IEEE arithmetic carries a non-finite V there by itself.
        v_bad = v * 0.0 != 0.0  # NaN or +-inf
        v = tl.where(v_bad, tl.zeros_like(v), v)
        col_bad = tl.max(v_bad.to(tl.int32), 1) > 0
        row_bad = tl.max((vis & col_bad[None, :]).to(tl.int32), 1) > 0
        l_i = tl.where(row_bad, float("nan"), l_i)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _fwd_tile(
    work, Q, K, V, O, LSE, LO, HI, ORDER, K_DESC, V_DESC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    T_q, N_HEAD_BLOCKS, scale_a, scale_b,
    GROUP: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    LONG_INDEXING: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One work item: tile ORDER[work // N_HEAD_BLOCKS] x head block work % N_HEAD_BLOCKS."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    tok, head, kv_head, kv_head_tma, row_ok = _query_rows(
        work, ORDER, T_q, N_HEAD_BLOCKS, GROUP, FOLD, BLOCK_M, LONG_INDEXING
    )
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lo, hi, span_lo, span_hi, n_head, n_mid, n_all = _tile_bounds(LO, HI, tok, row_ok, BLOCK_N)

    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    args = (q, k_base, v_base)
    tma = (K_DESC, V_DESC, kv_head_tma)
    for i in range(0, n_head):
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, *args, span_lo + i * BLOCK_N, span_hi, lo, hi, d, d_ok, stride_kt,
            stride_vt, scale_a, scale_b, *tma, BLOCK_N, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D,
            True, TMA,
        )  # fmt: skip
    for i in range(n_head, n_head + n_mid):
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, *args, span_lo + i * BLOCK_N, span_hi, lo, hi, d, d_ok, stride_kt,
            stride_vt, scale_a, scale_b, *tma, BLOCK_N, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D,
            False, TMA,
        )  # fmt: skip
    for i in range(n_head + n_mid, n_all):
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, *args, span_lo + i * BLOCK_N, span_hi, lo, hi, d, d_ok, stride_kt,
            stride_vt, scale_a, scale_b, *tma, BLOCK_N, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D,
            True, TMA,
        )  # fmt: skip

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
    # A row that sees keys but has no positive weight is not an empty row: its l_i is NaN (it
    # met a NaN, or a non-finite V above), or every score it sees is -inf (IEEE softmax: 0 / 0).
    # It is NaN in o and lse, never zeros (docs/attention-numerics.md); the backward then keeps
    # the NaN inside the document (p = exp(s - NaN) is masked off for other documents' keys).
    poisoned = (~seen) & (lo <= hi)
    out = tl.where(poisoned[:, None], float("nan"), out)
    lse = tl.where(poisoned, float("nan"), lse)
    tl.store(
        O + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + head * T_q + tok, lse, mask=row_ok)


@triton.jit(do_not_specialize=["T_q", "T_k"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE, LO, HI, ORDER, N_WORK, K_DESC, V_DESC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    T_q, T_k, N_HEAD_BLOCKS, scale_a, scale_b,
    GROUP: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    LONG_INDEXING: tl.constexpr, PERSISTENT: tl.constexpr, BOUNDED: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """One program per work item; BOUNDED: only the first N_WORK[0] tiles of ORDER are work (the
    other programs exit at once); PERSISTENT: a fixed grid whose programs take work items
    pid, pid + grid, ... of those (x head blocks)."""
    # Inductor types Python-float arguments as fp64 (eager triton: fp32); fp64 scores would change
    # the type of the loop-carried m_i and run fp64 math, so the scalars are fp32 from here on.
    scale_a = tl.cast(scale_a, tl.float32)
    scale_b = tl.cast(scale_b, tl.float32)
    args = (Q, K, V, O, LSE, LO, HI, ORDER, K_DESC, V_DESC, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, T_q, N_HEAD_BLOCKS, scale_a,
            scale_b)  # fmt: skip
    pid = tl.program_id(0)
    if PERSISTENT:
        n_work = tl.load(N_WORK) * N_HEAD_BLOCKS
        for work in range(pid, n_work, tl.num_programs(0)):
            _fwd_tile(
                work, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
                LONG_INDEXING, TMA,
            )  # fmt: skip
    elif BOUNDED:
        if pid < tl.load(N_WORK) * N_HEAD_BLOCKS:
            _fwd_tile(
                pid, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
                LONG_INDEXING, TMA,
            )  # fmt: skip
    else:
        _fwd_tile(
            pid, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
            LONG_INDEXING, TMA,
        )  # fmt: skip


def launcher(kernel, traceable: bool):
    """``kernel`` itself, or its ``wrap_triton`` wrapper when ``traceable``. An interpreted kernel
    (TRITON_INTERPRET=1) is never wrapped: torch cannot trace it (its op is opaque, see
    torch_library.py)."""
    if not traceable or not isinstance(kernel, triton.runtime.jit.JITFunction):
        return kernel
    return torch.library.wrap_triton(kernel)


def launch_grid(order: torch.Tensor, per_tile: int, bound: tuple[torch.Tensor, int] | None):
    """(N_WORK argument, grid) of a launch over ``order`` with ``per_tile`` programs per tile:
    every tile but the never-launched last entry (N_WORK unused: ``order`` stands in); with
    ``bound`` = (n_tiles, programs), the first n_tiles tiles only, by a persistent grid of
    ``programs`` or, for 0, one program per tile of ``order`` whose programs past n_tiles exit at
    once (a grid fixed by T either way: no host read of n_tiles)."""
    if bound is None:
        return order, ((order.numel() - 1) * per_tile,)
    n_tiles, programs = bound
    return n_tiles, ((programs,) if programs > 0 else ((order.numel() - 1) * per_tile,))


def score_constants(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(scale_a, scale_b) so that base-2 logits are qk*a, or tanh(qk*a)*b with a softcap."""
    if softcap > 0:
        return softmax_scale / softcap, softcap * LOG2E
    return softmax_scale * LOG2E, 1.0


def needs_long_indexing(*tensors: torch.Tensor) -> bool:
    """True when an element offset of any tensor (by its strides) can reach 2^31."""
    for t in tensors:
        top = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
        if top >= 2**31 or t.numel() >= 2**31:
            return True
    return False


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lo_q: torch.Tensor,
    hi_q: torch.Tensor,
    order: torch.Tensor,
    *,
    softmax_scale: float,
    softcap: float,
    fold: int,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    traceable: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    bound: tuple[torch.Tensor, int] | None = None,
    tma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns o (T_q, H_q, D) and lse (H_q, T_q) fp32 (natural log).

    ``traceable``: launch through ``torch.library.wrap_triton`` (inside the registered op, so
    torch.compile sees the kernel); eager calls launch the kernel directly (no HOP dispatch).
    ``out``: (o, lse) to write into (the rows of this launch's tiles) instead of new tensors.
    ``bound``: (n_tiles (1,) int32 on the device, programs): only the first n_tiles entries of
    ``order`` are work (the long-document launch, ``launch_grid``).
    ``tma``: stream K/V through tensor descriptors where the layout allows (tma.py)."""
    t_q, h_q, dim = q.shape
    t_k, h_kv = k.shape[0], k.shape[1]
    if out is None:
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((h_q, t_q), dtype=torch.float32, device=q.device)
    else:
        o, lse = out
    if t_q == 0:
        return o, lse
    scale_a, scale_b = score_constants(softmax_scale, softcap)
    n_head_blocks = h_q // fold
    n_work, grid = launch_grid(order, n_head_blocks, bound)
    block_d = max(16, triton.next_power_of_2(dim))
    descs = stream_descriptors(tma, q.device, (k, v), block_n, 1, block_d)
    launcher(_attn_fwd_kernel, traceable)[grid](
        q, k, v, o, lse, lo_q, hi_q, order, n_work, *(descs or (k, v)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        t_q, t_k, n_head_blocks, scale_a, scale_b,
        GROUP=h_q // h_kv, FOLD=fold, HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, SOFTCAP=softcap > 0, IEEE=q.dtype == torch.float32,
        LONG_INDEXING=needs_long_indexing(q, k, v, o) or h_q * t_q >= 2**31,
        PERSISTENT=bound is not None and bound[1] > 0, BOUNDED=bound is not None,
        TMA=descs is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return o, lse
