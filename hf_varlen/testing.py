"""Numerics rule shared by the tests and the benchmarks' match columns.

The rule (from flash-attention's test-suite; see TESTING.md): for an output or gradient ``x`` that a
kernel computed in low precision,

    max|x - ref_hi| <= factor * max|ref_lo - ref_hi| + 2 * eps_rounding

where ``ref_hi`` is the reference computed in fp32/fp64, ``ref_lo`` the same reference computed in
the input dtype, and ``eps_rounding = max|(ref_hi + 0.3) - 0.3 - ref_hi|`` evaluated in that dtype.
``factor`` is 2 for outputs and 3 for gradients.
"""

from __future__ import annotations

import torch


def rounding_eps(ref_hi: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest rounding error of ``ref_hi`` values when stored in ``dtype`` (see module doc)."""
    x = ref_hi.detach().to(dtype)
    return ((x + 0.3) - 0.3 - x).abs().max().item() if x.numel() else 0.0


def numerics_error(
    x: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor, *, factor: float = 2.0
) -> tuple[bool, str]:
    """Apply the rule; returns (passed, message with both errors and the bound)."""
    if x.shape != ref_hi.shape or ref_lo.shape != ref_hi.shape:
        return (
            False,
            f"shape mismatch: x {tuple(x.shape)}, ref_hi {tuple(ref_hi.shape)}, ref_lo {tuple(ref_lo.shape)}",
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
    eps = rounding_eps(ref_hi.detach().cpu().float(), x.dtype)
    bound = factor * ref_err + 2 * eps
    msg = (
        f"max|x - ref_hi| = {err:.3e}; max|ref_lo - ref_hi| = {ref_err:.3e}; eps_rounding = {eps:.3e}; "
        f"bound = {factor:g}*{ref_err:.3e} + 2*{eps:.3e} = {bound:.3e}"
    )
    return err <= bound, msg


def assert_numerics(
    name: str, x: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor, *, factor: float = 2.0
) -> None:
    """Raise AssertionError naming ``name`` when the rule fails (outputs: factor 2, grads: 3)."""
    ok, msg = numerics_error(x, ref_hi, ref_lo, factor=factor)
    if not ok:
        raise AssertionError(f"{name}: {msg}")
