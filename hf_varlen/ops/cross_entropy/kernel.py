"""The Triton row kernel of the fused linear cross-entropy (``function.py`` imports this module
only where triton is installed; the pure-torch row step there needs no triton).

``ce_rows_triton(logits, labels, loss, cfg, ...)``: on a (C, V) logits chunk, the per-row loss into
``loss`` and dloss/dlogits written over the logits (math in ``function.py``'s docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import INT32_LIMIT, round_to

# ----------------------------------------------------------------------------------------------
# Row kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(u):
    """fp32 tanh from exp (no tanh in the interpreter); a series near 0, where 1 - e^-2a cancels."""
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.125, small, big)
    return tl.where(u < 0.0, -t, t)


@triton.jit
def _ce_rows_kernel(
    logits_ptr,  # (C, V) in, dloss/dlogits out (in place)
    stride_row,
    labels_ptr,  # (C,) int32/int64
    loss_ptr,  # (C,) fp32 out
    row_scale_ptr,  # (C,) fp32 gradient scale per row (only read when HAS_ROW_SCALE)
    V,
    ignore_index,
    softcap,
    logit_scale,
    label_smoothing,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LONG_INDEXING: tl.constexpr,
):
    row = tl.program_id(0)
    if LONG_INDEXING:
        row = row.to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    dtype = logits_ptr.dtype.element_ty
    cols0 = tl.arange(0, BLOCK_V)
    y = tl.load(labels_ptr + row)

    if y == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=tl.float32).to(dtype)
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                tl.store(row_ptr + cols, zeros, mask=cols < V)
    else:
        # Pass 1: online max / sum-exp over V (and sum of z for label smoothing).
        m = tl.zeros([], dtype=tl.float32) - float("inf")
        s = tl.zeros([], dtype=tl.float32)
        sum_z = tl.zeros([], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            mask = cols < V
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            if HAS_SMOOTHING:
                sum_z += tl.sum(tl.where(mask, z, 0.0), axis=0)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)

        # An out-of-range label (not ignore_index) makes the row's loss NaN instead of reading
        # out of bounds: a loud result without a host-side check of the label values.
        in_range = (y >= 0) & (y < V)
        z_y = tl.load(row_ptr + tl.where(in_range, y, 0)).to(tl.float32) * logit_scale
        if HAS_SOFTCAP:
            z_y = softcap * _tanh(z_y / softcap)
        loss = lse - (1.0 - label_smoothing) * z_y
        if HAS_SMOOTHING:
            loss -= label_smoothing * sum_z / V
        if HAS_Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(loss_ptr + row, tl.where(in_range, loss, float("nan")))

        # Pass 2: dloss/dlogits over the same row, written over the logits.
        if COMPUTE_GRAD:
            scale = logit_scale
            if HAS_ROW_SCALE:
                scale = scale * tl.load(row_scale_ptr + row)
            p_coef = 1.0
            if HAS_Z_LOSS:
                p_coef = 1.0 + 2.0 * z_loss * lse
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
                if HAS_SOFTCAP:
                    t = _tanh(z / softcap)
                    z = softcap * t
                g = tl.exp(z - lse) * p_coef
                if HAS_SMOOTHING:
                    g -= label_smoothing / V
                g = tl.where(cols == y, g - (1.0 - label_smoothing), g)
                if HAS_SOFTCAP:
                    g = g * (1.0 - t * t)
                tl.store(row_ptr + cols, round_to(g * scale, dtype), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launcher (tensor in/out, no autograd)
# ----------------------------------------------------------------------------------------------


def ce_rows_triton(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    cfg,
    *,
    compute_grad: bool,
    row_scale: torch.Tensor | None = None,
    block_v: int | None = None,
) -> None:
    """Row step on a (C, V) logits chunk: per-row loss into ``loss``, dloss/dlogits in place."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected a unit last-dim stride, got strides {logits.stride()}")
    block = block_v or min(4096, triton.next_power_of_2(vocab))
    long_indexing = (n_rows - 1) * logits.stride(0) + vocab > INT32_LIMIT
    _ce_rows_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        labels,
        loss,
        row_scale if row_scale is not None else loss,
        vocab,
        cfg.ignore_index,
        float(cfg.softcap or 1.0),
        float(cfg.logit_scale),
        float(cfg.label_smoothing),
        float(cfg.z_loss),
        HAS_SOFTCAP=cfg.softcap is not None,
        HAS_SMOOTHING=cfg.label_smoothing > 0.0,
        HAS_Z_LOSS=cfg.z_loss > 0.0,
        HAS_ROW_SCALE=row_scale is not None,
        COMPUTE_GRAD=compute_grad,
        BLOCK_V=block,
        LONG_INDEXING=bool(long_indexing),
        num_warps=8 if block >= 2048 else 4,
    )
