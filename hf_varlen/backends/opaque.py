"""Backends torch.compile cannot trace, run as one opaque ``torch.library`` op under compile.

``sdpa``, ``reference`` and ``xformers`` read the document offsets on the host (a Python loop over
documents, or a bias built from Python lists); ``fa4`` JIT-compiles CuTe kernels from Python. Traced
directly, each would be a graph break (and a host sync). While compiling, ``varlen_attention``
calls them through

    torch.ops.hf_varlen.opaque_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, backend, left, right, softmax_scale, softcap, deterministic, sinks=None)
        -> out
    torch.ops.hf_varlen.opaque_attention_backward(grad_out, q, k, v, <same>)
        -> (dq, dk, dv, dsinks)   (dsinks: (H_q,), or an empty tensor without sinks)

Shapes: q (T_q, H_q, D), k (T_k, H_kv, D), v (T_k, H_kv, D_v), out (T_q, H_q, D_v). The forward runs
the backend's own function on the real tensors (same numbers as eager); the backward recomputes that
forward with autograd on and differentiates it (the backend's own backward; one extra forward, paid
only under compile). The graph sees one node per layer with a fake implementation of the right
shape, and the host read happens at run time, where it belongs. Dropout is refused under compile:
the recomputed forward would draw a different mask (use dropout 0, or a traceable GPU backend).
"""

import torch
from torch import Tensor

from ..metadata import VarlenMetadata
from ..ops.library import qualname
from .params import AttentionParams

FORWARD = qualname("opaque_attention")
BACKWARD = qualname("opaque_attention_backward")


def _call(
    q, k, v, cu_q, cu_k, max_q, max_k, backend, left, right, scale, softcap, deterministic, sinks
):
    from .registry import get_spec

    metadata = VarlenMetadata(cu_q, cu_k, max_q, max_k)
    params = AttentionParams(
        window=(left, right), softmax_scale=scale, softcap=softcap, deterministic=deterministic,
        sinks=sinks,
    )  # fmt: skip
    return get_spec(backend).fn(q, k, v, metadata, params)


@torch.library.custom_op(FORWARD, mutates_args=())
def opaque_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    backend: str,
    left: int,
    right: int,
    softmax_scale: float,
    softcap: float,
    deterministic: bool,
    sinks: Tensor | None = None,
) -> Tensor:
    args = (max_seqlen_q, max_seqlen_k, backend, left, right, softmax_scale, softcap, deterministic)
    out = _call(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, sinks)
    # a custom op may not return a view of its inputs (a backend may slice or view them)
    return out.clone() if out._base is not None else out


@opaque_attention.register_fake
def _(q, k, v, *args):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


def _autograd_enabled():
    """Autograd inside an op implementation (which runs below the autograd dispatch keys)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(include, exclude)


@torch.library.custom_op(BACKWARD, mutates_args=())
def opaque_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    backend: str,
    left: int,
    right: int,
    softmax_scale: float,
    softcap: float,
    deterministic: bool,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    args = (max_seqlen_q, max_seqlen_k, backend, left, right, softmax_scale, softcap, deterministic)
    with _autograd_enabled(), torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        if sinks is not None:
            inputs.append(sinks.detach().requires_grad_())
        live_sinks = inputs[3] if sinks is not None else None
        out = _call(*inputs[:3], cu_seqlens_q, cu_seqlens_k, *args, live_sinks)
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, inputs)]
    if sinks is None:
        grads.append(q.new_empty(0))
    return tuple(grads)


@opaque_attention_backward.register_fake
def _(grad_out, q, k, v, *args):
    sinks = args[-1] if len(args) == 11 else None
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return (*grads, q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args, sinks = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, sinks)
    ctx.args = args


def _backward(ctx, grad_out):
    q, k, v, cu_q, cu_k, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = opaque_attention_backward(grad_out, q, k, v, cu_q, cu_k, *ctx.args, sinks)
    return (dq, dk, dv) + (None,) * 10 + (None if sinks is None else dsinks,)


opaque_attention.register_autograd(_backward, setup_context=_setup_context)


def call_opaque(name: str, q, k, v, metadata: VarlenMetadata, params: AttentionParams) -> Tensor:
    """``backend(q, k, v, metadata, params)`` through the opaque op (for use while compiling)."""
    if params.dropout_p > 0:
        raise ValueError(
            f"backend={name!r} runs as an opaque op under torch.compile, whose backward recomputes "
            f"the forward, so dropout_p={params.dropout_p} would get a different mask there; "
            "train with attention dropout 0 under torch.compile, or use a GPU backend torch.compile "
            "traces (triton, flash_attn, torch)"
        )
    left, right = params.window
    return opaque_attention(
        q, k, v, metadata.cu_seqlens_q, metadata.cu_seqlens_k, metadata.max_seqlen_q,
        metadata.max_seqlen_k, name, left, right, params.softmax_scale, params.softcap,
        params.deterministic, params.sinks,
    )  # fmt: skip
