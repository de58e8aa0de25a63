"""RMSNorm in Triton: forward and backward, Llama and Gemma styles, fp32 statistics.

Math (per row x of H elements; statistics and arithmetic in fp32; ``round`` = cast to x's dtype):

    rstd = 1 / sqrt(mean(x^2) + eps)            n = x * rstd
    Llama (add_unit_offset=False):  y = w * round(n)          (dtype promote(w, x), HF order)
    Gemma (add_unit_offset=True):   y = round(n * (1 + w))

Backward (dy upstream, g = d loss / d n; Llama rounds g like HF's autograd does):

    Llama:  g = round(dy * w)      dw = sum_rows dy * round(n)
    Gemma:  g = dy * (1 + w)       dw = sum_rows dy * n
    dx = rstd * (g - n * mean(g * n))

Shapes: x (..., H) with any leading shape (rows may be strided; the last dim must be contiguous,
else x is copied), weight (H,), output (..., H), rstd (rows,) fp32 saved for the backward pass.
dweight is reduced across rows in fp32: each of a few persistent programs accumulates its rows in
registers and writes one fp32 partial row; the partial rows are summed on the host side.

Offsets are int32 unless a row offset can pass 2^31 (``LONG_INDEXING``, decided on the host).

Dispatch: ``torch.ops.hf_varlen.rms_norm_fwd`` / ``rms_norm_bwd`` are the registered ops
(``triton_op`` on a GPU, so Inductor traces the launches; autograd via ``register_autograd``).
``rms_norm`` calls them only while torch.compile traces (``library.compiling()``); eager calls use
the ``autograd.Function`` directly: a registered op's dispatch costs ~20 us more host time per call
(CPU, torch 2.13, tiny tensor, autograd recording: 28 us vs 8 us), and the eager step is
host-bound at the batch sizes users run. Both paths launch the same kernels. ``eps`` is cast to
fp32 in the kernel: Inductor passes Python floats to user kernels as fp64, which would promote the
row's arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_common import INTERPRET as _INTERPRET
from .._triton_common import as_rows as _rows
from .._triton_common import kernel_op, launcher, round_to
from .._triton_common import rows_need_int64 as _needs_long_indexing
from ..library import compiling, first_two_grads

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HIDDEN = 65536  # one row lives in registers
_MAX_PREFETCH_BLOCK = 8192  # wider rows cannot double-buffer in registers without spilling


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, stride_x_row, stride_y_row, n_cols, eps, ADD_UNIT_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr, LONG_INDEXING: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if LONG_INDEXING:
        row = row.to(tl.int64)
    o_col = tl.arange(0, BLOCK)  # [BLOCK]
    m_col = o_col < n_cols

    b_x = tl.load(X + row * stride_x_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_w = tl.load(W + o_col, mask=m_col, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(b_x * b_x, axis=0) / n_cols + tl.cast(eps, tl.float32))
    tl.store(RSTD + row, rstd)
    b_n = b_x * rstd
    if ADD_UNIT_OFFSET:
        b_y = b_n * (1.0 + b_w)
    else:
        b_y = b_w * round_to(b_n, X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y_row + o_col, round_to(b_y, Y.dtype.element_ty), mask=m_col)


@triton.jit(do_not_specialize=["n_rows", "n_programs"])
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy_row, stride_x_row, stride_dx_row, n_rows, n_cols,
    n_programs, ADD_UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
    LONG_INDEXING: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    o_col = tl.arange(0, BLOCK)  # [BLOCK]
    m_col = o_col < n_cols
    x_dtype = X.dtype.element_ty

    b_w = tl.load(W + o_col, mask=m_col, other=0.0).to(tl.float32)
    if ADD_UNIT_OFFSET:
        b_w = 1.0 + b_w
    b_dw = tl.zeros([BLOCK], dtype=tl.float32)
    if PREFETCH:
        # Software pipelining by hand: the next row's x, dy (kept in the input dtype) and rstd
        # load during this row's reduction and store, so two programs per SM keep HBM busy.
        # The grid does not depend on n_rows, so a program may have no row at all: it loads
        # nothing (the address is clamped into range) and writes a zero partial row.
        m_first = o_col < tl.where(pid < n_rows, n_cols, 0)
        first = tl.minimum(pid, n_rows - 1)
        if LONG_INDEXING:
            first = tl.cast(first, tl.int64)
        b_x_next = tl.load(X + first * stride_x_row + o_col, mask=m_first, other=0.0)
        b_dy_next = tl.load(DY + first * stride_dy_row + o_col, mask=m_first, other=0.0)
        rstd_next = tl.load(RSTD + first)
    for i_row in range(pid, n_rows, n_programs):
        # (the int32 cast is a no-op, but makes row a tensor in the interpreter too)
        row = tl.cast(i_row, tl.int64 if LONG_INDEXING else tl.int32)
        if PREFETCH:
            b_x = b_x_next.to(tl.float32)
            b_dy = b_dy_next.to(tl.float32)
            rstd = rstd_next
            nxt = row + n_programs
            m_next = o_col < tl.where(nxt < n_rows, n_cols, 0)  # nothing past the last row
            nxt = tl.minimum(nxt, n_rows - 1)  # keeps the masked-off address in range
            b_x_next = tl.load(X + nxt * stride_x_row + o_col, mask=m_next, other=0.0)
            b_dy_next = tl.load(DY + nxt * stride_dy_row + o_col, mask=m_next, other=0.0)
            rstd_next = tl.load(RSTD + nxt)
        else:
            b_x = tl.load(X + row * stride_x_row + o_col, mask=m_col, other=0.0).to(tl.float32)
            b_dy = tl.load(DY + row * stride_dy_row + o_col, mask=m_col, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
        b_n = b_x * rstd
        if ADD_UNIT_OFFSET:
            b_g = b_dy * b_w
            b_dw += b_dy * b_n
        else:
            b_g = round_to(b_dy * b_w, x_dtype).to(tl.float32)
            b_dw += b_dy * round_to(b_n, x_dtype).to(tl.float32)
        b_dx = (b_g - b_n * (tl.sum(b_g * b_n, axis=0) / n_cols)) * rstd
        tl.store(DX + row * stride_dx_row + o_col, round_to(b_dx, x_dtype), mask=m_col)
    tl.store(DW_PARTIAL + pid * n_cols + o_col, b_dw, mask=m_col)


# ----------------------------------------------------------------------------------------------
# Launchers (tensors in, tensors out; no autograd)
# ----------------------------------------------------------------------------------------------


def _block_and_warps(n_cols: int, num_warps: int | None) -> tuple[int, int]:
    """One row per block, ~16 elements per thread (no register spills up to H = 8192)."""
    block = triton.next_power_of_2(n_cols)
    return block, num_warps or max(1, min(32, block // 512))


def _num_programs(device: torch.device, num_warps: int, programs_per_sm: int | None) -> int:
    """Persistent grid size for the backward pass: a constant of the device and block config.

    ~16 warps per SM: kernels use <= 128 registers per thread, so 2 programs of 8 warps (H = 4096)
    or 4 of 4 warps (H = 2048) are all resident at once (no partial second wave).
    Never a function of the row count: under torch.compile the row count (the pack's tokens) is
    symbolic, and ``min(n_rows, programs)`` guards on which side of it a pack lies, so packs on
    both sides recompile (measured on the H200 at the 1B shape: 528 programs, and batch-8 packs of
    487..904 tokens compiled a second graph at the first pack under 528). Programs past the last
    row only write a zero partial row.
    """
    if device.type != "cuda":  # interpreter: a few programs still exercise the row loop
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return sms * (programs_per_sm or max(2, 16 // num_warps))


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    add_unit_offset: bool,
    *,
    long_indexing: bool | None = None,
    num_warps: int | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y a fresh contiguous tensor of x's shape, rstd (rows,) fp32.

    ``long_indexing``/``num_warps`` are private overrides for tests and benchmarks; ``traced``:
    launch through ``launcher`` (inside the registered op).
    """
    out_dtype = x.dtype if add_unit_offset else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y, rstd
    y2 = y.view(-1, n_cols)
    weight = weight.contiguous()
    block, num_warps = _block_and_warps(n_cols, num_warps)
    if long_indexing is None:
        long_indexing = _needs_long_indexing(n_rows, block, [x2.stride(0), n_cols])
    kernel = launcher(_rms_norm_fwd_kernel, x) if traced else _rms_norm_fwd_kernel
    kernel[(n_rows,)](
        x2, weight, y2, rstd, x2.stride(0), y2.stride(0), n_cols, eps,
        ADD_UNIT_OFFSET=add_unit_offset, BLOCK=block, LONG_INDEXING=bool(long_indexing),
        num_warps=num_warps,
    )  # fmt: skip
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    add_unit_offset: bool,
    *,
    long_indexing: bool | None = None,
    num_warps: int | None = None,
    programs_per_sm: int | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) as fresh tensors (dx contiguous, x's dtype; dweight weight's dtype)."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    if dx.numel() == 0:
        return dx, torch.zeros_like(weight)
    dx2 = dx.view(-1, n_cols)
    weight = weight.contiguous()
    block, num_warps = _block_and_warps(n_cols, num_warps)
    n_programs = _num_programs(x.device, num_warps, programs_per_sm)
    dw_partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x.device)
    if long_indexing is None:
        long_indexing = _needs_long_indexing(n_rows, block, [x2.stride(0), dy2.stride(0), n_cols])
    kernel = launcher(_rms_norm_bwd_kernel, x) if traced else _rms_norm_bwd_kernel
    kernel[(n_programs,)](
        dy2, x2, weight, rstd, dx2, dw_partial, dy2.stride(0), x2.stride(0), dx2.stride(0),
        n_rows, n_cols, n_programs, ADD_UNIT_OFFSET=add_unit_offset, BLOCK=block,
        PREFETCH=block <= _MAX_PREFETCH_BLOCK, LONG_INDEXING=bool(long_indexing),
        num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_partial.sum(0).to(weight.dtype)


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, add_unit_offset):
        y, rstd = rms_norm_forward(x, weight, eps, add_unit_offset)
        ctx.add_unit_offset = add_unit_offset
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        return first_two_grads(
            ctx, 4, lambda: rms_norm_backward(dy, x, weight, rstd, ctx.add_unit_offset)
        )


# The registered ops (what torch.compile sees). Same kernels, same autograd contract.
@kernel_op("rms_norm_fwd")
def _rms_norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, add_unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_forward(x, weight, eps, add_unit_offset, traced=True)


@kernel_op("rms_norm_bwd")
def _rms_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    add_unit_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(dy, x, weight, rstd, add_unit_offset, traced=True)


def _rms_norm_setup_context(ctx, inputs, output) -> None:
    x, weight, _, ctx.add_unit_offset = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    return first_two_grads(
        ctx, 4, lambda: _rms_norm_bwd_op(dy, x, weight, rstd, ctx.add_unit_offset)
    )


_rms_norm_fwd_op.register_autograd(_rms_norm_op_backward, setup_context=_rms_norm_setup_context)


def _check_inputs(x, weight, eps) -> None:
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rms_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"rms_norm: {name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.device.type != "cuda" and not _INTERPRET:
            raise ValueError(
                f"rms_norm: {name} must be on a CUDA device (or set TRITON_INTERPRET=1 before "
                f"importing hf_varlen for the CPU interpreter), got {t.device}"
            )
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must have a last dim of size >= 1, got {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) to match x's last dim, got "
            f"{tuple(weight.shape)}"
        )
    if x.shape[-1] > _MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size must be <= {_MAX_HIDDEN}, got {x.shape[-1]}")
    if weight.device != x.device:
        raise ValueError(
            f"rms_norm: x and weight must be on one device, got {x.device} and {weight.device}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm: eps must be a float >= 0, got {eps!r}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, add_unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim with HF's rounding order, differentiable in x and weight.

    Args:
        x: (..., H) fp16/bf16/fp32. Leading dims may be strided; a non-contiguous last dim is
            copied first. H <= 65536.
        weight: (H,) fp16/bf16/fp32 on x's device.
        eps: added to mean(x^2) in fp32.
        add_unit_offset: False for Llama style (``LlamaRMSNorm``: ``weight * n.to(x.dtype)``, output
            dtype ``promote(weight, x)``); True for Gemma style (``GemmaRMSNorm``/``Gemma2RMSNorm``:
            ``(n * (1 + weight.float())).to(x.dtype)``).

    Returns:
        (..., H) tensor matching the HF module's output within the numerics rule of hf_varlen/testing.py.
        Inputs are never modified; the backward pass returns fresh dx and an fp32-accumulated
        dweight.
    """
    _check_inputs(x, weight, eps)
    if compiling():
        return _rms_norm_fwd_op(x, weight, float(eps), bool(add_unit_offset))[0]
    return _RMSNormFunction.apply(x, weight, float(eps), bool(add_unit_offset))
