"""RMSNorm kernels (Llama and Gemma styles) against the HF-math reference."""

from __future__ import annotations

import pytest
import torch
from launch_spy import LaunchSpy

from hf_varlen.ops.rmsnorm import function as rmsnorm
from hf_varlen.ops.rmsnorm import rms_norm
from hf_varlen.reference.rmsnorm import rms_norm_reference
from hf_varlen.testing import assert_numerics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STYLES = {"llama": False, "gemma": True}


def _inputs(shape, dtype, w_dtype, unit_offset, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2).to(DEVICE, dtype)
    w = torch.randn(shape[-1], generator=gen) * 0.5 + (0.0 if unit_offset else 1.0)
    dy = torch.randn(shape, generator=gen)
    out_dtype = dtype if unit_offset else torch.promote_types(dtype, w_dtype)
    return x, w.to(DEVICE, w_dtype), dy.to(DEVICE, out_dtype)


def _check(x, w, dy, unit_offset, eps=1e-6, tag=""):
    """Kernel y, dx, dw vs the reference in fp64 (hi) and in the input dtypes (lo)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = rms_norm(x, w, eps, add_unit_offset=unit_offset)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    refs = {}
    for key, x_dt, w_dt in (("hi", torch.float64, torch.float64), ("lo", x.dtype, w.dtype)):
        xr = x.detach().to(x_dt).requires_grad_()
        wr = w.detach().to(w_dt).requires_grad_()
        o = rms_norm_reference(xr, wr, eps, add_unit_offset=unit_offset)
        refs[key] = (o, *torch.autograd.grad(o, (xr, wr), dy.to(o.dtype)))
    assert y.dtype == refs["lo"][0].dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert_numerics(f"{tag} y", y, refs["hi"][0], refs["lo"][0])
    assert_numerics(f"{tag} dx", dx, refs["hi"][1], refs["lo"][1], factor=3.0)
    assert_numerics(f"{tag} dw", dw, refs["hi"][2], refs["lo"][2], factor=3.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", STYLES)
def test_matches_reference(style, dtype):
    unit = STYLES[style]
    # 13 rows > the interpreter's 4 backward programs: the dweight row loop runs several times
    x, w, dy = _inputs((13, 96), dtype, dtype, unit)
    _check(x, w, dy, unit, tag=f"{style} {dtype}")


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("style", STYLES)
def test_fewer_rows_than_backward_programs(style, rows):
    """The backward grid is a constant of the device (4 programs in the interpreter, 528 on an
    H200 at H = 2048), never min(rows, programs), which would guard on the token count under
    torch.compile: programs without a row load nothing and add a zero partial row to dweight."""
    unit = STYLES[style]
    x, w, dy = _inputs((rows, 96), torch.float32, torch.float32, unit, seed=rows)
    _check(x, w, dy, unit, tag=f"{style} rows={rows}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style", STYLES)
def test_fp32_weight_with_low_precision_input(style, dtype):
    """Mixed precision: fp32 master weight; Llama's output is then fp32 (HF type promotion)."""
    unit = STYLES[style]
    x, w, dy = _inputs((2, 5, 64), dtype, torch.float32, unit)
    _check(x, w, dy, unit, eps=1e-5, tag=f"{style} {dtype} fp32 weight")


@pytest.mark.parametrize("style", STYLES)
def test_reference_is_hf_module(style):
    """The reference equals transformers' LlamaRMSNorm / Gemma2RMSNorm bit for bit."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    unit = STYLES[style]
    x, w, _ = _inputs((3, 64), torch.bfloat16, torch.bfloat16, unit)
    module = (Gemma2RMSNorm if unit else LlamaRMSNorm)(64, eps=1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
        assert torch.equal(module(x), rms_norm_reference(x, w, 1e-6, add_unit_offset=unit))


@pytest.mark.parametrize("style", STYLES)
def test_kernel_matches_hf_module_bf16(style):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    unit = STYLES[style]
    x, w, _ = _inputs((6, 80), torch.bfloat16, torch.bfloat16, unit)
    module = (Gemma2RMSNorm if unit else LlamaRMSNorm)(80, eps=1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
        hi = rms_norm_reference(x.double(), w.double(), 1e-6, add_unit_offset=unit)
        assert_numerics(style, rms_norm(x, w, 1e-6, add_unit_offset=unit), hi, module(x))


@pytest.mark.parametrize("layout", ["row_strided", "unmergeable", "transposed"])
def test_strided_inputs(layout):
    gen = torch.Generator().manual_seed(3)
    base = (torch.randn(4, 6, 2 * 48, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    if layout == "row_strided":  # rows of 48 inside rows of 96
        x = base[..., :48]
    elif layout == "unmergeable":  # leading dims that cannot share one row stride (a copy)
        x = base[:, :3, 48:]
    else:  # non-contiguous last dim (a copy)
        x = base[:, 0, :48].transpose(0, 1)
    w = torch.randn(x.shape[-1], generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(x.shape[::-1], generator=gen).to(DEVICE, torch.bfloat16).transpose(0, -1)
    assert not dy.is_contiguous()
    _check(x, w, dy, False, tag=layout)


def test_row_strided_read_in_place(monkeypatch):
    spy = LaunchSpy(rmsnorm._rms_norm_fwd_kernel)
    monkeypatch.setattr(rmsnorm, "_rms_norm_fwd_kernel", spy)
    base = torch.randn(5, 128, device=DEVICE)
    rms_norm(base[:, :64], torch.ones(64, device=DEVICE))
    (x2, *_), kwargs = spy.launches[0]
    assert x2.data_ptr() == base.data_ptr() and x2.stride(0) == 128
    assert kwargs["LONG_INDEXING"] is False


@pytest.mark.parametrize("style", STYLES)
def test_inputs_left_bit_identical(style):
    unit = STYLES[style]
    x, w, dy = _inputs((7, 64), torch.bfloat16, torch.bfloat16, unit)
    x.requires_grad_()
    w.requires_grad_()
    copies = [t.detach().clone() for t in (x, w, dy)]
    torch.autograd.grad(rms_norm(x, w, add_unit_offset=unit), (x, w), dy)
    for t, c in zip((x, w, dy), copies):
        assert torch.equal(t.detach(), c)


def test_strided_weight():
    x, w, dy = _inputs((4, 32), torch.float32, torch.float32, False)
    w_strided = torch.stack([w, torch.full_like(w, float("nan"))], dim=1)[:, 0]
    assert w_strided.stride(0) == 2
    _check(x, w_strided, dy, False, tag="strided weight")


def test_only_requested_gradients():
    x, w, dy = _inputs((5, 32), torch.float32, torch.float32, False)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(x, w), x, dy)
    xr = x.detach().requires_grad_()
    torch.testing.assert_close(dx, torch.autograd.grad(rms_norm_reference(xr, w), xr, dy)[0])


def test_empty_input():
    x = torch.empty(0, 32, device=DEVICE, requires_grad=True)
    w = torch.ones(32, device=DEVICE, requires_grad=True)
    y = rms_norm(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert y.shape == dx.shape == (0, 32) and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("style", STYLES)
def test_long_path_equals_int32_path(style):
    unit = STYLES[style]
    x, w, dy = _inputs((9, 40), torch.bfloat16, torch.bfloat16, unit)
    y32, r32 = rmsnorm.rms_norm_forward(x, w, 1e-6, unit, long_indexing=False)
    y64, r64 = rmsnorm.rms_norm_forward(x, w, 1e-6, unit, long_indexing=True)
    assert torch.equal(y32, y64) and torch.equal(r32, r64)
    g32 = rmsnorm.rms_norm_backward(dy, x, w, r32, unit, long_indexing=False)
    g64 = rmsnorm.rms_norm_backward(dy, x, w, r32, unit, long_indexing=True)
    assert all(torch.equal(a, b) for a, b in zip(g32, g64))


def test_long_indexing_threshold():
    assert not rmsnorm._needs_long_indexing(262_144, 4096, [4096])
    assert not rmsnorm._needs_long_indexing(524_288, 4096, [4096])  # last offset 2^31 - 1
    assert rmsnorm._needs_long_indexing(524_289, 4096, [4096])
    assert rmsnorm._needs_long_indexing(262_145, 4096, [8192])  # rows strided inside 2H


def test_bad_inputs_raise_before_launch():
    x = torch.randn(3, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must have shape \(16,\).*got \(8,\)"):
        rms_norm(x, w[:8])
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, w[None])
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        rms_norm(x.long(), w)
    with pytest.raises(TypeError, match="torch.Tensor"):
        rms_norm(x, w.tolist())
    with pytest.raises(ValueError, match="eps must be a float >= 0, got -1.0"):
        rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="last dim of size >= 1"):
        rms_norm(x[0, 0], w[:1])
    with pytest.raises(ValueError, match="last dim of size >= 1"):
        rms_norm(x[:, :0], w[:0])
    with pytest.raises(ValueError, match="one device"):
        rms_norm(x, torch.ones(16, device="meta"))
    with pytest.raises(ValueError, match="hidden size must be <= 65536"):
        rms_norm(torch.empty(1, 65537, device="meta"), torch.empty(65537, device="meta"))
    # the process is still healthy after the errors
    torch.testing.assert_close(rms_norm(x, w), rms_norm_reference(x, w))


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("style", STYLES)
def test_bf16_numerics_gpu(style):
    unit = STYLES[style]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 4096, device="cuda", generator=gen).mul_(2).bfloat16()
    w = (torch.randn(4096, device="cuda", generator=gen) * 0.5 + (0 if unit else 1)).bfloat16()
    dy = torch.randn(8192, 4096, device="cuda", generator=gen).bfloat16()
    _check(x, w, dy, unit, tag=f"{style} cuda bf16")
    _check(x[:, :2048], w[:2048], dy[:, :2048], unit, tag=f"{style} cuda bf16 row-strided")


@pytest.mark.gpu
@pytest.mark.big_memory
def test_past_int32_elements_gpu(monkeypatch):
    """x (524416, 4096) bf16 > 2^31 elements; dy is zero outside the checked row slices, so the
    reference dweight over those slices is the exact target for the full reduction."""
    spy = LaunchSpy(rmsnorm._rms_norm_fwd_kernel)
    monkeypatch.setattr(rmsnorm, "_rms_norm_fwd_kernel", spy)
    n_tok, hidden = 524_416, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_tok, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(hidden, device="cuda", generator=gen) * 0.5 + 1).bfloat16()
    edge = 2**31 // hidden
    slices = [slice(0, 64), slice(edge - 32, edge + 32), slice(n_tok - 64, n_tok)]
    dy = torch.zeros_like(x)
    for sl in slices:
        dy[sl] = torch.randn(64, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    x.requires_grad_()
    w.requires_grad_()
    y = rms_norm(x, w)
    assert spy.launches[0][1]["LONG_INDEXING"] is True
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xs, dys = torch.cat([x.detach()[sl] for sl in slices]), torch.cat([dy[sl] for sl in slices])
    refs = {}
    for key, dtype in (("hi", torch.float64), ("lo", torch.bfloat16)):
        xr, wr = xs.to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
        o = rms_norm_reference(xr, wr)
        refs[key] = (o, *torch.autograd.grad(o, (xr, wr), dys.to(dtype)))
    ys, dxs = torch.cat([y[sl] for sl in slices]), torch.cat([dx[sl] for sl in slices])
    assert_numerics("y rows", ys, refs["hi"][0], refs["lo"][0])
    assert_numerics("dx rows", dxs, refs["hi"][1], refs["lo"][1], factor=3)
    assert_numerics("dw", dw, refs["hi"][2], refs["lo"][2], factor=3)
    del x, y, dy, dx
    torch.cuda.empty_cache()
