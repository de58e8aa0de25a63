"""The Triton kernel of the fused QK RoPE (``function.py`` holds the math, the layouts, the launch and
the autograd; this module only the device code).

``rope_qk_kernel``: one launch rotates q and k (the first R of D features; the rest pass through)
for a block of tokens x heads per program, with cos/sin gathered, looked up by position_ids, or by
the position inside each document of ``cu_seqlens`` (a binary search per token, no host sync);
``LONG_INDEXING`` (int64 offsets) for launches whose offsets reach 2^31.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton_common import round_to

# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
# fmt: off


@triton.jit
def _feature_mask(mask, d, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """mask & (d < LIMIT), skipping the comparison when the block is exactly full: a mask that is
    constant along the features keeps the loads and stores vectorized."""
    if LIMIT < BLOCK:
        mask = mask & (d < LIMIT)
    return mask


@triton.jit
def _load_pair(ptr, row, col, stride_d, mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
               ROWS_T: tl.constexpr, ROWS_H: tl.constexpr, INTERLEAVED: tl.constexpr,
               EVICT: tl.constexpr):
    """The rotated pair (x1, x2) of rows ``row`` as fp32 tiles [ROWS_T, ROWS_H, BLOCK_HALF]."""
    if INTERLEAVED:
        # One contiguous load of 2 * BLOCK_HALF features, de-interleaved in registers.
        d = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        dmask = _feature_mask(mask, d, 2 * HALF, 2 * BLOCK_HALF)
        full = tl.load(ptr + row + d * stride_d, mask=dmask, other=0.0,
                       eviction_policy=EVICT)
        x1, x2 = tl.split(tl.reshape(full, [ROWS_T, ROWS_H, BLOCK_HALF, 2]))
    else:
        dmask = _feature_mask(mask, col, HALF, BLOCK_HALF)
        x1 = tl.load(ptr + row + col * stride_d, mask=dmask, other=0.0, eviction_policy=EVICT)
        x2 = tl.load(ptr + row + (col + HALF) * stride_d, mask=dmask, other=0.0,
                     eviction_policy=EVICT)
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _rotate_heads(X, Y, stride_xb, stride_xh, stride_xt, stride_xd,
                  stride_yb, stride_yh, stride_yt, stride_yd,
                  b, t, t_mask, h0, H, c1, c2, sa, sb,
                  HALF: tl.constexpr, PASS: tl.constexpr, COPY_PASS: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, LONG_INDEXING: tl.constexpr):
    """Y = rot(X) for heads [h0, h0 + BLOCK_H) of the token block ``t`` of batch row ``b``."""
    h = h0 + tl.arange(0, BLOCK_H)
    if LONG_INDEXING:
        h = h.to(tl.int64)
    mask = t_mask[:, None, None] & (h < H)[None, :, None]
    row_x = b * stride_xb + t[:, None, None] * stride_xt + h[None, :, None] * stride_xh
    row_y = b * stride_yb + t[:, None, None] * stride_yt + h[None, :, None] * stride_yh
    col = tl.arange(0, BLOCK_HALF)[None, None, :]
    x1, x2 = _load_pair(X, row_x, col, stride_xd, mask, HALF, BLOCK_HALF, BLOCK_T, BLOCK_H,
                        INTERLEAVED, "evict_first")
    y1 = x1 * c1 - x2 * sa
    y2 = x2 * c2 + x1 * sb
    dtype = Y.dtype.element_ty
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        y = tl.reshape(tl.join(y1, y2), [BLOCK_T, BLOCK_H, 2 * BLOCK_HALF])
        tl.store(Y + row_y + d * stride_yd, round_to(y, dtype),
                 mask=_feature_mask(mask, d, 2 * HALF, 2 * BLOCK_HALF))
    else:
        dmask = _feature_mask(mask, col, HALF, BLOCK_HALF)
        tl.store(Y + row_y + col * stride_yd, round_to(y1, dtype), mask=dmask)
        tl.store(Y + row_y + (col + HALF) * stride_yd, round_to(y2, dtype),
                 mask=dmask)
    if COPY_PASS:  # out of place with rotary_dim < D: copy the features that do not rotate
        dp = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, None, :]
        pmask = _feature_mask(mask, dp, 2 * HALF + PASS, 2 * HALF + BLOCK_PASS)
        xp = tl.load(X + row_x + dp * stride_xd, mask=pmask, other=0.0,
                     eviction_policy="evict_first")
        tl.store(Y + row_y + dp * stride_yd, round_to(xp.to(tl.float32), dtype),
                 mask=pmask)


@triton.jit(do_not_specialize=["T", "N_DOCS", "N_STEPS"])
def rope_qk_kernel(
    Q, QO, K, KO, COS, SIN, POS, CU,
    T, HQ, HKV, N_DOCS, N_STEPS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_qob, stride_qoh, stride_qot, stride_qod,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_kob, stride_koh, stride_kot, stride_kod,
    stride_cb, stride_ct, stride_cd,
    stride_sb, stride_st, stride_sd,
    stride_pb, stride_pt,
    HALF: tl.constexpr, PASS: tl.constexpr, COPY_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    POS_MODE: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    LONG_INDEXING: tl.constexpr,
):
    # 1-D grid over (head group, token block, batch row), head group fastest: neighbouring programs
    # touch neighbouring memory of the same tokens and share their cos/sin rows in L2.
    pid = tl.program_id(0)
    n_qg = tl.cdiv(HQ, BLOCK_H)
    n_g = n_qg + tl.cdiv(HKV, BLOCK_H)
    n_tb = tl.cdiv(T, BLOCK_T)
    g = pid % n_g
    rest = pid // n_g
    tb = rest % n_tb
    b = rest // n_tb
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    if LONG_INDEXING:
        b = b.to(tl.int64)
        t = t.to(tl.int64)
    t_mask = t < T

    # Row of cos/sin for each token of the block.
    if POS_MODE == 0:  # already gathered per (batch row, token)
        c_row = b * stride_cb + t * stride_ct
        s_row = b * stride_sb + t * stride_st
    else:
        if POS_MODE == 1:  # table row position_ids[b, t]
            pos = tl.load(POS + b * stride_pb + t * stride_pt, mask=t_mask, other=0)
        else:  # t - cu_seqlens[doc], doc = last i < N with cu_seqlens[i] <= t: binary search
            gt = b * T + t
            lo = tl.zeros([BLOCK_T], dtype=tl.int32)
            hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (N_DOCS - 1)
            for _ in range(N_STEPS):
                mid = (lo + hi + 1) // 2
                go = tl.load(CU + mid) <= gt
                lo = tl.where(go, mid, lo)
                hi = tl.where(go, hi, mid - 1)
            pos = gt - tl.load(CU + lo)
        pos = pos.to(tl.int64) if LONG_INDEXING else pos.to(tl.int32)
        c_row = pos * stride_ct
        s_row = pos * stride_st

    # cos/sin pairs in fp32, [BLOCK_T, 1, BLOCK_HALF]: loaded once, reused by every head.
    cs_mask = t_mask[:, None, None]
    col = tl.arange(0, BLOCK_HALF)[None, None, :]
    c1, c2 = _load_pair(COS, c_row[:, None, None], col, stride_cd, cs_mask, HALF, BLOCK_HALF,
                        BLOCK_T, 1, INTERLEAVED, "evict_last")
    s1, s2 = _load_pair(SIN, s_row[:, None, None], col, stride_sd, cs_mask, HALF, BLOCK_HALF,
                        BLOCK_T, 1, INTERLEAVED, "evict_last")
    if CONJUGATE:  # the transposed rotation, for the backward pass
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2

    if g < n_qg:
        _rotate_heads(Q, QO, stride_qb, stride_qh, stride_qt, stride_qd,
                      stride_qob, stride_qoh, stride_qot, stride_qod,
                      b, t, t_mask, g * BLOCK_H, HQ, c1, c2, sa, sb,
                      HALF, PASS, COPY_PASS, BLOCK_HALF, BLOCK_PASS, BLOCK_T, BLOCK_H,
                      INTERLEAVED, LONG_INDEXING)
    else:
        _rotate_heads(K, KO, stride_kb, stride_kh, stride_kt, stride_kd,
                      stride_kob, stride_koh, stride_kot, stride_kod,
                      b, t, t_mask, (g - n_qg) * BLOCK_H, HKV, c1, c2, sa, sb,
                      HALF, PASS, COPY_PASS, BLOCK_HALF, BLOCK_PASS, BLOCK_T, BLOCK_H,
                      INTERLEAVED, LONG_INDEXING)


# fmt: on
