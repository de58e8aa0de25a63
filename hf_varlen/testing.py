"""Numerics rule shared by the tests and the benchmarks' match columns.

The rule (from flash-attention's test-suite, ``tests/test_flash_attn.py``): for an output or
gradient ``x`` that a kernel computed in low precision,

    max|x - ref_hi| <= factor * max|ref_lo - ref_hi| + 2 * max(eps_rounding, floor)

where ``ref_hi`` is the reference computed in fp32/fp64, ``ref_lo`` the same reference computed in
the input dtype, ``eps_rounding = max|(ref_hi + 0.3) - 0.3 - ref_hi|`` evaluated in that dtype, and
``floor = u * max|ref_hi|`` with ``u = finfo(dtype).eps / 2`` the dtype's unit roundoff (the largest
relative error of storing one value in it). ``factor`` is 2 for outputs and 3 for gradients.

Why the floor: when the two references agree exactly (``ref_lo == ref_hi``, e.g. an fp32 loss
whose fp64 value happens to be representable) and the ``+ 0.3`` probe rounds without error, the
first two terms are 0 and the rule would demand a bit-exact kernel. The floor allows what a single
rounding to ``dtype`` at the reference's magnitude can cost (``2 * floor`` >= 1 ulp there).

``dtype``: the precision the computation ran in, when that is not ``x``'s own dtype. Under
autocast (bf16 matmuls over fp32 weights) a loss or a parameter gradient comes back in fp32, but its
inputs were rounded to bf16: the rule's "input dtype" is bf16, and eps_rounding and the floor are
evaluated in it. Without that, a scalar such as a loss is held to fp32 rounding plus twice one
sample of the low-precision reference's error, which a second bf16 computation of the same value
exceeds by chance (two independent errors of one size differ by 2x about a third of the time).

For a reduction (``terms``: ``x`` is a sum or mean of that many rounded values, e.g. a loss over its
label tokens) the floor is ``(1 + ceil(log2(terms)))`` unit roundoffs at the reference's magnitude:
the error bound of pairwise summation (Higham, *Accuracy and Stability of Numerical Algorithms*,
section 4.2), the tree order GPU and Inductor reductions use. Two exact-agreeing references say
nothing about how a different summation order of the same terms rounds.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rounding_eps(ref_hi: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest rounding error of ``ref_hi`` values when stored in ``dtype`` (see module doc)."""
    x = ref_hi.detach().to(dtype)
    return ((x + 0.3) - 0.3 - x).abs().max().item() if x.numel() else 0.0


def rounding_floor(ref_hi: torch.Tensor, dtype: torch.dtype, terms: int = 1) -> float:
    """``u * max|ref_hi|``: one rounding to ``dtype`` at the reference's magnitude, times
    ``1 + ceil(log2(terms))`` for a reduction over ``terms`` values (module doc)."""
    if terms < 1:
        raise ValueError(f"terms: expected >= 1 (the values the result reduces), got {terms}")
    if not ref_hi.numel() or not dtype.is_floating_point:
        return 0.0
    roundings = 1 + math.ceil(math.log2(terms))
    return roundings * torch.finfo(dtype).eps / 2 * ref_hi.detach().double().abs().max().item()


def numerics_error(
    x: torch.Tensor,
    ref_hi: torch.Tensor,
    ref_lo: torch.Tensor,
    *,
    factor: float = 2.0,
    terms: int = 1,
    dtype: torch.dtype | None = None,
) -> tuple[bool, str]:
    """Apply the rule; returns (passed, message with both errors and the bound). ``terms``: how
    many rounded values ``x`` reduces (1: an elementwise result); ``dtype``: the precision ``x``
    was computed in (default ``x.dtype``; autocast: its dtype). See the module doc."""
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating dtype (the compute precision), got {dtype}")
    low = dtype or x.dtype
    if x.shape != ref_hi.shape or ref_lo.shape != ref_hi.shape:
        return (
            False,
            f"shape mismatch: x {tuple(x.shape)}, ref_hi {tuple(ref_hi.shape)}, "
            f"ref_lo {tuple(ref_lo.shape)}",
        )
    if x.numel() == 0:
        return True, "empty"
    xd, hi, lo = (t.detach().to("cpu", torch.float64) for t in (x, ref_hi, ref_lo))
    if not torch.isfinite(xd).all():
        return (
            False,
            f"non-finite values in result ({(~torch.isfinite(xd)).sum().item()} of {xd.numel()})",
        )
    err = (xd - hi).abs().max().item()
    ref_err = (lo - hi).abs().max().item()
    eps = rounding_eps(ref_hi.detach().cpu().float(), low)
    floor = rounding_floor(hi, low, terms)
    bound = factor * ref_err + 2 * max(eps, floor)
    msg = (
        f"max|x - ref_hi| = {err:.3e}; max|ref_lo - ref_hi| = {ref_err:.3e}; "
        f"eps_rounding = {eps:.3e}; floor = {floor:.3e}{f' ({terms} terms)' if terms > 1 else ''}"
        f"{f' (in {low})' if low != x.dtype else ''}; "
        f"bound = {factor:g}*{ref_err:.3e} + 2*max({eps:.3e}, {floor:.3e}) = {bound:.3e}"
    )
    return err <= bound, msg


def assert_numerics(
    name: str,
    x: torch.Tensor,
    ref_hi: torch.Tensor,
    ref_lo: torch.Tensor,
    **rule: Any,
) -> None:
    """Raise AssertionError naming ``name`` when the rule fails. ``rule``: ``numerics_error``'s
    keywords, ``factor`` (outputs: 2, the default; grads: 3), ``terms`` (the values a reduction
    such as a loss sums) and ``dtype`` (the precision it was computed in, default ``x.dtype``);
    an unknown keyword raises TypeError. See the module doc."""
    ok, msg = numerics_error(x, ref_hi, ref_lo, **rule)
    if not ok:
        raise AssertionError(f"{name}: {msg}")
