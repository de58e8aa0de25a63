"""The fused linear cross-entropy's algorithm: the row step, the chunk driver, row compaction.

The math, the contract and why the dW accumulator is fp32 are in ``function.py`` (the public
function); this module is what both the eager autograd path and the registered op
(``torch_library.py``) run:

    ce_rows_torch / ce_rows_triton   row step: lse, loss_t and dloss/dlogits in place over a chunk
                                     (C, V) of logits; Triton in kernel.py
    linear_ce_chunks                 the chunk loop: matmuls around the row step, every gradient
                                     computed during the forward
    kept_rows / scatter_rows         the rows the chunk loop runs over: all (default, no sync), or
                                     only the kept ones (drop_ignored_tokens: one host sync)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # the Triton row kernel; without triton only the pure-torch row step exists
    from .kernel import ce_rows_triton
except ModuleNotFoundError as exc:
    if exc.name != "triton" and not (exc.name or "").startswith("triton."):
        raise
    ce_rows_triton = None

# Logits-buffer budget per chunk: large enough that cuBLAS runs at full speed (C >= 2K rows), small
# next to what HF materialises (V x N x 10 bytes and more).
_CHUNK_BYTES = {"cuda": 1 << 30}
_CHUNK_BYTES_DEFAULT = 1 << 26


# fp32 inputs: dh sums its V products in blocks of this many vocabulary columns, each block's
# product added into the fp32 output. One K = V cuBLAS GEMM in fp32 loses ~1e-6 relative at V 152K
# on an H200 (60x what its inputs' rounding costs), and propagated through the model that made our
# fp32 gradients ~3x noisier than a vocab-tiled head such as TRL's (tests/integrations/test_trl_fused_loss.py).
# In bf16/fp16 the output's own rounding (2^-9) dwarfs that, so one GEMM is kept there.
DH_VOCAB_BLOCK_FP32 = 16384

# ----------------------------------------------------------------------------------------------
# Row step launchers (tensor in/out, no autograd): Triton (kernel.py) and pure
# torch, same contract
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossConfig:
    ignore_index: int
    reduction: str
    softcap: float | None
    logit_scale: float
    label_smoothing: float
    z_loss: float
    chunk_size: int | None
    backend: str  # "triton" | "torch" (resolved)
    drop_ignored: bool = False  # drop ignored rows before the matmuls (one host sync; kept_rows)


def ce_rows_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    cfg: LossConfig,
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


def _dlogits_times_weight(g: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out (C, H) = g (C, V) @ weight (V, H); in fp32 blockwise over V (DH_VOCAB_BLOCK_FP32)."""
    vocab = weight.shape[0]
    block = DH_VOCAB_BLOCK_FP32
    if g.dtype != torch.float32 or vocab <= block:
        torch.mm(g, weight, out=out)
        return
    torch.mm(g[:, :block], weight[:block], out=out)
    for v0 in range(block, vocab, block):
        out.addmm_(g[:, v0 : v0 + block], weight[v0 : v0 + block])


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
    cfg: LossConfig,
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
    # One chunk: dW is one matmul over all rows, as HF's head computes it (cuBLAS accumulates in
    # fp32 and rounds once), written in the weight's dtype: no V x H fp32 accumulator, no zero-fill,
    # no final cast (at V 152K x H 2048: 1.2 GB less memory and ~3.7 GB less traffic per step).
    one_chunk = 0 < n_rows <= chunk and hidden.dtype == weight.dtype
    dw = None
    if need_dw and not one_chunk:
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
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
            _dlogits_times_weight(lg, weight, dh[start:stop])
        if need_dw and one_chunk:
            dw = torch.mm(lg.t(), h_c)
        elif need_dw:
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


def scatter_rows(values: torch.Tensor, idx: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    """Put the rows computed for the kept tokens back at their places among all n_rows (zeros)."""
    if idx is None:
        return values
    out = values.new_zeros((n_rows, *values.shape[1:]))
    return out.index_copy_(0, idx, values)


def capturing(hidden: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on hidden's device (never on CPU tensors)."""
    return hidden.is_cuda and torch.cuda.is_current_stream_capturing()


def kept_rows(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int, drop: bool):
    """(n_valid, idx, h, y): the rows the chunk loop runs over, and the kept-token count.

    drop False (the default of every entry point): every row goes through the chunk loop (ignored
    ones get zero loss and gradients from the row step), nothing is read back to the host and
    ``n_valid`` is a 0-d device tensor: graph-safe, no sync mid-forward. drop True: the rows whose
    label is ignored are dropped before the matmuls (fewer FLOPs when many labels are ignored, e.g.
    long masked prompts), which needs their count on the host: one sync per call, refused while a
    CUDA graph is captured (a host read there is illegal). idx None when no row was dropped."""
    keep = labels != ignore_index
    if not drop:
        return keep.sum(), None, hidden, labels
    if capturing(hidden):
        raise ValueError(
            "drop_ignored_tokens=True reads the kept-token count back to the host, which a CUDA "
            "graph capture cannot do; use drop_ignored_tokens=False (the default) for captured steps"
        )
    # Host reads, intended (drop_ignored_tokens=True only): the count, and nonzero's data-dependent
    # size, once per loss call, inside the opaque custom op torch.compile sees
    # (torch.ops.hf_varlen.fused_linear_ce), so they never break the graph; refused above while
    # a CUDA graph is captured.
    n_valid = int(keep.sum())
    idx = None if n_valid == hidden.shape[0] else keep.nonzero().squeeze(1)
    h = hidden if idx is None else hidden.index_select(0, idx)
    y = labels if idx is None else labels.index_select(0, idx)
    return n_valid, idx, h, y


def at_least_one(n_valid):
    """max(n_valid, 1) for an int or a 0-d tensor: no label token divides by 1, not 0."""
    return n_valid.clamp(min=1) if isinstance(n_valid, torch.Tensor) else torch.sym_max(n_valid, 1)
