"""Gated linear units (SwiGLU, GeGLU) in Triton: forward and backward.

Math (F = intermediate size; all arithmetic in fp32, rounding points as in HF eager):

    a   = round(act(gate))                  act = silu | gelu (erf) | gelu (tanh)
    out = round(a * up)
    d_up   = round(d_out * a)
    d_gate = round(round(d_out * up) * act'(gate))

``round`` is a cast to the input dtype; it is what HF's ``act_fn(gate_proj(x)) * up_proj(x)``
does in bf16/fp16 (every torch op rounds its result) and a no-op in fp32. The backward pass
recomputes ``act`` from the saved ``gate``/``up``: the activation is never stored.

    silu(g)      = g * s(g)                         s = sigmoid
    silu'(g)     = s(g) * (1 + g * (1 - s(g)))
    gelu(g)      = g * c(g)                         c = 0.5 * (1 + erf(g / sqrt(2)))
    gelu'(g)     = c(g) + g * exp(-g^2 / 2) / sqrt(2 pi)
    gelu_tanh(g) = g * s(2u)                        u = sqrt(2/pi) * (g + 0.044715 g^3)
    gelu_tanh'(g)= s(2u) + g * s(2u) * (1 - s(2u)) * 2 sqrt(2/pi) * (1 + 3 * 0.044715 g^2)

(``0.5 * (1 + tanh(u)) == s(2u)`` exactly, which avoids a tanh the Triton interpreter lacks.)

Shapes: gate, up (..., F) with any leading shape; the last dimension must be contiguous (else it
is copied), the leading dimensions may be strided, so ``gate, up = h[..., :F], h[..., F:]`` of one
fused (..., 2F) projection is read in place. Outputs and gradients are fresh contiguous (..., F).

Kernels: a flat grid of (row, column block) programs, column blocks fastest so consecutive
programs stream consecutive memory. Offsets are int32 unless some tensor's last element lies past
2^31 (``LONG_INDEXING``, decided on the host), so ordinary sizes keep the cheap path.

Dispatch: ``torch.ops.hf_varlen.glu_fwd`` / ``glu_bwd`` are the registered ops (``triton_op`` on a
GPU, so Inductor traces the launches; autograd through ``register_autograd``). ``swiglu``/``geglu``
call them only while torch.compile traces (``library.compiling()``); eager calls use the
``autograd.Function`` directly, because a registered op's dispatch costs ~20 us more host time per
call (measured on CPU, torch 2.13: 28 us vs 8 us for a tiny tensor with autograd recording) and
the eager step is host-bound at the batch sizes users run. Both paths launch the same kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .._triton_common import INT32_LIMIT, kernel_op, launcher, round_to
from .._triton_common import INTERPRET as _INTERPRET
from .._triton_common import as_rows as _rows
from .._triton_common import rows_need_int64 as _needs_long_indexing
from ..library import compiling, first_two_grads

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_CUBIC = tl.constexpr(0.044715)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sigmoid_pair(z):
    """(sigmoid(z), 1 - sigmoid(z)) without the cancellation of computing 1 - s."""
    e = tl.exp(-tl.abs(z))  # <= 1: never overflows
    s_big = 1.0 / (1.0 + e)
    s_small = e * s_big
    return tl.where(z >= 0, s_big, s_small), tl.where(z >= 0, s_small, s_big)


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """act(g) for fp32 g (the same expressions as _activation_and_grad)."""
    if ACTIVATION == "silu":
        a = g * tl.sigmoid(g)
    elif ACTIVATION == "gelu":
        a = g * (0.5 * (1.0 + tl.math.erf(g * _SQRT1_2)))
    else:  # gelu_tanh: 0.5 * (1 + tanh(u)) = sigmoid(2u)
        s, _ = _sigmoid_pair((g + g * g * g * _GELU_CUBIC) * (2.0 * _SQRT_2_OVER_PI))
        a = g * s
    return a


@triton.jit
def _activation_and_grad(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)) for fp32 g."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu":
        c = 0.5 * (1.0 + tl.math.erf(g * _SQRT1_2))
        a = g * c
        da = c + g * tl.exp(-0.5 * g * g) * _INV_SQRT_2PI
    else:  # gelu_tanh
        g2 = g * g
        s, s_c = _sigmoid_pair((g + g2 * g * _GELU_CUBIC) * (2.0 * _SQRT_2_OVER_PI))
        a = g * s
        da = s + a * s_c * (1.0 + g2 * (3.0 * _GELU_CUBIC)) * (2.0 * _SQRT_2_OVER_PI)
    return a, da


@triton.jit
def _row_block(n_cols, n_col_blocks, BLOCK: tl.constexpr, LONG_INDEXING: tl.constexpr):
    """This program's (row, o_col [BLOCK], m_col) in a grid of rows x n_col_blocks column blocks;
    row is int64 with LONG_INDEXING."""
    pid = tl.program_id(0)
    row = pid // n_col_blocks
    if LONG_INDEXING:
        row = row.to(tl.int64)
    o_col = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    return row, o_col, o_col < n_cols


@triton.jit
def _glu_fwd_kernel(
    GATE, UP, OUT, stride_gate_row, stride_up_row, stride_out_row, n_cols, n_col_blocks,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, LONG_INDEXING: tl.constexpr,
):  # fmt: skip
    row, o_col, m_col = _row_block(n_cols, n_col_blocks, BLOCK, LONG_INDEXING)
    dtype = OUT.dtype.element_ty

    b_g = tl.load(GATE + row * stride_gate_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_u = tl.load(UP + row * stride_up_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_a = round_to(_activation(b_g, ACTIVATION), dtype).to(tl.float32)  # HF rounds act(gate) first
    tl.store(OUT + row * stride_out_row + o_col, round_to(b_a * b_u, dtype), mask=m_col)


@triton.jit
def _glu_bwd_kernel(
    DOUT, GATE, UP, DGATE, DUP, stride_dout_row, stride_gate_row, stride_up_row, n_cols,
    n_col_blocks, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, LONG_INDEXING: tl.constexpr,
):  # fmt: skip
    row, o_col, m_col = _row_block(n_cols, n_col_blocks, BLOCK, LONG_INDEXING)
    dtype = DGATE.dtype.element_ty

    b_do = tl.load(DOUT + row * stride_dout_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_g = tl.load(GATE + row * stride_gate_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_u = tl.load(UP + row * stride_up_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_a, b_da = _activation_and_grad(b_g, ACTIVATION)
    b_a = round_to(b_a, dtype).to(tl.float32)
    b_dact = round_to(b_do * b_u, dtype).to(tl.float32)  # HF's grad of act(gate), rounded
    # dgate/dup are fresh contiguous (rows, n_cols) buffers.
    o_out = row * n_cols + o_col
    tl.store(DUP + o_out, round_to(b_do * b_a, dtype), mask=m_col)
    tl.store(DGATE + o_out, round_to(b_dact * b_da, dtype), mask=m_col)


# ----------------------------------------------------------------------------------------------
# Launchers (tensors in, tensors out; no autograd)
# ----------------------------------------------------------------------------------------------


def _config(n_cols: int) -> tuple[int, int]:
    """Default (BLOCK, num_warps) for rows of n_cols elements: 8 elements per thread."""
    block = min(triton.next_power_of_2(n_cols), 2048)
    return block, max(1, block // 256)


def _launch(
    kernel,
    rows,
    n_strided,
    activation,
    long_indexing=None,
    block=None,
    num_warps=None,
    traced=False,
):
    """Launch a GLU kernel over the (R, C) row views ``rows`` (its pointer arguments): the first
    ``n_strided`` are passed with their row strides, the others are fresh contiguous buffers.
    ``long_indexing``/``block``/``num_warps``: private overrides for tests and benchmarks (None =
    chosen from the shapes); ``traced``: launch through ``launcher`` (inside the op)."""
    n_rows, n_cols = rows[0].shape
    default_block, default_warps = _config(n_cols)
    block, num_warps = block or default_block, num_warps or default_warps
    n_col_blocks = triton.cdiv(n_cols, block)
    if n_rows * n_col_blocks > INT32_LIMIT:
        raise ValueError(
            f"glu: {n_rows} rows x {n_col_blocks} column blocks exceed the launch grid limit 2^31-1"
        )
    if long_indexing is None:
        strides = [t.stride(0) for t in rows]
        long_indexing = _needs_long_indexing(n_rows, n_col_blocks * block, strides)
    kernel = launcher(kernel, rows[0]) if traced else kernel
    kernel[(n_rows * n_col_blocks,)](
        *rows, *(t.stride(0) for t in rows[:n_strided]), n_cols, n_col_blocks,
        ACTIVATION=activation, BLOCK=block, LONG_INDEXING=bool(long_indexing), num_warps=num_warps,
    )  # fmt: skip


def glu_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    **launch: Any,
) -> torch.Tensor:
    """out = round(act(gate)) * up as a fresh contiguous tensor of gate's shape. ``launch``:
    ``_launch``'s keywords (``long_indexing``, ``block``, ``num_warps``, ``traced``)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    rows = (_rows(gate), _rows(up), out.view(-1, gate.shape[-1]))
    _launch(_glu_fwd_kernel, rows, 3, activation, **launch)
    return out


def glu_backward(
    dout: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) as fresh contiguous tensors; the inputs are only read (``launch``: as in
    ``glu_forward``)."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty_like(dgate)
    if dgate.numel() == 0:
        return dgate, dup
    n_cols = gate.shape[-1]
    rows = (_rows(dout), _rows(gate), _rows(up), dgate.view(-1, n_cols), dup.view(-1, n_cols))
    _launch(_glu_bwd_kernel, rows, 3, activation, **launch)
    return dgate, dup


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.activation = activation
        ctx.save_for_backward(gate, up)  # inputs only: the activation is recomputed
        return glu_forward(gate, up, activation)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return first_two_grads(ctx, 3, lambda: glu_backward(dout, gate, up, ctx.activation))


# The registered ops (what torch.compile sees). Same kernels, same autograd contract.
@kernel_op("glu_fwd")
def _glu_fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return glu_forward(gate, up, activation, traced=True)


@kernel_op("glu_bwd")
def _glu_bwd_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return glu_backward(dout, gate, up, activation, traced=True)


def _glu_setup_context(ctx, inputs, output) -> None:
    gate, up, ctx.activation = inputs
    ctx.save_for_backward(gate, up)


def _glu_op_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    return first_two_grads(ctx, 3, lambda: _glu_bwd_op(dout, gate, up, ctx.activation))


_glu_fwd_op.register_autograd(_glu_op_backward, setup_context=_glu_setup_context)


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if compiling():
        return _glu_fwd_op(gate, up, activation)
    return _GLUFunction.apply(gate, up, activation)


def _check_inputs(fn: str, gate, up) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.dim() == 0:
            raise ValueError(f"{fn}: {name} must have at least 1 dimension, got a scalar")
        if t.device.type != "cuda" and not _INTERPRET:
            raise ValueError(
                f"{fn}: {name} must be on a CUDA device (or set TRITON_INTERPRET=1 before "
                f"importing hf_varlen for the CPU interpreter), got {t.device}"
            )
    if gate.shape != up.shape:
        raise ValueError(
            f"{fn}: gate and up must have the same shape, got {tuple(gate.shape)} and "
            f"{tuple(up.shape)}"
        )
    if gate.dtype != up.dtype:
        raise TypeError(f"{fn}: gate and up must share a dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(
            f"{fn}: gate and up must be on one device, got {gate.device} and {up.device}"
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` with HF's rounding order, differentiable in gate and up.

    Args:
        gate: (..., F) fp16/bf16/fp32, the gate projection (HF ``gate_proj(x)``). The last dim must
            be contiguous for a copy-free call; leading dims may be strided, e.g. ``h[..., :F]``
            of a fused (..., 2F) projection.
        up: (..., F), same shape, dtype and device (HF ``up_proj(x)``, or ``h[..., F:]``).

    Returns:
        (..., F) tensor of gate's dtype, equal to HF's ``nn.SiLU()(gate) * up`` within the numerics
        rule of hf_varlen/testing.py. Inputs are never modified; the backward pass recomputes silu(gate) and
        returns fresh gradient tensors.
    """
    _check_inputs("swiglu", gate, up)
    return _glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU: ``gelu(gate, approximate) * up`` with HF's rounding order (see :func:`swiglu`).

    Args:
        gate, up: as in :func:`swiglu`.
        approximate: ``"none"`` for the erf GELU (HF ``"gelu"``) or ``"tanh"`` for the tanh
            approximation (HF ``"gelu_pytorch_tanh"``, used by Gemma/Gemma2).
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    _check_inputs("geglu", gate, up)
    return _glu(gate, up, "gelu" if approximate == "none" else "gelu_tanh")
