"""The fused linear cross-entropy as ``torch.ops.hf_varlen.fused_linear_ce`` (what torch.compile
sees): an opaque ``custom_op`` with a fake implementation and autograd through
``register_autograd``. ``cross_entropy.fused_linear_cross_entropy`` calls it only while
torch.compile traces (``fused_linear_ce_traced``); eager calls keep the autograd.Function, which
runs the same chunk loop (``chunks.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..library import qualname
from .chunks import (
    LossConfig,
    at_least_one,
    kept_rows,
    linear_ce_chunks,
    scatter_rows,
)

# ----------------------------------------------------------------------------------------------
# Registered op (what torch.compile sees): opaque custom_op, gradients as outputs
# ----------------------------------------------------------------------------------------------
# The chunk loop is cuBLAS matmuls around a row kernel (plus, with drop_ignored, one host sync for
# the kept-row count), so it stays one opaque op: Inductor has nothing to fuse across it, and a
# sync happens inside the op (no graph break, nothing read into Python while tracing). The forward
# returns the loss, the gradients of the unscaled loss and the kept-token count as a tensor; the
# backward scales them by grad_output (divided by that count for "mean"), as the autograd.Function
# does. Unneeded gradients are empty (0,) tensors. "none" computes no gradient in the forward; its
# backward is the second op, which recomputes the logits with the per-token grad_output as row
# scale.


def cfg_of(
    ignore_index: int,
    reduction: str,
    softcap: float | None,
    logit_scale: float,
    label_smoothing: float,
    z_loss: float,
    chunk_size: int | None,
    backend: str,
    drop_ignored: bool,
) -> LossConfig:
    return LossConfig(
        ignore_index,
        reduction,
        softcap,
        logit_scale,
        label_smoothing,
        z_loss,
        chunk_size,
        backend,
        drop_ignored,
    )


def _grad_outputs(hidden, weight, idx, dh, dw, db) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dw, db) as op outputs: dh over every row of ``hidden`` (zeros on dropped rows),
    a gradient that was not computed as an empty (0,) tensor."""
    empty = hidden.new_empty
    return (
        empty(0) if dh is None else scatter_rows(dh, idx, hidden.shape[0]),
        empty(0, dtype=weight.dtype) if dw is None else dw,
        empty(0, dtype=weight.dtype) if db is None else db,
    )


@torch.library.custom_op(qualname("fused_linear_ce"), mutates_args=())
def _fused_linear_ce_op(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, ignore_index: int,
    reduction: str, softcap: float | None, logit_scale: float, label_smoothing: float,
    z_loss: float, chunk_size: int | None, backend: str, drop_ignored: bool, need_dh: bool,
    need_dw: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    cfg = cfg_of(
        ignore_index, reduction, softcap, logit_scale, label_smoothing, z_loss, chunk_size,
        backend, drop_ignored,
    )  # fmt: skip
    n_rows = hidden.shape[0]
    n_valid, idx, h, y = kept_rows(hidden, labels, ignore_index, drop_ignored)
    defer = reduction == "none"
    loss, dh, dw, db = linear_ce_chunks(
        h, weight, bias, y, cfg, need_dh=need_dh and not defer, need_dw=need_dw and not defer,
        need_db=need_db and not defer,
    )  # fmt: skip
    if reduction == "none":
        loss = scatter_rows(loss, idx, n_rows)
    else:
        loss = loss.sum()
        loss = loss if reduction == "sum" else loss / at_least_one(n_valid)
    n_valid = torch.as_tensor(n_valid, dtype=torch.int64, device=hidden.device)
    return loss, *_grad_outputs(hidden, weight, idx, dh, dw, db), n_valid


@_fused_linear_ce_op.register_fake
def _fused_linear_ce_fake(
    hidden, weight, bias, labels, ignore_index, reduction, softcap, logit_scale,
    label_smoothing, z_loss, chunk_size, backend, drop_ignored, need_dh, need_dw, need_db,
):  # fmt: skip
    defer = reduction == "none"
    fp32 = torch.float32
    loss = hidden.new_empty(labels.shape if defer else (), dtype=fp32)
    dh = hidden.new_empty(hidden.shape if need_dh and not defer else (0,))
    dw = weight.new_empty(weight.shape if need_dw and not defer else (0,))
    db = weight.new_empty((weight.shape[0],) if need_db and not defer else (0,))
    return loss, dh, dw, db, hidden.new_empty((), dtype=torch.int64)


@torch.library.custom_op(qualname("fused_linear_ce_rows_bwd"), mutates_args=())
def _fused_linear_ce_rows_bwd_op(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, grad_rows: Tensor,
    ignore_index: int, softcap: float | None, logit_scale: float, label_smoothing: float,
    z_loss: float, chunk_size: int | None, backend: str, drop_ignored: bool, need_dh: bool,
    need_dw: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients of sum(loss_t * grad_rows_t) (reduction "none"); unneeded ones are (0,)."""
    cfg = cfg_of(
        ignore_index, "none", softcap, logit_scale, label_smoothing, z_loss, chunk_size, backend,
        drop_ignored,
    )  # fmt: skip
    _, idx, h, y = kept_rows(hidden, labels, ignore_index, drop_ignored)
    scale = grad_rows.float() if idx is None else grad_rows.float().index_select(0, idx)
    _, dh, dw, db = linear_ce_chunks(
        h, weight, bias, y, cfg, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
        row_scale=scale.contiguous(),
    )  # fmt: skip
    return _grad_outputs(hidden, weight, idx, dh, dw, db)


@_fused_linear_ce_rows_bwd_op.register_fake
def _fused_linear_ce_rows_bwd_fake(
    hidden, weight, bias, labels, grad_rows, ignore_index, softcap, logit_scale,
    label_smoothing, z_loss, chunk_size, backend, drop_ignored, need_dh, need_dw, need_db,
):  # fmt: skip
    return (
        hidden.new_empty(hidden.shape if need_dh else (0,)),
        weight.new_empty(weight.shape if need_dw else (0,)),
        weight.new_empty((weight.shape[0],) if need_db else (0,)),
    )


def _ce_setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, labels, ignore_index, reduction, *rest = inputs
    ctx.reduction, ctx.cfg_args, ctx.computed = reduction, (ignore_index, *rest[:-3]), rest[-3:]
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, labels)
    else:
        ctx.save_for_backward(*output[1:])


def _ce_op_backward(ctx, grad_loss, *_unused):
    need = tuple(ctx.needs_input_grad[:3])
    missing = [n for n, a, c in zip(("need_dh", "need_dw", "need_db"), need, ctx.computed) if a > c]
    if missing and ctx.reduction != "none":
        raise RuntimeError(
            f"fused_linear_ce: autograd needs a gradient the forward did not compute; call the op "
            f"with {', '.join(missing)}=True for inputs that require grad"
        )
    if ctx.reduction == "none":
        hidden, weight, bias, labels = ctx.saved_tensors
        ignore_index, *rest = ctx.cfg_args
        grads = _fused_linear_ce_rows_bwd_op(
            hidden, weight, bias, labels, grad_loss, ignore_index, *rest, *need
        )
    else:
        dh, dw, db, n_valid = ctx.saved_tensors
        factor = grad_loss.float()
        if ctx.reduction == "mean":  # the gradients are all zero when no token is kept
            factor = factor / n_valid.clamp(min=1)
        grads = tuple(g * factor for g in (dh, dw, db))
    dh, dw, db = (g if n else None for g, n in zip(grads, need))
    return (dh, dw, db) + (None,) * 13


_fused_linear_ce_op.register_autograd(_ce_op_backward, setup_context=_ce_setup_context)


def fused_linear_ce_traced(hidden, weight, bias, labels, cfg: LossConfig) -> torch.Tensor:
    """The autograd.Function's result through the registered op (under torch.compile)."""
    grad = torch.is_grad_enabled()
    needs = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    return _fused_linear_ce_op(
        hidden, weight, bias, labels, cfg.ignore_index, cfg.reduction, cfg.softcap,
        cfg.logit_scale, cfg.label_smoothing, cfg.z_loss, cfg.chunk_size, cfg.backend,
        cfg.drop_ignored, *needs,
    )[0]  # fmt: skip
