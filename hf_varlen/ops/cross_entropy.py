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

Algorithm. Tokens whose label is ignored are dropped first (one host sync to count them; their loss
and gradients are exactly zero; while a CUDA graph is captured nothing is dropped, see
``_compact_rows``), then the kept tokens are processed in chunks of C rows:

    logits = h_c @ W^T (+ b)                      cuBLAS, into one reused (C, V) buffer
    row kernel: lse, loss_t, and dloss/dx written IN PLACE over the logits (fp32 math)
    dh_c  = dlogits @ W                            cuBLAS, straight into the (N, H) output
    dW   += dlogits^T @ h_c                        fp32 accumulator (see below)
    db   += sum_rows(dlogits)

so every gradient is computed during the forward and the backward only scales by grad_output. Extra
peak memory is C x V (the buffer) + V x H fp32 (dW accumulator) + N x H (dh), never N x V.

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
``cross_entropy_kernel.py``, imported only where triton is installed: without it (CPU-only installs)
"auto" is the torch row step and "triton" raises.

Dispatch: ``torch.ops.hf_varlen.fused_linear_ce`` (+ ``fused_linear_ce_rows_bwd`` for "none") is an
opaque ``custom_op`` with a fake implementation and autograd via ``register_autograd``; the chunk
loop and its row-count sync run inside it, so torch.compile traces it without a graph break or a
Python number read from a tensor. The public function calls it only while torch.compile traces;
eager calls keep the ``autograd.Function`` (a registered op's dispatch costs ~20 us more host time
per call on CPU, torch 2.13). Both run the same chunk loop.

Shapes: hidden (..., H) (e.g. (B, T, H) or packed (T, H)), labels (...) aligned with hidden: the
label of row t is the target for row t. The op does NOT shift; HF's causal shift belongs to the
caller (``hf_varlen.integrations.loss`` does it). weight (V, H), bias (V,). Output: fp32 scalar for
"sum"/"mean", fp32 (...) for "none".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .common import IGNORE_INDEX, check_int, env_flag
from .library import compiling, qualname

try:  # the Triton row kernel; without triton only the pure-torch row step exists
    from .cross_entropy_kernel import ce_rows_triton
except ModuleNotFoundError as exc:
    if exc.name != "triton" and not (exc.name or "").startswith("triton."):
        raise
    ce_rows_triton = None

_INTERPRET = env_flag("TRITON_INTERPRET")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCTIONS = ("sum", "mean", "none")
_BACKENDS = ("auto", "triton", "torch")
# Logits-buffer budget per chunk: large enough that cuBLAS runs at full speed (C >= 2K rows), small
# next to what HF materialises (V x N x 10 bytes and more).
_CHUNK_BYTES = {"cuda": 1 << 30}
_CHUNK_BYTES_DEFAULT = 1 << 26


# ----------------------------------------------------------------------------------------------
# Row step launchers (tensor in/out, no autograd): Triton (cross_entropy_kernel.py) and pure
# torch, same contract
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LossConfig:
    ignore_index: int
    reduction: str
    softcap: float | None
    logit_scale: float
    label_smoothing: float
    z_loss: float
    chunk_size: int | None
    backend: str  # "triton" | "torch" (resolved)


def ce_rows_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    cfg: _LossConfig,
    *,
    compute_grad: bool,
    row_scale: torch.Tensor | None = None,
) -> None:
    """Same contract as :func:`ce_rows_triton`, in torch ops (fp32 temporaries of the chunk)."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return
    eps = cfg.label_smoothing
    z = logits.float() * cfg.logit_scale
    t = None
    if cfg.softcap is not None:
        t = torch.tanh(z / cfg.softcap)
        z = t * cfg.softcap
    lse = torch.logsumexp(z, dim=1)
    ignored = labels == cfg.ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    y = torch.where(in_range, labels, 0).long()[:, None]
    row = lse - (1.0 - eps) * z.gather(1, y).squeeze(1)
    if eps > 0.0:
        row -= eps * z.mean(dim=1)
    if cfg.z_loss > 0.0:
        row += cfg.z_loss * lse.square()
    row = torch.where(in_range, row, float("nan")).masked_fill(ignored, 0.0)
    loss.copy_(row)
    if not compute_grad:
        return
    g = z.sub_(lse[:, None]).exp_()
    if cfg.z_loss > 0.0:
        g *= (1.0 + 2.0 * cfg.z_loss * lse)[:, None]
    if eps > 0.0:
        g -= eps / vocab
    g.scatter_add_(1, y, g.new_full(y.shape, eps - 1.0))
    if t is not None:
        g *= 1.0 - t.square()
    scale = torch.full((n_rows,), cfg.logit_scale, dtype=torch.float32, device=g.device)
    if row_scale is not None:
        scale = scale * row_scale
    g *= scale.masked_fill(ignored, 0.0)[:, None]
    logits.copy_(g)


# ----------------------------------------------------------------------------------------------
# Chunk driver: matmuls + row step, all gradients during the forward
# ----------------------------------------------------------------------------------------------

_ADDMM_OUT_DTYPE_OK: dict[tuple, bool] = {}


def _addmm_out_dtype_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``addmm(acc32, a, b, out_dtype=float32, out=acc32)`` works here (probed once)."""
    key = (device.type, device.index, dtype)
    if key not in _ADDMM_OUT_DTYPE_OK:
        ok = False
        if device.type == "cuda":
            try:
                gen = torch.Generator(device=device).manual_seed(0)
                a = torch.randn(64, 96, device=device, generator=gen).to(dtype).t()
                b = torch.randn(64, 80, device=device, generator=gen).to(dtype)
                acc = torch.randn(96, 80, device=device, generator=gen)
                want = acc + a.float() @ b.float()
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                ok = bool(torch.allclose(acc, want, rtol=1e-3, atol=1e-3))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _ADDMM_OUT_DTYPE_OK[key] = ok
    return _ADDMM_OUT_DTYPE_OK[key]


def _accumulate_wgrad(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b with a, b in the compute dtype, rounding the product only into fp32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_out_dtype_ok(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b))


def default_chunk_size(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Chunk rows C (a multiple of 256) so the (C, V) logits buffer fits a per-device budget."""
    budget = _CHUNK_BYTES.get(device.type, _CHUNK_BYTES_DEFAULT)
    rows = budget // (vocab * torch.empty((), dtype=dtype).element_size())
    return max(1, min(n_rows, max(256, rows // 256 * 256)))


def linear_ce_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    cfg: _LossConfig,
    *,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    row_scale: torch.Tensor | None = None,
):
    """Loss per row (N,) fp32 and, if asked, dh (N, H), dW (V, H), db (V,) in the input dtypes.

    hidden (N, H), labels (N,) may contain ignored rows (they get zero loss and gradient). The
    gradients are those of sum(loss_t * row_scale_t) (row_scale = 1 when None).
    """
    n_rows, _ = hidden.shape
    vocab = weight.shape[0]
    compute_grad = need_dh or need_dw or need_db
    chunk = cfg.chunk_size or default_chunk_size(n_rows, vocab, hidden.dtype, hidden.device)
    rows_fn = ce_rows_triton if cfg.backend == "triton" else ce_rows_torch

    loss = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
    db = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_db else None
    buf = torch.empty(min(chunk, n_rows), vocab, dtype=hidden.dtype, device=hidden.device)
    w_t = weight.t()
    h_c = lg = None
    for start in range(0, n_rows, chunk):
        stop = min(start + chunk, n_rows)
        h_c, lg = hidden[start:stop], buf[: stop - start]
        if bias is None:
            torch.mm(h_c, w_t, out=lg)
        else:
            torch.addmm(bias, h_c, w_t, out=lg)
        scale_c = None if row_scale is None else row_scale[start:stop]
        rows_fn(
            lg,
            labels[start:stop],
            loss[start:stop],
            cfg,
            compute_grad=compute_grad,
            row_scale=scale_c,
        )
        if need_dh:
            torch.mm(lg, weight, out=dh[start:stop])
        if need_dw:
            _accumulate_wgrad(dw, lg.t(), h_c)
        if need_db:
            db += lg.sum(dim=0, dtype=torch.float32)
    del buf, h_c, lg  # free the chunk buffer (views included) before dW's cast allocates
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return loss, dh, dw, db


# ----------------------------------------------------------------------------------------------
# Autograd glue
# ----------------------------------------------------------------------------------------------


def _scatter_rows(values: torch.Tensor, idx: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    """Put the rows computed for the kept tokens back at their places among all n_rows (zeros)."""
    if idx is None:
        return values
    out = values.new_zeros((n_rows, *values.shape[1:]))
    return out.index_copy_(0, idx, values)


def _compact_rows(hidden: torch.Tensor) -> bool:
    """Whether ignored rows are dropped before the matmuls: always, except while a CUDA graph is
    captured, where counting them (a host read) is illegal; then every row goes through the
    chunk loop (ignored ones get zero loss and gradients from the row step: more FLOPs, same
    result, no sync)."""
    return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


def _kept_rows(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """(n_valid, idx, h, y): the rows whose label is not ignored (idx None when all are kept).

    Ignored tokens are dropped before the matmuls: their loss and gradients are exactly zero.
    Counting them is the op's one host sync: the chunk loop needs the row count. Without
    compaction (``_compact_rows``) nothing is dropped and ``n_valid`` is a 0-d device tensor."""
    keep = labels != ignore_index
    if not _compact_rows(hidden):
        return keep.sum(), None, hidden, labels
    # Host read, intended: once per loss call (not per layer), and inside the opaque custom op
    # torch.compile sees (torch.ops.hf_varlen.fused_linear_ce), so it never breaks the graph;
    # skipped while a CUDA graph is captured (above).
    n_valid = int(keep.sum())
    idx = None if n_valid == hidden.shape[0] else keep.nonzero().squeeze(1)
    h = hidden if idx is None else hidden.index_select(0, idx)
    y = labels if idx is None else labels.index_select(0, idx)
    return n_valid, idx, h, y


def _at_least_one(n_valid):
    """max(n_valid, 1) for an int or a 0-d tensor: no label token divides by 1, not 0."""
    return n_valid.clamp(min=1) if isinstance(n_valid, torch.Tensor) else max(n_valid, 1)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, cfg: _LossConfig):
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        need_grad = need_dh or need_dw or need_db
        n_rows = hidden.shape[0]
        n_valid, idx, h, y = _kept_rows(hidden, labels, cfg.ignore_index)
        ctx.cfg, ctx.idx, ctx.n_rows, ctx.n_valid = cfg, idx, n_rows, n_valid

        # "none" has a per-token grad_output, known only in backward: recompute there.
        defer = cfg.reduction == "none" and need_grad
        loss, dh, dw, db = linear_ce_chunks(
            h,
            weight,
            bias,
            y,
            cfg,
            need_dh=need_dh and not defer,
            need_dw=need_dw and not defer,
            need_db=need_db and not defer,
        )
        if defer:
            ctx.save_for_backward(h, weight, bias, y)
        elif need_grad:
            ctx.grads = (None if dh is None else _scatter_rows(dh, idx, n_rows), dw, db)

        if cfg.reduction == "none":
            return _scatter_rows(loss, idx, n_rows)
        total = loss.sum()
        # max(.., 1): no label token gives 0 (an empty sum), not 0 / 0 = NaN
        return total if cfg.reduction == "sum" else total / _at_least_one(n_valid)

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
            dh = None if dh is None else _scatter_rows(dh, ctx.idx, ctx.n_rows)
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
            factor = factor / _at_least_one(ctx.n_valid)
        # In place: these buffers belong to this node only and are released right here.
        return tuple(None if g is None else g.mul_(factor) for g in grads) + (None, None)


# ----------------------------------------------------------------------------------------------
# Registered op (what torch.compile sees): opaque custom_op, gradients as outputs
# ----------------------------------------------------------------------------------------------
# The chunk loop is cuBLAS matmuls around a row kernel plus one host sync (the kept-row count),
# so it stays one opaque op: Inductor has nothing to fuse across it, and the sync happens inside
# the op (no graph break, nothing read into Python while tracing). The forward returns the loss,
# the gradients of the unscaled loss and the kept-token count as a tensor; the backward scales
# them by grad_output (divided by that count for "mean"), as the autograd.Function does. Unneeded
# gradients are empty (0,) tensors. "none" computes no gradient in the forward; its backward is
# the second op, which recomputes the logits with the per-token grad_output as row scale.


def _cfg_of(
    ignore_index: int,
    reduction: str,
    softcap: float | None,
    logit_scale: float,
    label_smoothing: float,
    z_loss: float,
    chunk_size: int | None,
    backend: str,
) -> _LossConfig:
    return _LossConfig(
        ignore_index, reduction, softcap, logit_scale, label_smoothing, z_loss, chunk_size, backend
    )


@torch.library.custom_op(qualname("fused_linear_ce"), mutates_args=())
def _fused_linear_ce_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float | None,
    logit_scale: float,
    label_smoothing: float,
    z_loss: float,
    chunk_size: int | None,
    backend: str,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _cfg_of(
        ignore_index, reduction, softcap, logit_scale, label_smoothing, z_loss, chunk_size, backend
    )
    n_rows = hidden.shape[0]
    n_valid, idx, h, y = _kept_rows(hidden, labels, ignore_index)
    defer = reduction == "none"
    loss, dh, dw, db = linear_ce_chunks(
        h,
        weight,
        bias,
        y,
        cfg,
        need_dh=need_dh and not defer,
        need_dw=need_dw and not defer,
        need_db=need_db and not defer,
    )
    if reduction == "none":
        loss = _scatter_rows(loss, idx, n_rows)
    else:
        loss = loss.sum()
        loss = loss if reduction == "sum" else loss / _at_least_one(n_valid)
    empty = hidden.new_empty
    return (
        loss,
        empty(0) if dh is None else _scatter_rows(dh, idx, n_rows),
        empty(0, dtype=weight.dtype) if dw is None else dw,
        empty(0, dtype=weight.dtype) if db is None else db,
        torch.as_tensor(n_valid, dtype=torch.int64, device=hidden.device),
    )


@_fused_linear_ce_op.register_fake
def _fused_linear_ce_fake(
    hidden, weight, bias, labels, ignore_index, reduction, softcap, logit_scale,
    label_smoothing, z_loss, chunk_size, backend, need_dh, need_dw, need_db,
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
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    grad_rows: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    logit_scale: float,
    label_smoothing: float,
    z_loss: float,
    chunk_size: int | None,
    backend: str,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of sum(loss_t * grad_rows_t) (reduction "none"); unneeded ones are (0,)."""
    cfg = _cfg_of(
        ignore_index, "none", softcap, logit_scale, label_smoothing, z_loss, chunk_size, backend
    )
    _, idx, h, y = _kept_rows(hidden, labels, ignore_index)
    scale = grad_rows.float() if idx is None else grad_rows.float().index_select(0, idx)
    _, dh, dw, db = linear_ce_chunks(
        h, weight, bias, y, cfg, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
        row_scale=scale.contiguous(),
    )  # fmt: skip
    empty = hidden.new_empty
    return (
        empty(0) if dh is None else _scatter_rows(dh, idx, hidden.shape[0]),
        empty(0, dtype=weight.dtype) if dw is None else dw,
        empty(0, dtype=weight.dtype) if db is None else db,
    )


@_fused_linear_ce_rows_bwd_op.register_fake
def _fused_linear_ce_rows_bwd_fake(
    hidden, weight, bias, labels, grad_rows, ignore_index, softcap, logit_scale,
    label_smoothing, z_loss, chunk_size, backend, need_dh, need_dw, need_db,
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
    return (dh, dw, db) + (None,) * 12


_fused_linear_ce_op.register_autograd(_ce_op_backward, setup_context=_ce_setup_context)


def _fused_linear_ce_traced(hidden, weight, bias, labels, cfg: _LossConfig) -> torch.Tensor:
    """The autograd.Function's result through the registered op (under torch.compile)."""
    grad = torch.is_grad_enabled()
    needs = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    return _fused_linear_ce_op(
        hidden, weight, bias, labels, cfg.ignore_index, cfg.reduction, cfg.softcap,
        cfg.logit_scale, cfg.label_smoothing, cfg.z_loss, cfg.chunk_size, cfg.backend, *needs,
    )[0]  # fmt: skip


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


def _check_inputs(
    hidden,
    weight,
    labels,
    bias,
    reduction,
    softcap,
    label_smoothing,
    z_loss,
    chunk_size,
    logit_scale,
):
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

    Returns:
        fp32 loss: a scalar for "sum"/"mean", labels-shaped for "none".

    Gradients for hidden, weight and bias are computed in the forward (only for inputs that require
    them) and scaled by grad_output in the backward, so the graph can be backpropagated once. Under
    autocast the inputs are cast to the autocast dtype, as nn.Linear would be. Counting the kept
    tokens costs one host sync per call; labels outside [0, V) give a NaN loss.
    """
    if isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    _check_inputs(
        hidden,
        weight,
        labels,
        bias,
        reduction,
        softcap,
        label_smoothing,
        z_loss,
        chunk_size,
        logit_scale,
    )
    check_int("ignore_index", ignore_index, None)
    cfg = _LossConfig(
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=None if softcap is None else float(softcap),
        logit_scale=float(logit_scale),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        chunk_size=chunk_size,
        backend=_resolve_backend(backend, hidden.device),
    )
    lead_shape = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    y = labels.reshape(-1)
    with torch.autocast(hidden.device.type, enabled=False):
        if compiling():
            loss = _fused_linear_ce_traced(h2, weight, bias, y, cfg)
        else:
            loss = _FusedLinearCrossEntropy.apply(h2, weight, bias, y, cfg)
    return loss.view(lead_shape) if reduction == "none" else loss
