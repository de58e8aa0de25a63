"""Whole-document groups of the Triton varlen attention's backward: short documents in one program.

The split backward (attention_bwd.py) reads every query row twice (dQ kernel, dK/dV kernel) and
computes QK^T and dO V^T twice; on packs of short documents both kernels are bound by memory
latency, not math (docs/BENCHMARKS.md runs F and N). A document of at most ``E`` tokens fits one
key block, so one program can hold all of its keys and do the whole backward of it at once:

    for each query head h of the KV group, for each step of BLOCK_Q query rows:
        P = exp(S - lse) on the step's visible keys (S = scale * Q K^T),  dP = dO V^T
        dS = P * (dP - delta),  dV += P^T dO,  dK += dS^T Q,  dQ = scale * dS K  (complete: stored)

five matmuls per block, each input row read once, no atomics (bitwise repeatable).

Groups (built on the device from the offsets, no host read): a document is *eligible* when its
query and key lengths are <= E. Consecutive eligible documents of at most S = E - W tokens whose
query and key starts fall in the same W-token window (W = E / 4) share a group; any other eligible
document is a group of its own. So a group spans at most E rows on either side (W - 1 + S = E - 1
for a shared one),
each document belongs to at most one group, and no row outside a group sees a key inside it.
Rows of eligible documents are *owned*: the split kernels skip every tile made only of owned rows
and give owned rows empty bounds elsewhere (they write zeros there, which this kernel, launched
after them, overwrites).

Shapes: cu_q/cu_k (n_docs + 1,) int32 (clamped here as in attention_schedule.row_bounds);
groups (4, n_docs + 1) int32: rows q_start, q_end, k_start, k_end of group g in column g (columns
past the group count are empty ranges); n_groups (1,) int32; owned_q (T_q,), owned_k (T_k,) bool.
q/o/do/dq (T_q, H_q, D), k/v/dk/dv (T_k, H_kv, D), lse (H_q, T_q) fp32, lo/hi (T_q,) int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_fwd import _dot, _scores, _tanh, launcher, needs_long_indexing, score_constants
from .common import clamp_offsets


def document_groups(
    cu_q: torch.Tensor, cu_k: torch.Tensor, t_q: int, t_k: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(groups (4, n_docs + 1), n_groups (1,), owned_q (T_q,), owned_k (T_k,)) for documents of
    at most ``capacity`` (E) tokens; torch ops on the offsets' device, no sync, shapes from
    n_docs and T only. Needs n_docs >= 1 (a shape: callers check cu_q.numel() >= 2)."""
    window = capacity // 4
    small = capacity - window
    cq, ck = clamp_offsets(cu_q, t_q), clamp_offsets(cu_k, t_k)
    n = cq.numel() - 1
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    eligible = (lq <= capacity) & (lk <= capacity)
    pairable = (lq <= small) & (lk <= small)
    joins = (  # document d (d >= 1) joins the group of document d - 1
        pairable[1:]
        & pairable[:-1]
        & (cq[1:-1] // window == cq[:-2] // window)
        & (ck[1:-1] // window == ck[:-2] // window)
    )
    leader = eligible.clone()
    leader[1:] &= ~joins
    gid = torch.cumsum(leader.to(torch.int64), 0) - 1
    docs = torch.arange(n, device=cq.device)
    # scatter into n + 1 slots: slot n takes the documents of no group (never read)
    slot_first = torch.where(leader, gid, n)
    slot_last = torch.where(eligible, gid, n)
    first = torch.full((n + 1,), n, dtype=torch.int64, device=cq.device)
    first = first.scatter(0, slot_first, docs)
    last = torch.full((n + 1,), -1, dtype=torch.int64, device=cq.device)
    last = last.scatter_reduce(0, slot_last, docs, "amax")
    n_groups = leader.sum(dtype=torch.int32).reshape(1)
    used = torch.arange(n + 1, device=cq.device) < n_groups.to(torch.int64)
    first_c, end_c = first.clamp(0, n), (last + 1).clamp(0, n)
    zero = torch.zeros((), dtype=torch.int64, device=cq.device)
    groups = torch.stack(
        [
            torch.where(used, cq[first_c], zero),
            torch.where(used, cq[end_c], zero),
            torch.where(used, ck[first_c], zero),
            torch.where(used, ck[end_c], zero),
        ]
    ).to(torch.int32)

    def owned(c, total):
        rows = torch.arange(total, device=c.device, dtype=c.dtype)
        doc = torch.searchsorted(c, rows, right=True) - 1
        inside = (doc >= 0) & (doc < n)
        return inside & eligible[doc.clamp(0, c.numel() - 2)]  # n >= 1: the caller's shape check

    return groups, n_groups, owned(cq, t_q), owned(ck, t_k)


@triton.jit(do_not_specialize=["T_q", "T_k"])
def _attn_bwd_group_kernel(
    Q, K, V, O, DO, LSE, DQ, DK, DV, LO, HI, GROUPS, N_GROUPS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_g, T_q, T_k, H_KV, scale_a, scale_b, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    LONG_INDEXING: tl.constexpr,
):  # fmt: skip
    """One program per (group slot, KV head); slots past N_GROUPS[0] exit at once."""
    EMPTY: tl.constexpr = 2147483647
    # fp32 scalars (Inductor passes Python floats as fp64; see the forward kernel)
    scale_a = tl.cast(scale_a, tl.float32)
    scale_b = tl.cast(scale_b, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid = tl.program_id(0)
    g = pid // H_KV
    kv_head = pid % H_KV
    if g < tl.load(N_GROUPS):
        q_start = tl.load(GROUPS + g)
        q_end = tl.load(GROUPS + stride_g + g)
        k_start = tl.load(GROUPS + 2 * stride_g + g)
        k_end = tl.load(GROUPS + 3 * stride_g + g)
        cols = k_start + tl.arange(0, BLOCK_K)
        col_ok = cols < k_end
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        if LONG_INDEXING:
            cols = cols.to(tl.int64)
            kv_head = kv_head.to(tl.int64)
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + cols[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            V + cols[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        dk = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        for h in range(GROUP):
            head = kv_head * GROUP + h
            for start in range(q_start, q_end, BLOCK_Q):
                rows = start + tl.arange(0, BLOCK_Q)
                row_ok = rows < q_end
                if LONG_INDEXING:
                    rows = rows.to(tl.int64)
                io_mask = row_ok[:, None] & d_ok[None, :]
                offs_q = rows[:, None] * stride_qt + head * stride_qh + d[None, :]
                q = tl.load(Q + offs_q, mask=io_mask, other=0.0)
                do = tl.load(
                    DO + rows[:, None] * stride_dot + head * stride_doh + d[None, :],
                    mask=io_mask,
                    other=0.0,
                )
                o = tl.load(
                    O + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                    mask=io_mask,
                    other=0.0,
                )
                delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
                # padding rows: lse = +inf (p = 0) and the empty interval
                lse2 = tl.load(LSE + head * T_q + rows, mask=row_ok, other=float("inf"))
                lse2 = lse2 * 1.4426950408889634
                lo = tl.load(LO + rows, mask=row_ok, other=EMPTY)
                hi = tl.load(HI + rows, mask=row_ok, other=-1)
                qk = _dot(q, tl.trans(k), IEEE)  # (BLOCK_Q, BLOCK_K)
                p = tl.exp2(_scores(qk, scale_a, scale_b, SOFTCAP) - lse2[:, None])
                vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
                p = tl.where(vis, p, 0.0)
                ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
                if SOFTCAP:
                    t = _tanh(qk * scale_a)
                    ds = ds * (1.0 - t * t)
                dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
                dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
                dq = _dot(ds.to(k.dtype), k, IEEE) * sm_scale
                tl.store(
                    DQ + rows[:, None] * stride_dqt + head * stride_dqh + d[None, :],
                    dq.to(DQ.dtype.element_ty),
                    mask=io_mask,
                )
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


def backward_groups(
    do, q, k, v, o, lse, dq, dk, dv, lo_q, hi_q, groups, n_groups, *, softmax_scale: float,
    softcap: float, block_q: int, block_k: int, num_warps: int, num_stages: int,
    traceable: bool = False,
) -> None:  # fmt: skip
    """Launch the group kernel over every group slot (n_docs + 1) x KV head; writes dq, dk, dv
    of the owned rows in place (after the split kernels: it overwrites their zeros there)."""
    scale_a, scale_b = score_constants(softmax_scale, softcap)
    h_q, dim = q.shape[1], q.shape[2]
    h_kv = k.shape[1]
    launcher(_attn_bwd_group_kernel, traceable)[(groups.shape[1] * h_kv,)](
        q, k, v, o, do, lse, dq, dk, dv, lo_q, hi_q, groups, n_groups,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), groups.stride(0),
        q.shape[0], k.shape[0], h_kv, scale_a, scale_b, softmax_scale,
        GROUP=h_q // h_kv, HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_Q=block_q, BLOCK_K=block_k, SOFTCAP=softcap > 0, IEEE=q.dtype == torch.float32,
        LONG_INDEXING=needs_long_indexing(q, k, v, o, do, dq, dk, dv) or h_q * q.shape[0] >= 2**31,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
