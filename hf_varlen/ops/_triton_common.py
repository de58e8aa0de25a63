"""Small pieces shared by the Triton kernels in hf_varlen/ops (torch + triton only; host-side
helpers that need no triton live in ``common.py``).

``INTERPRET``: kernels run under the numpy interpreter ($TRITON_INTERPRET, read once at import
with ``common.env_flag``: 1/true/yes/on, as triton reads it).
``as_rows`` / ``rows_need_int64``: the (R, C) row view the row-wise kernels (GLU, RMSNorm) launch
over, and whether its offsets ``row * stride + col`` can pass int32 (their LONG_INDEXING switch).
``round_to``: cast fp32 to a storage dtype, rounding to nearest even as a GPU cast does. Triton 3.9's
interpreter truncates fp32 -> bf16 instead; only there is the rounding done by hand, so CPU tests
check the GPU's rounding. On a GPU the branch is compiled out.
``kernel_op(name, mutates_args)`` / ``launcher(kernel, like)``: how an op module registers a
function that launches Triton kernels as ``torch.ops.<NAMESPACE>.<name>``. On a GPU it is a
``triton_op`` whose launches go through ``wrap_triton``, so Inductor traces (and may fuse around)
the kernels. Under the interpreter ``wrap_triton`` cannot capture an interpreted kernel (it hands
the kernel back and would run it on fake tensors), so the function is an opaque ``custom_op``
whose fake implementation is the same function with its launches skipped on fake tensors.

Kernels referenced from a kernel are called by their own ``__name__`` (never an alias): Inductor
re-generates a traced kernel's source from each helper's ``src`` under the name it is called by.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import env_flag
from .library import qualname

INTERPRET = env_flag("TRITON_INTERPRET")
INT32_LIMIT = 2**31 - 1

_RTNE_BF16_BY_HAND = tl.constexpr(INTERPRET)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """(R, C) view of a (..., C) tensor with unit column stride; copies only when it must."""
    n_cols = t.shape[-1]
    if t.stride(-1) != 1 and n_cols > 1:
        t = t.contiguous()
    try:
        return t.view(-1, n_cols)
    except RuntimeError:  # leading dims that cannot be merged into one row stride
        return t.reshape(-1, n_cols)


def rows_need_int64(n_rows: int, padded_cols: int, row_strides: list[int]) -> bool:
    """True when some offset row * stride + col can pass int32 (masked lanes of the last block
    included, hence ``padded_cols``)."""
    return any((n_rows - 1) * s + padded_cols - 1 > INT32_LIMIT for s in row_strides)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast fp32 x to dtype, rounding to nearest even (what a cast does on the GPU)."""
    if _RTNE_BF16_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


class _NoLaunch:
    """``kernel[grid](...)`` that does nothing: the fake implementation's launches."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


_NO_LAUNCH = _NoLaunch()


def launcher(kernel, like: torch.Tensor):
    """``kernel`` as launched inside a ``kernel_op`` function: ``wrap_triton(kernel)`` on a GPU
    (a no-op wrapper outside tracing), the interpreted kernel itself under the interpreter, or a
    launcher that does nothing when ``like`` is a fake tensor (shape propagation only)."""
    if INTERPRET:
        return _NO_LAUNCH if _is_fake(like) else kernel
    return torch.library.wrap_triton(kernel)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def kernel_op(name: str, *, mutates_args=()):
    """Decorator: register ``fn`` (annotated; launches through :func:`launcher`) as the op
    ``<NAMESPACE>::<name>`` and return its ``CustomOpDef`` (callable, ``register_autograd``)."""

    def register(fn):
        if INTERPRET:
            op = torch.library.custom_op(qualname(name), fn, mutates_args=mutates_args)
            op.register_fake(fn)
            return op
        return torch.library.triton_op(qualname(name), fn, mutates_args=mutates_args)

    return register
