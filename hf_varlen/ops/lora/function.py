"""LoRA projection: ``base(x) + scale * B(A(x))`` as one op with a hand-written backward.

Math (rows of x; ``s`` = scale = lora_alpha / r; no dropout):

    h  = x @ A^T                            (N, r)   kept for the backward
    y  = x @ W^T + bias + s * (h @ B^T)     (N, O)   the adapter term is added in place (addmm_)

    backward, dy (N, O):
    g  = s * (dy @ B)                       (N, r)
    dx = dy @ W + g @ A                     (N, K)   one addmm_ into dy @ W
    dA = g^T @ x                            (r, K)
    dB = s * (dy^T @ h)                     (O, r)
    dW = dy^T @ x, dbias = sum_rows(dy)     only when the base weight / bias train (rare in LoRA)

Shapes: x (..., K) with any leading shape; weight W (O, K); bias (O,) or None; lora_a A (r, K);
lora_b B (O, r); output (..., O). All five tensors share one dtype (fp16/bf16/fp32) and device.

What it saves for the backward: x (which the base matmul needs anyway when anything upstream
trains, and A's gradient needs in every LoRA implementation), the rank-r intermediate h, and the
weights themselves (parameters, not copies): nothing of size N x O. Against peft's separate modules
(``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``) it saves two N x O elementwise kernels
in the forward (the scale and the add are folded into one addmm_) and one N x O scale plus one
N x K add in the backward, and no fp32 copy of x when the adapters are fp32 in a bf16 model (peft
casts x to the adapter dtype; this op computes the adapter branch in the activation dtype, as
autocast would).

Dispatch: ``torch.ops.hf_varlen.lora_linear`` is the registered op (an opaque ``custom_op``
returning (y, h); autograd through ``register_autograd``, whose backward is plain torch ops that
torch.compile traces into the backward graph). ``lora_linear`` calls it only while torch.compile
traces (``library.compiling()``); eager calls use the ``autograd.Function`` directly, which skips
the dispatcher's ~20 us host time per call. Both run the same matmuls. Torch only: no triton.
"""

from __future__ import annotations

import torch

from ..library import compiling, qualname

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------
# Forward / backward on 2-D rows (no autograd)
# ----------------------------------------------------------------------------------------------


def _forward(x, weight, bias, lora_a, lora_b, scale: float):
    """(y, h) for rows x (N, K)."""
    h = torch.mm(x, lora_a.t())
    y = torch.nn.functional.linear(x, weight, bias)
    y.addmm_(h, lora_b.t(), alpha=scale)
    return y, h


def _backward(dy, x, h, weight, lora_a, lora_b, scale: float, needs):
    """Gradients (dx, dW, dbias, dA, dB) for rows; None where ``needs`` says not needed."""
    need_x, need_w, need_bias, need_a, need_b = needs
    dy = dy.contiguous()
    dx = dw = dbias = da = db = None
    if need_x or need_a:
        g = torch.mm(dy, lora_b).mul_(scale)  # (N, r)
        if need_x:
            dx = torch.mm(dy, weight).addmm_(g, lora_a)
        if need_a:
            da = torch.mm(g.t(), x)
    if need_b:
        db = torch.mm(dy.t(), h).mul_(scale)
    if need_w:
        dw = torch.mm(dy.t(), x)
    if need_bias:
        dbias = dy.sum(0)
    return dx, dw, dbias, da, db


# ----------------------------------------------------------------------------------------------
# Autograd (eager)
# ----------------------------------------------------------------------------------------------


class _LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale):
        y, h = _forward(x, weight, bias, lora_a, lora_b, scale)
        ctx.scale = scale
        ctx.save_for_backward(x, h, weight, lora_a, lora_b)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, weight, lora_a, lora_b = ctx.saved_tensors
        grads = _backward(dy, x, h, weight, lora_a, lora_b, ctx.scale, ctx.needs_input_grad[:5])
        return (*grads, None)


# ----------------------------------------------------------------------------------------------
# Registered op (what torch.compile sees)
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op(qualname("lora_linear"), mutates_args=())
def _lora_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
    lora_b: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _forward(x, weight, bias, lora_a, lora_b, scale)


@_lora_linear_op.register_fake
def _lora_linear_fake(x, weight, bias, lora_a, lora_b, scale):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], lora_a.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _bias, lora_a, lora_b, ctx.scale = inputs
    ctx.mark_non_differentiable(output[1])  # h is returned only to be saved
    ctx.save_for_backward(x, output[1], weight, lora_a, lora_b)


def _op_backward(ctx, dy, _dh):
    x, h, weight, lora_a, lora_b = ctx.saved_tensors
    grads = _backward(dy, x, h, weight, lora_a, lora_b, ctx.scale, ctx.needs_input_grad[:5])
    return (*grads, None)


_lora_linear_op.register_autograd(_op_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def _check(x, weight, bias, lora_a, lora_b, scale) -> None:
    named = (("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b))
    if bias is not None:
        named += (("bias", bias),)
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lora_linear: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"lora_linear: {name} must be a floating-point tensor, got {t.dtype}")
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(
                f"lora_linear: {name} must have x's dtype and device ({x.dtype}, {x.device}), "
                f"got {t.dtype} on {t.device}; cast the adapter weights (or run under autocast)"
            )
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"lora_linear: scale must be a Python float, got {type(scale).__name__}")
    if x.dim() < 1 or weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise ValueError(
            "lora_linear: expected x (..., K), weight (O, K), lora_a (r, K), lora_b (O, r); got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(lora_a.shape)}, {tuple(lora_b.shape)}"
        )
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    if (
        x.shape[-1] != in_features
        or tuple(lora_a.shape) != (rank, in_features)
        or tuple(lora_b.shape) != (out_features, rank)
        or (bias is not None and tuple(bias.shape) != (out_features,))
    ):
        raise ValueError(
            f"lora_linear: shapes do not chain: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"bias {None if bias is None else tuple(bias.shape)}, lora_a {tuple(lora_a.shape)}, "
            f"lora_b {tuple(lora_b.shape)} (expected x (..., K), weight (O, K), bias (O,), "
            "lora_a (r, K), lora_b (O, r))"
        )


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scale * F.linear(F.linear(x, lora_a), lora_b)``, one op.

    Args:
        x: (..., K) activations.
        weight: (O, K) base weight (frozen in LoRA; its gradient is computed only if it trains).
        bias: (O,) or None.
        lora_a: (r, K) the adapter's A (peft ``lora_A[name].weight``).
        lora_b: (O, r) the adapter's B (peft ``lora_B[name].weight``).
        scale: the adapter scale (peft ``scaling[name]``, lora_alpha / r).

    All tensors share x's dtype and device (cast the adapters first; under autocast, cast to the
    autocast dtype). Returns (..., O) in x's dtype, equal to the reference
    (``hf_varlen.reference.lora.lora_linear_reference``) within the numerics rule; the backward
    keeps x and the (N, r) intermediate only. Inputs are never modified.
    """
    _check(x, weight, bias, lora_a, lora_b, scale)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if compiling():
        y = _lora_linear_op(rows, weight, bias, lora_a, lora_b, float(scale))[0]
    else:
        y = _LoRALinearFunction.apply(rows, weight, bias, lora_a, lora_b, float(scale))
    return y.view(*lead, weight.shape[0])
