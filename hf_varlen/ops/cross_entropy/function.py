"""Fused, chunked linear cross-entropy: lm_head matmul + cross-entropy without full logits.

Math (per token t with hidden h_t, label y_t; W the (V, H) lm_head weight, b its optional bias;
s = ``logit_scale``, c = ``softcap``, e = ``label_smoothing``, k = ``z_loss``):

    x_t   = round(h_t @ W^T + b)                 the lm_head matmul, rounded to the input dtype
    z_tj  = c * tanh(s * x_tj / c)               (z = s * x without a softcap; fp32 from here on)
    lse_t = log sum_j exp(z_tj)
    loss_t = lse_t - (1 - e) z_{t,y_t} - (e / V) sum_j z_tj + k lse_t^2     (0 where y_t is ignored)
    dloss_t / dz_tj = p_tj (1 + 2 k lse_t) - e / V - (1 - e) [j == y_t]      p = softmax(z_t)
    dloss_t / dx_tj = dloss_t / dz_tj * s * (1 - tanh^2)              (chain through cap and scale)

This is exactly F.cross_entropy(z, y, ignore_index, label_smoothing) (+ the PaLM z-loss) on the
fp32 upcast of the logits, which is what HF's ``ForCausalLMLoss`` computes. Reductions: "sum"
(the caller divides by the global label-token count, HF's ``num_items_in_batch``), "mean" (over
non-ignored tokens; 0 with zero gradients when there are none, where F.cross_entropy gives NaN) and
"none" (per token). Every reduction of a batch without label tokens is 0 with zero gradients.

Algorithm. Every token is processed in chunks of C rows (ignored ones get exactly zero loss and
gradients from the row step; the kept-token count stays on the device, so nothing syncs with the
host and a CUDA graph can capture the op). With ``drop_ignored_tokens=True`` the ignored tokens are
dropped before the matmuls instead (fewer FLOPs when many are ignored, one host sync per call to
count them, refused inside a CUDA-graph capture):

    logits = h_c @ W^T (+ b)                      cuBLAS, into one reused (C, V) buffer
    row kernel: lse, loss_t, and dloss/dx written IN PLACE over the logits (fp32 math)
    dh_c  = dlogits @ W                            cuBLAS, straight into the (N, H) output (fp32:
                                                   summed over blocks of 16K vocabulary columns,
                                                   chunks.DH_VOCAB_BLOCK_FP32)
    dW   += dlogits^T @ h_c                        fp32 accumulator (see below; one chunk: dW
                                                   is that one matmul, in the weight's dtype)
    db   += sum_rows(dlogits)

so every gradient is computed during the forward and the backward only scales by grad_output. Extra
peak memory is C x V (the buffer) + V x H fp32 (dW accumulator, when N > C) + N x H (dh), never
N x V.

Why the dW accumulator is fp32: HF computes dW with one matmul over all N tokens, so it is rounded
to bf16 once. Accumulating per-chunk products in bf16 would add one bf16 rounding per chunk (error
growing with N / C: 32 chunks at 128K tokens). An fp32 accumulator keeps a single final rounding, at
the cost of 4 V H bytes (2.5 GB at V=152K, H=4096) instead of 2 V H. On CUDA the product is added
by cuBLAS directly into the fp32 buffer (``addmm(out_dtype=float32)``); where that is unavailable
the bf16 product is added in a second step.

The row kernel reads the (C, V) logits twice (online max/sum-exp, then the gradient) and writes them
once; it runs one program per row, streaming V in BLOCK_V pieces. A pure-torch version of the same
row step (same chunking) runs on CPU outside the Triton interpreter, so CPU training is not slowed
down by the interpreter; ``backend="auto"`` picks by device. The Triton kernel lives in
``kernel.py``, imported only where triton is installed: without it (CPU-only installs)
"auto" is the torch row step and "triton" raises.

Dispatch: ``torch.ops.hf_varlen.fused_linear_ce`` (+ ``fused_linear_ce_rows_bwd`` for "none") is an
opaque ``custom_op`` with a fake implementation and autograd via ``register_autograd``; the chunk
loop (and, with ``drop_ignored_tokens``, its row-count sync) runs inside it, so torch.compile traces
it without a graph break or a Python number read from a tensor. The public function calls it only
while torch.compile traces; eager calls keep the ``autograd.Function`` (a registered op's dispatch
costs ~20 us more host time per call on CPU, torch 2.13). Both run the same chunk loop.

Modules: this one (validation, the eager autograd.Function, the public function),
``chunks.py`` (row step launchers, the chunk loop, row compaction),
``torch_library.py`` (the registered ops), ``kernel.py`` (the Triton row kernel).

Shapes: hidden (..., H) (e.g. (B, T, H) or packed (T, H)), labels (...) aligned with hidden: the
label of row t is the target for row t. The op does NOT shift; HF's causal shift belongs to the
caller (``hf_varlen.integrations.fused_loss`` does it). weight (V, H), bias (V,). Output: fp32 scalar for
"sum"/"mean", fp32 (...) for "none".
"""

from __future__ import annotations

import os

import torch

from ..common import IGNORE_INDEX, check_int, env_flag
from ..library import compiling
from .chunks import (
    LossConfig,
    at_least_one,
    ce_rows_torch,
    ce_rows_triton,
    default_chunk_size,
    kept_rows,
    linear_ce_chunks,
    scatter_rows,
)
from .torch_library import fused_linear_ce_traced

__all__ = ["ce_rows_torch", "ce_rows_triton", "default_chunk_size", "fused_linear_cross_entropy"]

_INTERPRET = env_flag("TRITON_INTERPRET")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCTIONS = ("sum", "mean", "none")
_BACKENDS = ("auto", "triton", "torch")


# ----------------------------------------------------------------------------------------------
# Autograd (eager): every gradient computed in the forward, scaled in the backward
# ----------------------------------------------------------------------------------------------


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, cfg: LossConfig):
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        need_grad = need_dh or need_dw or need_db
        n_rows = hidden.shape[0]
        n_valid, idx, h, y = kept_rows(hidden, labels, cfg.ignore_index, cfg.drop_ignored)
        ctx.cfg, ctx.idx, ctx.n_rows, ctx.n_valid = cfg, idx, n_rows, n_valid

        # "none" has a per-token grad_output, known only in backward: recompute there.
        defer = cfg.reduction == "none" and need_grad
        loss, dh, dw, db = linear_ce_chunks(
            h, weight, bias, y, cfg, need_dh=need_dh and not defer, need_dw=need_dw and not defer,
            need_db=need_db and not defer,
        )  # fmt: skip
        if defer:
            ctx.save_for_backward(h, weight, bias, y)
        elif need_grad:
            ctx.grads = (None if dh is None else scatter_rows(dh, idx, n_rows), dw, db)

        if cfg.reduction == "none":
            return scatter_rows(loss, idx, n_rows)
        total = loss.sum()
        # max(.., 1): no label token gives 0 (an empty sum), not 0 / 0 = NaN
        return total if cfg.reduction == "sum" else total / at_least_one(n_valid)

    @staticmethod
    def backward(ctx, grad_out):
        cfg = ctx.cfg
        if cfg.reduction == "none":
            h, weight, bias, y = ctx.saved_tensors
            scale = (
                grad_out.float() if ctx.idx is None else grad_out.float().index_select(0, ctx.idx)
            )
            _, dh, dw, db = linear_ce_chunks(
                h,
                weight,
                bias,
                y,
                cfg,
                need_dh=ctx.needs_input_grad[0],
                need_dw=ctx.needs_input_grad[1],
                need_db=ctx.needs_input_grad[2],
                row_scale=scale.contiguous(),
            )
            dh = None if dh is None else scatter_rows(dh, ctx.idx, ctx.n_rows)
            return dh, dw, db, None, None

        grads = getattr(ctx, "grads", None)
        if grads is None:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward ran twice. Its gradients are computed in the "
                "forward and handed out once (retain_graph / double backward is not supported); "
                "call the op again for a second backward."
            )
        ctx.grads = None
        factor = grad_out.float()
        if cfg.reduction == "mean":  # the gradients are all zero when n_valid == 0
            factor = factor / at_least_one(ctx.n_valid)
        # In place: these buffers belong to this node only and are released right here.
        return tuple(None if g is None else g.mul_(factor) for g in grads) + (None, None)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    triton_ok = device.type == "cuda" or (device.type == "cpu" and _INTERPRET)
    if backend == "auto":
        return "triton" if triton_ok and ce_rows_triton is not None else "torch"
    if backend == "triton" and ce_rows_triton is None:
        raise ValueError(
            "backend: 'triton' needs the triton package, which is not installed (pip install "
            "triton, or pass backend='torch')"
        )
    if backend == "triton" and not triton_ok:
        raise ValueError(
            "backend: 'triton' needs a CUDA tensor, or TRITON_INTERPRET=1 set before import on "
            "CPU; "
            f"got a {device.type} tensor (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})"
        )
    return backend


def _check_inputs(hidden, weight, labels, bias, reduction, softcap, label_smoothing, z_loss,
                  chunk_size, logit_scale):  # fmt: skip
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if type(weight).__name__ == "DTensor" or type(hidden).__name__ == "DTensor":
        raise TypeError(
            "weight/hidden: expected plain tensors, got a DTensor (FSDP2/TP shard); gather it "
            "first "
            "(weight.full_tensor()) or call the op inside the lm_head module's forward"
        )
    if hidden.dtype not in _DTYPES:
        raise TypeError(f"hidden: expected dtype in {_DTYPES}, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight: expected dtype {hidden.dtype} (the hidden dtype), got {weight.dtype}"
        )
    if hidden.dim() < 2:
        raise ValueError(
            f"hidden: expected shape (..., H) with >= 2 dims, got {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected shape (V, {hidden.shape[-1]}), got {tuple(weight.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected dtype int64 or int32, got {labels.dtype}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels: expected shape {tuple(hidden.shape[:-1])} (hidden without its last dim; "
            f"labels are aligned, not shifted), got {tuple(labels.shape)}"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(
                f"bias: expected a tensor of shape ({weight.shape[0]},), got {bias!r:.80}"
            )
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias: expected dtype {hidden.dtype}, got {bias.dtype}")
    for name, t in (("weight", weight), ("labels", labels), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name}: expected device {hidden.device} (hidden's), got {t.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    if softcap is not None and not (isinstance(softcap, int | float) and softcap > 0):
        raise ValueError(f"softcap: expected None or a positive number, got {softcap!r}")
    if not (isinstance(label_smoothing, int | float) and 0.0 <= label_smoothing < 1.0):
        raise ValueError(f"label_smoothing: expected a number in [0, 1), got {label_smoothing!r}")
    if not (isinstance(z_loss, int | float) and z_loss >= 0.0):
        raise ValueError(f"z_loss: expected a number >= 0, got {z_loss!r}")
    if not isinstance(logit_scale, int | float) or logit_scale == 0:
        raise ValueError(f"logit_scale: expected a non-zero number, got {logit_scale!r}")
    check_int("chunk_size", chunk_size, 1, allow_none=True)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    logit_scale: float = 1.0,
    backend: str = "auto",
    drop_ignored_tokens: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without the full logits.

    Args:
        hidden: (..., H) fp16/bf16/fp32 hidden states (the final norm output), any leading shape.
        weight: (V, H) lm_head weight in hidden's dtype (may be the tied embedding matrix: its
            gradient is returned to autograd, which adds it to the embedding's own).
        labels: (...) int64/int32 targets ALIGNED with hidden (row t predicts labels[t]); shift
            them beforehand for causal LM training. ``ignore_index`` rows contribute nothing.
        bias: optional (V,) lm_head bias.
        reduction: "sum" (divide by the global label-token count yourself, as HF does with
            ``num_items_in_batch``), "mean" over non-ignored tokens (0 if there are none), or
            "none" (per-token loss shaped like labels; its backward recomputes the logits).
        softcap: final-logit softcap c (Gemma2): z = c * tanh(z / c), applied after ``logit_scale``.
        label_smoothing: as in F.cross_entropy.
        z_loss: coefficient k of the auxiliary k * logsumexp(z)^2 per non-ignored token.
        chunk_size: tokens per chunk (default: a ~1 GiB logits buffer on CUDA, 64 MiB elsewhere).
        logit_scale: multiplies the logits before the softcap (Cohere ``logit_scale``, Granite
            ``1 / logits_scaling``).
        backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch".
        drop_ignored_tokens: False (default): every token goes through the matmuls, no host sync
            (graph-safe). True: tokens labelled ``ignore_index`` are dropped first (fewer FLOPs
            when many are ignored), at one host sync per call; refused inside a CUDA-graph capture.

    Returns:
        fp32 loss: a scalar for "sum"/"mean", labels-shaped for "none".

    Gradients for hidden, weight and bias are computed in the forward (only for inputs that require
    them) and scaled by grad_output in the backward, so the graph can be backpropagated once. Under
    autocast the inputs are cast to the autocast dtype, as nn.Linear would be. Labels outside
    [0, V) give a NaN loss.
    """
    if isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    _check_inputs(hidden, weight, labels, bias, reduction, softcap, label_smoothing, z_loss,
                  chunk_size, logit_scale)  # fmt: skip
    check_int("ignore_index", ignore_index, None)
    if not isinstance(drop_ignored_tokens, bool):
        raise TypeError(f"drop_ignored_tokens: expected True or False, got {drop_ignored_tokens!r}")
    cfg = LossConfig(
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=None if softcap is None else float(softcap),
        logit_scale=float(logit_scale),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        chunk_size=chunk_size,
        backend=_resolve_backend(backend, hidden.device),
        drop_ignored=drop_ignored_tokens,
    )
    lead_shape = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    y = labels.reshape(-1)
    with torch.autocast(hidden.device.type, enabled=False):
        if compiling():
            loss = fused_linear_ce_traced(h2, weight, bias, y, cfg)
        else:
            loss = _FusedLinearCrossEntropy.apply(h2, weight, bias, y, cfg)
    return loss.view(lead_shape) if reduction == "none" else loss
