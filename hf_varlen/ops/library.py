"""The one ``torch.library`` namespace of hf_varlen's ops (torch only; no triton import).

``NAMESPACE`` is the top-level package name: ``"hf_varlen"`` (ops are ``torch.ops.hf_varlen.*``),
or, in the generated kernel-hub copy of ``ops/``, that copy's own versioned package name, so the two
copies never register the same op name (torch would destroy the first library's ops).
``qualname(name)``: ``"<NAMESPACE>::<name>"``.
``compiling()``: True while torch.compile / export traces (``common.tracing``, the one such test).
The public op functions call the registered ops only then; eager calls go straight to the
autograd.Function (see each op module).
``first_two_grads(ctx, n_inputs, compute)``: the backward's return value for an op whose first two
inputs are the differentiable ones, shared by its autograd.Function and its registered op.
"""

from __future__ import annotations

from .common import tracing

NAMESPACE = __name__.split(".")[0].lstrip("_") or "hf_varlen"


def qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def compiling() -> bool:
    return tracing()


def first_two_grads(ctx, n_inputs: int, compute):
    """(grad_0, grad_1, None, ...) for ``n_inputs`` inputs: ``compute()`` -> (grad_0, grad_1) runs
    only when input 0 or 1 needs a gradient, and each is returned only where it is needed."""
    need = ctx.needs_input_grad[:2]
    if not any(need):
        return (None,) * n_inputs
    grads = compute()
    return (*(g if n else None for g, n in zip(grads, need)), *(None,) * (n_inputs - 2))
