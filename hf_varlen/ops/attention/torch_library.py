"""The Triton varlen attention as ``torch.library`` ops (what torch.compile calls).

    torch.ops.hf_varlen.triton_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
        left, right, softcap, deterministic, sinks=None) -> (out (T_q, H_q, D), lse (H_q, T_q) fp32)
        (with sinks (H_q,): out and lse include them, launch.apply_sinks)
    torch.ops.hf_varlen.triton_attention_backward(do, q, k, v, out, lse, cu_seqlens_q,
        cu_seqlens_k, softmax_scale, left, right, softcap, deterministic) -> (dq, dk, dv)

Semantics and argument meaning are ``function.triton_attention``'s (validated input; ``left`` /
``right`` with causality folded in). q, k, v need a unit last stride (the caller ensures it).

On a GPU both are ``triton_op``s whose launches go through ``wrap_triton``: Inductor traces into
them (the tile plan is plain torch ops, deduplicated across layers by the compiler's CSE) and sees
the kernels; the fake implementation is the function itself run on fake tensors. Under
TRITON_INTERPRET=1 (CPU tests) torch cannot trace an interpreted kernel, so the same functions are
registered as opaque ``custom_op``s with an explicit fake. Autograd: ``register_autograd`` on the
forward op, whose backward calls the backward op (``setup_context`` saves q, k, v, out, lse and
the offsets; the plan is rebuilt from the offsets there, so no Python object crosses the graph).

Eager calls do not come here (function.triton_attention calls the autograd.Function directly):
the dispatcher round trip of a Python op costs tens of microseconds per layer, which the
host-bound step of a small model would feel; the kernels and numbers are the same.
"""

import torch
from torch import Tensor

from .._triton_common import INTERPRET
from ..library import qualname
from .launch import apply_sinks, backward_launch, forward_launch, sinks_grad
from .schedule import get_plan

FORWARD = qualname("triton_attention")
BACKWARD = qualname("triton_attention_backward")
_TRACEABLE = not INTERPRET  # wrap_triton only for compiled (not interpreted) kernels


def _forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    softmax_scale: float, left: int, right: int, softcap: float, deterministic: bool,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    plan = get_plan(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], left, right)
    out, lse = forward_launch(q, k, v, plan, softmax_scale, softcap, traceable=_TRACEABLE)
    return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)


def _backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, softmax_scale: float, left: int, right: int, softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    plan = get_plan(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], left, right)
    return backward_launch(
        do, q, k, v, out, lse, plan, softmax_scale, softcap, deterministic, traceable=_TRACEABLE
    )


if _TRACEABLE:
    forward_op = torch.library.triton_op(FORWARD, _forward, mutates_args=())
    backward_op = torch.library.triton_op(BACKWARD, _backward, mutates_args=())
else:
    forward_op = torch.library.custom_op(FORWARD, _forward, mutates_args=())
    backward_op = torch.library.custom_op(BACKWARD, _backward, mutates_args=())

    @forward_op.register_fake
    def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return torch.empty_like(q, memory_format=torch.contiguous_format), lse

    @backward_op.register_fake
    def _backward_fake(do, q, k, v, *args):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
    ctx.args = args  # softmax_scale, left, right, softcap, deterministic


def _autograd_backward(ctx, do, _dlse):
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    if do.stride(-1) != 1:
        do = do.contiguous()
    # out / lse already carry the sinks: the kernels need nothing more (launch.apply_sinks)
    dq, dk, dv = backward_op(do, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    dsinks = None if sinks is None else sinks_grad(do, out, lse, sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, dsinks


forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_attention_op(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, softcap,
                        deterministic, sinks=None):  # fmt: skip
    """(out, lse) through the registered forward op (differentiable via register_autograd)."""
    return forward_op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, float(softmax_scale), int(left), int(right),
        float(softcap), bool(deterministic), sinks,
    )  # fmt: skip
