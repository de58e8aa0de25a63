"""The numerics rule of hf_varlen/testing.py: its floor when both references agree exactly."""

from __future__ import annotations

import torch

from hf_varlen.testing import numerics_error, rounding_eps, rounding_floor


def _next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("inf")))


def test_floor_when_references_agree_exactly():
    # The GPU failure of test_kernelized_model_matches_original[cuda-gemma2-fp32]: an fp32 loss
    # 1 ulp from references that agree exactly, at a value the +0.3 probe rounds without error.
    ref = torch.tensor(4.887457370758057, dtype=torch.float32)
    assert rounding_eps(ref, torch.float32) == 0.0
    x = _next_up(ref)
    ok, msg = numerics_error(x, ref.double(), ref.clone())
    assert ok, msg
    assert "floor = " in msg
    assert rounding_floor(ref, torch.float32) == torch.finfo(torch.float32).eps / 2 * float(ref)


def test_floor_scales_with_magnitude_and_dtype():
    ref = torch.tensor([0.0, -3.0, 2.0], dtype=torch.float64)
    assert rounding_floor(ref, torch.bfloat16) == torch.finfo(torch.bfloat16).eps / 2 * 3.0
    assert rounding_floor(torch.zeros(3), torch.float32) == 0.0
    assert rounding_floor(torch.empty(0), torch.float32) == 0.0


def test_floor_still_rejects_more_than_an_ulp_or_two():
    ref = torch.tensor([4.887457370758057], dtype=torch.float32)
    x = ref.clone()
    for _ in range(3):  # three ulps away at the reference's magnitude
        x = _next_up(x)
    ok, msg = numerics_error(x, ref.double(), ref.clone())
    assert not ok, msg


def test_all_zero_reference_has_no_floor():
    ref = torch.zeros(4)
    ok, _ = numerics_error(torch.zeros(4), ref.double(), ref)
    assert ok
    ok, msg = numerics_error(torch.full((4,), 1e-7), ref.double(), ref)
    assert not ok, msg


def test_reduction_floor_grows_with_log2_of_the_terms():
    # The GPU failure of test_kernelized_model_with_fused_loss_compiles_inductor[gemma2-fp32]:
    # Inductor's reduction order puts a mean over ~100 label tokens 2 ulps from references that
    # agree exactly; pairwise summation of n terms may cost 1 + ceil(log2 n) roundings.
    ref = torch.tensor(4.887457370758057, dtype=torch.float32)
    x = _next_up(_next_up(ref))
    assert not numerics_error(x, ref.double(), ref.clone())[0]
    ok, msg = numerics_error(x, ref.double(), ref.clone(), terms=100)
    assert ok and "(100 terms)" in msg, msg
    u = torch.finfo(torch.float32).eps / 2
    assert rounding_floor(ref, torch.float32, terms=100) == 8 * u * float(ref)  # 1 + ceil(6.64)
    assert rounding_floor(ref, torch.float32, terms=1) == u * float(ref)
    far = ref + 20 * (_next_up(ref) - ref)  # 20 ulps is more than 100 terms' rounding
    assert not numerics_error(far, ref.double(), ref.clone(), terms=100)[0]


def test_reduction_terms_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="terms: expected >= 1"):
        rounding_floor(torch.ones(1), torch.float32, terms=0)


def test_compute_dtype_sets_eps_and_floor_for_an_autocast_result():
    """The GPU failure of test_fused_loss_matches_sft_trainer_bf16[bfd]: an fp32 loss of a bf16
    autocast run, 2.06x the bf16 reference's error, was held to fp32 rounding."""
    import pytest

    hi = torch.tensor(10.4210 - 0.0404, dtype=torch.float64)
    lo = (hi + 0.01959).float()
    x = torch.tensor(10.4210, dtype=torch.float32)
    ok, msg = numerics_error(x, hi, lo)
    assert not ok and "(in " not in msg  # fp32 eps: 2 x the one reference error is all it gets
    ok, msg = numerics_error(x, hi, lo, dtype=torch.bfloat16)
    assert ok and "(in torch.bfloat16)" in msg, msg
    # one bf16 rounding at 10.4 (spacing 1/16) is ~0.04: the loss's own storage error in bf16
    assert rounding_floor(hi, torch.bfloat16) == pytest.approx(2**-8 * float(hi))
    # Still a real bound: ten bf16 spacings off fails.
    assert not numerics_error(x + 0.625, hi, lo, dtype=torch.bfloat16)[0]
    with pytest.raises(ValueError, match="dtype: expected a floating dtype"):
        numerics_error(x, hi, lo, dtype=torch.int32)
