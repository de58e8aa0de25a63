"""Backward kernels of the Triton varlen attention: dQ (+ delta) per query tile, dK/dV per key tile.

With P = exp(S - lse) recomputed from the saved lse, dO the upstream gradient and
delta = rowsum(dO * O):

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)   (* (1 - tanh^2) with a softcap)
    dQ = scale * dS K  dK = scale * dS^T Q

Split backward (the default): two kernels, no atomics, so it is bitwise deterministic:
1. ``_attn_bwd_dq_kernel``: the forward's tiling (query tokens x folded query heads, keys
   [min lo, max hi]); it first computes and stores delta for its rows, then accumulates dQ.
2. ``_attn_bwd_dkdv_kernel``: one program per (key tile of BLOCK_N tokens, KV head); it walks the
   query rows [min qlo, max qhi] that see the tile, for every query head of the KV group
   (``FOLD`` heads per step), so GQA/MQA gradients are summed in registers, never through memory.

Fused backward (``KernelConfig.bwd_fused``, never when a deterministic backward is requested):
``_attn_bwd_delta_kernel`` computes delta, then the dK/dV kernel with ``ATOMIC_DQ`` also adds each
step's dS K into an fp32 dQ buffer (FA2's scheme): the split path computes QK^T and dO V^T twice
(7 matmuls per visible block), the fused one once (5), which is where long documents spend the
backward; the atomics make the summation order of dQ vary between runs. With ``KernelConfig.tma``
each step's dQ block goes into the buffer as one bulk TMA reduction (FA3's scheme) instead of
per-element atomics.

Both are launched over heaviest-first tile orders (schedule.py). With
``KernelConfig.tma`` the blocks each inner loop streams (K/V in dQ, Q/dO in dK/dV) come through
tensor descriptors where the layout allows (tma.py).
Shapes: q/do/o/dq (T_q, H_q, D), dq_acc (T_q, H_q, D) fp32, k/v/dk/dv (T_k, H_kv, D),
lse/delta (H_q, T_q) fp32, lo/hi (T_q,) and qlo/qhi (T_k,) int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import INTERPRET
from .fwd import (
    _desc_rows,
    _dot,
    _keys_t,
    _load,
    _query_rows,
    _scores,
    _tanh,
    _tile_bounds,
    launch_grid,
    launcher,
    needs_long_indexing,
    score_constants,
)
from .schedule import launch_passes
from .tma import stream_descriptors

_INTERPRETED = tl.constexpr(INTERPRET)  # the interpreter has no descriptor reductions


@triton.jit
def _dq_step(
    dq, q, do, lse2, delta, k_base, v_base, start, span_hi, lo, hi, d, d_ok, stride_kt, stride_vt,
    scale_a, scale_b, K_DESC, V_DESC, kv_head_tma, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr, LONG_INDEXING: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols <= span_hi
    if LONG_INDEXING:
        cols = cols.to(tl.int64)
    # with descriptors, keys past span_hi are loaded too; p is 0 there (the mask), and so is dS
    kt = _keys_t(K_DESC, k_base, start, kv_head_tma, cols, col_ok, d, d_ok, stride_kt, BLOCK_N,
                 BLOCK_D, EVEN_D, MASKED, TMA)  # fmt: skip
    vt = _keys_t(V_DESC, v_base, start, kv_head_tma, cols, col_ok, d, d_ok, stride_vt, BLOCK_N,
                 BLOCK_D, EVEN_D, MASKED, TMA)  # fmt: skip
    qk = _dot(q, kt, IEEE)
    p = tl.exp2(_scores(qk, scale_a, scale_b, SOFTCAP) - lse2[:, None])
    ds = p * (_dot(do, vt, IEEE) - delta[:, None])
    if SOFTCAP:
        t = _tanh(qk * scale_a)
        ds = ds * (1.0 - t * t)
    if MASKED:
        # dS is 0 off the mask, after every factor: a NaN in another document's V (dP) or lse
        # must not survive as 0 * NaN; and its non-finite K rows are zeroed for dS K below
        # (docs/attention-numerics.md). Unmasked blocks hold one document only.
        vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
        ds = tl.where(vis, ds, 0.0)
        kt = tl.where(kt * 0.0 != 0.0, tl.zeros_like(kt), kt)
    return dq + _dot(ds.to(kt.dtype), tl.trans(kt), IEEE)


@triton.jit
def _dq_tile(
    work, Q, K, V, O, DO, LSE, DELTA, DQ, LO, HI, ORDER, K_DESC, V_DESC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    T_q, N_HEAD_BLOCKS, scale_a, scale_b, sm_scale,
    GROUP: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    LONG_INDEXING: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One work item: query tile ORDER[work // N_HEAD_BLOCKS] x head block work % N_HEAD_BLOCKS."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    tok, head, kv_head, kv_head_tma, row_ok = _query_rows(
        work, ORDER, T_q, N_HEAD_BLOCKS, GROUP, FOLD, BLOCK_M, LONG_INDEXING
    )
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    lo, hi, span_lo, span_hi, n_head, n_mid, n_all = _tile_bounds(LO, HI, tok, row_ok, BLOCK_N)

    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    do = tl.load(
        DO + tok[:, None] * stride_dot + head[:, None] * stride_doh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    o = tl.load(
        O + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + head * T_q + tok, delta, mask=row_ok)
    # rows that see no key (and padding rows) have lse = +inf, hence p = 0
    lse2 = tl.load(LSE + head * T_q + tok, mask=row_ok, other=float("inf")) * 1.4426950408889634

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    args = (q, do, lse2, delta, k_base, v_base)
    tma = (K_DESC, V_DESC, kv_head_tma)
    for i in range(0, n_head):
        dq = _dq_step(
            dq, *args, span_lo + i * BLOCK_N, span_hi, lo, hi, d, d_ok, stride_kt, stride_vt,
            scale_a, scale_b, *tma, BLOCK_N, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D, True,
            TMA,
        )  # fmt: skip
    for i in range(n_head, n_head + n_mid):
        dq = _dq_step(
            dq, *args, span_lo + i * BLOCK_N, span_hi, lo, hi, d, d_ok, stride_kt, stride_vt,
            scale_a, scale_b, *tma, BLOCK_N, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D, False,
            TMA,
        )  # fmt: skip
    for i in range(n_head + n_mid, n_all):
        dq = _dq_step(
            dq, *args, span_lo + i * BLOCK_N, span_hi, lo, hi, d, d_ok, stride_kt, stride_vt,
            scale_a, scale_b, *tma, BLOCK_N, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D, True,
            TMA,
        )  # fmt: skip
    tl.store(
        DQ + tok[:, None] * stride_dqt + head[:, None] * stride_dqh + d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=io_mask,
    )


@triton.jit(do_not_specialize=["T_q", "T_k"])
def _attn_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, LO, HI, ORDER, N_WORK, K_DESC, V_DESC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    T_q, T_k, N_HEAD_BLOCKS, scale_a, scale_b, sm_scale,
    GROUP: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    LONG_INDEXING: tl.constexpr, PERSISTENT: tl.constexpr, BOUNDED: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """One program per work item, or BOUNDED / PERSISTENT (see the forward kernel)."""
    # fp32 scalars (Inductor passes Python floats as fp64; see the forward kernel)
    scale_a = tl.cast(scale_a, tl.float32)
    scale_b = tl.cast(scale_b, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    args = (Q, K, V, O, DO, LSE, DELTA, DQ, LO, HI, ORDER, K_DESC, V_DESC, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_dot, stride_doh,
            stride_dqt, stride_dqh, T_q, N_HEAD_BLOCKS, scale_a, scale_b, sm_scale)  # fmt: skip
    pid = tl.program_id(0)
    if PERSISTENT:
        n_work = tl.load(N_WORK) * N_HEAD_BLOCKS
        for work in range(pid, n_work, tl.num_programs(0)):
            _dq_tile(
                work, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
                LONG_INDEXING, TMA,
            )  # fmt: skip
    elif BOUNDED:
        if pid < tl.load(N_WORK) * N_HEAD_BLOCKS:
            _dq_tile(
                pid, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
                LONG_INDEXING, TMA,
            )  # fmt: skip
    else:
        _dq_tile(
            pid, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
            LONG_INDEXING, TMA,
        )  # fmt: skip


@triton.jit
def _dkdv_step(
    dk, dv, k, v, Q, DO, LSE, DELTA, head, r, start, span_hi, qlo, qhi, d, d_ok, stride_qt,
    stride_qh, stride_dot, stride_doh, T_q, scale_a, scale_b, sm_scale, DQ_ACC, stride_aqt,
    stride_aqh, Q_DESC, DO_DESC, DQ_DESC, head0_tma, FOLD: tl.constexpr, TILE: tl.constexpr,
    BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr, LONG_INDEXING: tl.constexpr,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, MASK_ROWS: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    tok = start + r // FOLD
    if LONG_INDEXING:
        tok = tok.to(tl.int64)
    # padding rows load lse = +inf (p = 0), so they add nothing even on unmasked steps
    row_ok = (r < TILE * FOLD) & (tok <= span_hi)
    if TMA:  # rows past span_hi are loaded too (real rows or zeros past T): their lse is +inf
        q = _desc_rows(Q_DESC, start, head0_tma, TILE, FOLD, BLOCK_D)
        do = _desc_rows(DO_DESC, start, head0_tma, TILE, FOLD, BLOCK_D)
    else:
        q_ptrs = Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = _load(q_ptrs, row_ok[:, None], d_ok[None, :], MASK_ROWS, EVEN_D)
        do_ptrs = DO + tok[:, None] * stride_dot + head[:, None] * stride_doh + d[None, :]
        do = _load(do_ptrs, row_ok[:, None], d_ok[None, :], MASK_ROWS, EVEN_D)
    if MASK_ROWS:
        lse2 = tl.load(LSE + head * T_q + tok, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + head * T_q + tok, mask=row_ok, other=0.0)
    else:
        lse2 = tl.load(LSE + head * T_q + tok) * 1.4426950408889634
        delta = tl.load(DELTA + head * T_q + tok)
    qkt = _dot(k, tl.trans(q), IEEE)  # (BLOCK_N, BLOCK_M)
    pt = tl.exp2(_scores(qkt, scale_a, scale_b, SOFTCAP) - lse2[None, :])
    if MASKED:
        vis = (tok[None, :] >= qlo[:, None]) & (tok[None, :] <= qhi[:, None])
        pt = tl.where(vis, pt, 0.0)
    dv += _dot(pt.to(do.dtype), do, IEEE)
    dst = pt * (_dot(v, tl.trans(do), IEEE) - delta[None, :])
    if SOFTCAP:
        t = _tanh(qkt * scale_a)
        dst = dst * (1.0 - t * t)
    k_dq = k
    if MASKED:
        # Keep other documents' non-finite values out (docs/attention-numerics.md): dS is 0 off
        # the mask after every factor (a NaN delta of another document's row), and their
        # non-finite Q rows (and K rows, for the fused dQ) are zeroed for the products below.
        dst = tl.where(vis, dst, 0.0)
        q = tl.where(q * 0.0 != 0.0, tl.zeros_like(q), q)
        if ATOMIC_DQ:
            k_dq = tl.where(k * 0.0 != 0.0, tl.zeros_like(k), k)
    dk += _dot(dst.to(q.dtype), q, IEEE)
    if ATOMIC_DQ:  # this key tile's share of dQ = scale * dS K, added into the fp32 buffer
        dq = _dot(tl.trans(dst.to(k.dtype)), k_dq, IEEE) * sm_scale  # (BLOCK_M, BLOCK_D)
        if TMA and not _INTERPRETED:  # one bulk reduction of the block (FA3's dQ scheme); its
            # rows past span_hi add exact zeros (dS is 0 there), rows past T are clipped
            DQ_DESC.atomic_add([start, head0_tma, 0], dq.reshape([TILE, FOLD, BLOCK_D]))
        else:  # the interpreter has no descriptor reductions: per-element atomics there
            acc_ptrs = DQ_ACC + tok[:, None] * stride_aqt + head[:, None] * stride_aqh + d[None, :]
            tl.atomic_add(acc_ptrs, dq, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_tile(
    work, Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, QLO, QHI, ORDER, Q_DESC, DO_DESC, DQ_DESC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_aqt, stride_aqh,
    T_q, T_k, H_KV, scale_a, scale_b, sm_scale,
    GROUP: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    LONG_INDEXING: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One work item: key tile ORDER[work // H_KV] x KV head work % H_KV."""
    TILE: tl.constexpr = BLOCK_M // FOLD  # query tokens per inner step
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    PAD_ROWS: tl.constexpr = TILE * FOLD != BLOCK_M  # rows past TILE * FOLD are padding
    tile = tl.load(ORDER + work // H_KV)
    kv_head = work % H_KV
    kv_head_tma = kv_head  # descriptor coordinates are int32
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < T_k
    if LONG_INDEXING:
        cols = cols.to(tl.int64)
        kv_head = kv_head.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    kv_mask = col_ok[:, None] & d_ok[None, :]

    # the query rows that see the tile's keys (the plan's bounds transposed), in steps of TILE
    qlo, qhi, span_lo, span_hi, n_head, n_mid, n_all = _tile_bounds(QLO, QHI, cols, col_ok, TILE)

    k = tl.load(
        K + cols[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0
    )
    v = tl.load(
        V + cols[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    r = tl.arange(0, BLOCK_M)
    for sub in range(GROUP // FOLD):  # a runtime loop: no code copies per head subgroup
        head = kv_head * GROUP + sub * FOLD + r % FOLD
        args = (k, v, Q, DO, LSE, DELTA, head, r)
        tma = (Q_DESC, DO_DESC, DQ_DESC, kv_head_tma * GROUP + sub * FOLD)
        for i in range(0, n_head):
            dk, dv = _dkdv_step(
                dk, dv, *args, span_lo + i * TILE, span_hi, qlo, qhi, d, d_ok, stride_qt, stride_qh,
                stride_dot, stride_doh, T_q, scale_a, scale_b, sm_scale, DQ_ACC, stride_aqt,
                stride_aqh, *tma, FOLD, TILE, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D, True,
                True, ATOMIC_DQ, TMA,
            )  # fmt: skip
        for i in range(n_head, n_head + n_mid):
            dk, dv = _dkdv_step(
                dk, dv, *args, span_lo + i * TILE, span_hi, qlo, qhi, d, d_ok, stride_qt, stride_qh,
                stride_dot, stride_doh, T_q, scale_a, scale_b, sm_scale, DQ_ACC, stride_aqt,
                stride_aqh, *tma, FOLD, TILE, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D, False,
                PAD_ROWS, ATOMIC_DQ, TMA,
            )  # fmt: skip
        for i in range(n_head + n_mid, n_all):
            dk, dv = _dkdv_step(
                dk, dv, *args, span_lo + i * TILE, span_hi, qlo, qhi, d, d_ok, stride_qt, stride_qh,
                stride_dot, stride_doh, T_q, scale_a, scale_b, sm_scale, DQ_ACC, stride_aqt,
                stride_aqh, *tma, FOLD, TILE, BLOCK_D, SOFTCAP, IEEE, LONG_INDEXING, EVEN_D, True,
                True, ATOMIC_DQ, TMA,
            )  # fmt: skip
    tl.store(
        DK + cols[:, None] * stride_dkt + kv_head * stride_dkh + d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + cols[:, None] * stride_dvt + kv_head * stride_dvh + d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit(do_not_specialize=["T_q", "T_k"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, QLO, QHI, ORDER, N_WORK, Q_DESC, DO_DESC, DQ_DESC,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_aqt, stride_aqh,
    T_q, T_k, H_KV, scale_a, scale_b, sm_scale,
    GROUP: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    LONG_INDEXING: tl.constexpr, ATOMIC_DQ: tl.constexpr, PERSISTENT: tl.constexpr,
    BOUNDED: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One program per work item, or BOUNDED / PERSISTENT (see the forward kernel)."""
    # fp32 scalars (Inductor passes Python floats as fp64; see the forward kernel)
    scale_a = tl.cast(scale_a, tl.float32)
    scale_b = tl.cast(scale_b, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    args = (Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, QLO, QHI, ORDER, Q_DESC, DO_DESC, DQ_DESC,
            stride_qt, stride_qh,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt,
            stride_dkh, stride_dvt, stride_dvh, stride_aqt, stride_aqh, T_q, T_k, H_KV, scale_a,
            scale_b, sm_scale)  # fmt: skip
    pid = tl.program_id(0)
    if PERSISTENT:
        n_work = tl.load(N_WORK) * H_KV
        for work in range(pid, n_work, tl.num_programs(0)):
            _dkdv_tile(
                work, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
                LONG_INDEXING, ATOMIC_DQ, TMA,
            )  # fmt: skip
    elif BOUNDED:
        if pid < tl.load(N_WORK) * H_KV:
            _dkdv_tile(
                pid, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
                LONG_INDEXING, ATOMIC_DQ, TMA,
            )  # fmt: skip
    else:
        _dkdv_tile(
            pid, *args, GROUP, FOLD, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, SOFTCAP, IEEE,
            LONG_INDEXING, ATOMIC_DQ, TMA,
        )  # fmt: skip


@triton.jit(do_not_specialize=["T_q"])
def _attn_bwd_delta_kernel(
    O, DO, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, T_q, H_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    LONG_INDEXING: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) (H_q, T_q) fp32 for the fused backward (the split one computes it
    in the dQ kernel): one program per (BLOCK_T tokens, query head)."""
    pid = tl.program_id(0)
    head = pid % H_Q
    tok = (pid // H_Q) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T_q
    if LONG_INDEXING:
        tok = tok.to(tl.int64)
        head = head.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = tok_ok[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(O + tok[:, None] * stride_ot + head * stride_oh + d[None, :], mask=mask, other=0.0)
    do = tl.load(
        DO + tok[:, None] * stride_dot + head * stride_doh + d[None, :], mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + head * T_q + tok, delta, mask=tok_ok)


def _common(q, k, v, *more, softcap: float) -> dict:
    dim = q.shape[2]
    return dict(
        GROUP=q.shape[1] // k.shape[1], HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        SOFTCAP=softcap > 0, IEEE=q.dtype == torch.float32,
        LONG_INDEXING=needs_long_indexing(q, k, v, *more) or q.shape[1] * q.shape[0] >= 2**31,
    )  # fmt: skip


def backward_dq(
    do, q, k, v, o, lse, delta, dq, lo_q, hi_q, order, *, softmax_scale: float, softcap: float,
    fold: int, block_m: int, block_n: int, num_warps: int, num_stages: int, traceable: bool = False,
    bound: tuple[torch.Tensor, int] | None = None, tma: bool = False,
) -> None:  # fmt: skip
    """Launch the dQ kernel; writes dq and delta (H_q, T_q) in place (the rows of this launch's
    tiles). ``bound``, ``tma`` (K/V through descriptors): see fwd.attention_forward."""
    scale_a, scale_b = score_constants(softmax_scale, softcap)
    n_head_blocks = q.shape[1] // fold
    n_work, grid = launch_grid(order, n_head_blocks, bound)
    common = _common(q, k, v, o, do, dq, softcap=softcap)
    descs = stream_descriptors(tma, q.device, (k, v), block_n, 1, common["BLOCK_D"])
    launcher(_attn_bwd_dq_kernel, traceable)[grid](
        q, k, v, o, do, lse, delta, dq, lo_q, hi_q, order, n_work, *(descs or (k, v)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        q.shape[0], k.shape[0], n_head_blocks, scale_a, scale_b, softmax_scale,
        FOLD=fold, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
        PERSISTENT=bound is not None and bound[1] > 0, BOUNDED=bound is not None,
        TMA=descs is not None, **common,
    )  # fmt: skip


def backward_delta(o, do, delta, *, traceable: bool = False) -> None:
    """Launch the delta kernel; writes delta (H_q, T_q) fp32 in place."""
    t_q, h_q, dim = o.shape
    block_t = 32 if o.device.type == "cuda" else 16
    launcher(_attn_bwd_delta_kernel, traceable)[(triton.cdiv(t_q, block_t) * h_q,)](
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), t_q, h_q,
        HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_T=block_t,
        LONG_INDEXING=needs_long_indexing(o, do) or h_q * t_q >= 2**31, num_warps=4,
    )  # fmt: skip


def backward_dkdv(
    do, q, k, v, lse, delta, dk, dv, qlo_k, qhi_k, order, *, softmax_scale: float, softcap: float,
    fold: int, block_m: int, block_n: int, num_warps: int, num_stages: int, traceable: bool = False,
    dq_acc: torch.Tensor | None = None, bound: tuple[torch.Tensor, int] | None = None,
    tma: bool = False,
) -> None:  # fmt: skip
    """Launch the dK/dV kernel (needs delta from backward_dq or backward_delta); writes dk, dv in
    place. With ``dq_acc`` ((T_q, H_q, D) fp32, zeroed) it also adds every tile's scale * dS K
    into it with atomics (the fused backward: no dQ kernel, not bitwise repeatable). ``tma``:
    Q/dO through descriptors of (block_m / fold tokens, fold heads) blocks where the layout allows
    (tma.py; never with padding rows, whose fold is not a power of two), and the fused
    dQ added as one bulk reduction per block instead of per-element atomics (on the GPU: the
    interpreter has no descriptor reductions)."""
    scale_a, scale_b = score_constants(softmax_scale, softcap)
    h_kv = k.shape[1]
    acc = dk if dq_acc is None else dq_acc  # a placeholder pointer when there is no fused dQ
    n_work, grid = launch_grid(order, h_kv, bound)
    common = _common(q, k, v, do, dk, dv, *(() if dq_acc is None else (dq_acc,)), softcap=softcap)
    tile = block_m // fold
    tma = tma and tile * fold == block_m
    # the fused dQ buffer takes one too: its blocks are reduced into it in bulk
    streamed = (q, do) if dq_acc is None else (q, do, dq_acc)
    descs = stream_descriptors(tma, q.device, streamed, tile, fold, common["BLOCK_D"])
    use_tma = descs is not None
    if use_tma and dq_acc is not None:
        # The fused dQ multiplies by a second copy of the key tile (its non-finite rows zeroed:
        # another document's inf must not reach dQ as 0 * inf), which beside the descriptors'
        # staging buffers overflows Hopper's 227 KiB of shared memory at the shipped depth. Give
        # up the stages that copy takes: each stage holds a Q and a dO block of block_m rows.
        num_stages = max(1, num_stages - -(-block_n // (2 * block_m)))
    if not use_tma:
        descs = (q, do, acc)  # placeholders, never read
    elif dq_acc is None:
        descs = (*descs, acc)  # no fused dQ: a placeholder for its descriptor
    launcher(_attn_bwd_dkdv_kernel, traceable)[grid](
        q, k, v, do, lse, delta, dk, dv, acc, qlo_k, qhi_k, order, n_work, *descs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        acc.stride(0), acc.stride(1), q.shape[0], k.shape[0], h_kv, scale_a, scale_b,
        softmax_scale, FOLD=fold, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages, ATOMIC_DQ=dq_acc is not None,
        PERSISTENT=bound is not None and bound[1] > 0, BOUNDED=bound is not None,
        TMA=use_tma, **common,
    )  # fmt: skip


def attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    plan,
    *,
    softmax_scale: float,
    softcap: float,
    cfg,
    deterministic: bool = False,
    traceable: bool = False,
    long=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ (+delta) then dK/dV over the plan's heaviest-first orders; returns dq, dk, dv.

    Split (default): a dQ kernel and a dK/dV kernel, atomic-free (each output row is written by
    one program), so bitwise repeatable. Fused (``cfg.bwd_fused`` and not ``deterministic``): the
    FA2 scheme, delta first, then the dK/dV kernel also adds dS K into an fp32 dQ buffer with
    atomics: 5 matmuls per visible block instead of 7 (the split dQ kernel recomputes S and dP),
    at the price of an fp32 (T_q, H_q, D) buffer and a summation order that varies from run to run.
    ``deterministic`` is the caller's request for a bitwise-repeatable backward: it always gets
    the split one. ``long`` (schedule.LongPath): each kernel runs twice, short-config
    tiles then the long-document tiles (each row still written by one program).
    """
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    fused = cfg.bwd_fused and not deterministic
    if q.shape[0] == 0 or k.shape[0] == 0:
        dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    kw = dict(softmax_scale=softmax_scale, softcap=softcap, traceable=traceable)
    group = q.shape[1] // k.shape[1]
    if fused:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        backward_delta(o, do, delta, traceable=traceable)
    else:
        dq_acc = None
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        for order, c, fold, bound in launch_passes(plan, "dq", cfg, long, group, q.device):
            backward_dq(
                do, q, k, v, o, lse, delta, dq, plan.lo_q, plan.hi_q, order, fold=fold,
                block_m=c.dq_block_m, block_n=c.dq_block_n, num_warps=c.dq_warps,
                num_stages=c.dq_stages, bound=bound, tma=c.tma, **kw,
            )  # fmt: skip
    kv_passes = launch_passes(plan, "kv", cfg, long, group, q.device)
    for order, c, fold, bound in kv_passes:  # after every dQ launch: they write delta
        backward_dkdv(
            do, q, k, v, lse, delta, dk, dv, plan.qlo_k, plan.qhi_k, order, fold=fold,
            block_m=c.kv_block_m, block_n=c.kv_block_n, num_warps=c.kv_warps,
            num_stages=c.kv_stages_at(fold), dq_acc=dq_acc, bound=bound, tma=c.tma, **kw,
        )  # fmt: skip
    return (dq_acc.to(q.dtype) if fused else dq), dk, dv
