"""SwiGLU / GeGLU kernels against the HF-math reference (CPU interpreter; GPU-marked at scale)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from launch_spy import LaunchSpy

from hf_varlen.ops.glu import function as glu
from hf_varlen.ops.glu import geglu, swiglu
from hf_varlen.reference.glu import geglu_reference, swiglu_reference
from hf_varlen.testing import assert_numerics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (name, kernel, reference, HF activation name)
ACTIVATIONS = [
    ("swiglu", swiglu, swiglu_reference, "silu"),
    ("geglu", lambda g, u: geglu(g, u), lambda g, u: geglu_reference(g, u), "gelu"),
    (
        "geglu_tanh",
        lambda g, u: geglu(g, u, approximate="tanh"),
        lambda g, u: geglu_reference(g, u, approximate="tanh"),
        "gelu_pytorch_tanh",
    ),
]
ACT_IDS = [a[0] for a in ACTIVATIONS]


def _check_against_reference(kernel, reference, gate, up, dout, *, tag=""):
    """Kernel output and (dgate, dup) vs the reference in fp64 (hi) and the input dtype (lo)."""
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    out = kernel(gate, up)
    dgate, dup = torch.autograd.grad(out, (gate, up), dout)
    refs = {}
    for key, dtype in (("hi", torch.float64), ("lo", gate.dtype)):
        g = gate.detach().to(dtype).requires_grad_()
        u = up.detach().to(dtype).requires_grad_()
        o = reference(g, u)
        refs[key] = (o, *torch.autograd.grad(o, (g, u), dout.to(dtype)))
    assert_numerics(f"{tag} out", out, refs["hi"][0], refs["lo"][0])
    assert_numerics(f"{tag} dgate", dgate, refs["hi"][1], refs["lo"][1], factor=3.0)
    assert_numerics(f"{tag} dup", dup, refs["hi"][2], refs["lo"][2], factor=3.0)


def _inputs(shape, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * scale).to(DEVICE, dtype)
    up = (torch.randn(shape, generator=gen) * scale).to(DEVICE, dtype)
    dout = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return gate, up, dout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_matches_reference(act, dtype):
    name, kernel, reference, _ = act
    gate, up, dout = _inputs((2, 3, 200), dtype)  # 200: not a multiple of the block
    _check_against_reference(kernel, reference, gate, up, dout, tag=f"{name} {dtype}")


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_reference_is_hf_math(act):
    """The reference is bit-for-bit HF's ``act_fn(gate) * up`` with transformers' ACT2FN."""
    from transformers.activations import ACT2FN

    _, _, reference, hf_name = act
    gate, up, _ = _inputs((4, 64), torch.bfloat16)
    assert torch.equal(reference(gate, up), ACT2FN[hf_name](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_fused_projection_views(act, dtype, monkeypatch):
    """gate, up = h[..., :F], h[..., F:] of one fused (..., 2F) projection are read in place."""
    name, kernel, reference, _ = act
    n_ff = 72
    gen = torch.Generator().manual_seed(1)
    h = (torch.randn(2, 5, 2 * n_ff, generator=gen) * 3).to(DEVICE, dtype).requires_grad_()
    spy = LaunchSpy(glu._glu_fwd_kernel)
    monkeypatch.setattr(glu, "_glu_fwd_kernel", spy)
    gate, up = h[..., :n_ff], h[..., n_ff:]
    out = kernel(gate, up)
    (g2, u2, *_), _ = spy.launches[0]
    assert g2.data_ptr() == h.data_ptr() and u2.data_ptr() == h.data_ptr() + n_ff * h.element_size()
    assert g2.stride(0) == 2 * n_ff  # no copy: the kernel walks the fused rows
    dout = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    (dh,) = torch.autograd.grad(out, h, dout)
    refs = {}
    for key, cdt in (("hi", torch.float64), ("lo", dtype)):
        hr = h.detach().to(cdt).requires_grad_()
        o = reference(hr[..., :n_ff], hr[..., n_ff:])
        refs[key] = (o, *torch.autograd.grad(o, hr, dout.to(cdt)))
    assert_numerics(f"{name} fused out", out, refs["hi"][0], refs["lo"][0])
    assert_numerics(f"{name} fused dh", dh, refs["hi"][1], refs["lo"][1], factor=3.0)


@pytest.mark.parametrize("layout", ["row_strided", "unmergeable", "transposed", "expanded"])
def test_strided_inputs(layout):
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    base = (torch.randn(4, 6, 2, 40, generator=gen) * 3).to(DEVICE, dtype)
    if layout == "row_strided":  # row stride 80, not 40
        gate, up = base[:, :, 0], base[:, :, 1]
    elif layout == "unmergeable":  # leading dims that cannot share one row stride (a copy)
        gate, up = base[:, :3, 0], base[:, 3:, 1]
    elif layout == "transposed":  # non-contiguous last dim (a copy)
        gate, up = base[..., 0, :].transpose(-1, -2), base[..., 1, :].transpose(-1, -2)
    else:  # broadcast rows (stride 0)
        gate, up = base[:1, :1, 0].expand(4, 6, 40), base[:, :, 1]
    dout = torch.randn(gate.shape[::-1], generator=gen).to(DEVICE, dtype).transpose(0, -1)
    assert not dout.is_contiguous()
    _check_against_reference(swiglu, swiglu_reference, gate, up, dout, tag=layout)


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_inputs_left_bit_identical(act):
    _, kernel, _, _ = act
    gate, up, dout = _inputs((3, 96), torch.bfloat16)
    gate.requires_grad_()
    up.requires_grad_()
    copies = [t.detach().clone() for t in (gate, up, dout)]
    out = kernel(gate, up)
    torch.autograd.grad(out, (gate, up), dout)
    for t, c in zip((gate, up, dout), copies):
        assert torch.equal(t.detach(), c)


def test_only_requested_gradients():
    gate, up, dout = _inputs((3, 40), torch.float32)
    gate.requires_grad_()
    out = swiglu(gate, up)
    (dgate,) = torch.autograd.grad(out, gate, dout)
    torch.testing.assert_close(dgate, torch.autograd.grad(F.silu(gate) * up, gate, dout)[0])


def test_empty_input():
    gate = torch.empty(0, 16, device=DEVICE, requires_grad=True)
    up = torch.empty(0, 16, device=DEVICE, requires_grad=True)
    out = swiglu(gate, up)
    assert out.shape == (0, 16)
    dgate, dup = torch.autograd.grad(out, (gate, up), torch.empty_like(out))
    assert dgate.shape == dup.shape == (0, 16)


def test_int32_path_for_ordinary_sizes(monkeypatch):
    fwd, bwd = LaunchSpy(glu._glu_fwd_kernel), LaunchSpy(glu._glu_bwd_kernel)
    monkeypatch.setattr(glu, "_glu_fwd_kernel", fwd)
    monkeypatch.setattr(glu, "_glu_bwd_kernel", bwd)
    gate, up, dout = _inputs((8, 48), torch.bfloat16)
    gate.requires_grad_()
    torch.autograd.grad(swiglu(gate, up), gate, dout)
    assert fwd.launches[0][1]["LONG_INDEXING"] is False
    assert bwd.launches[0][1]["LONG_INDEXING"] is False


def test_long_indexing_threshold():
    """The host switches to int64 exactly when an offset (masked lanes included) can pass 2^31."""
    limit = 2**31 - 1
    assert not glu._needs_long_indexing(16384, 14336, [14336, 28672])
    assert not glu._needs_long_indexing(149_796, 14336, [14336])  # 2_147_475_456 elements
    assert glu._needs_long_indexing(149_797, 14336, [14336])
    assert glu._needs_long_indexing(74_899, 14336, [28672])  # fused (T, 2F) view, T*F < 2^31
    assert not glu._needs_long_indexing(1, limit, [0])
    assert glu._needs_long_indexing(2, limit, [2])


@pytest.mark.parametrize("activation", glu._ACTIVATIONS)
def test_long_path_equals_int32_path(activation):
    gate, up, dout = _inputs((5, 130), torch.bfloat16)
    out32 = glu.glu_forward(gate, up, activation, long_indexing=False)
    out64 = glu.glu_forward(gate, up, activation, long_indexing=True)
    assert torch.equal(out32, out64)
    for a, b in zip(
        glu.glu_backward(dout, gate, up, activation, long_indexing=False),
        glu.glu_backward(dout, gate, up, activation, long_indexing=True),
    ):
        assert torch.equal(a, b)


def test_bad_inputs_raise_before_launch():
    gate, up, _ = _inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(gate, up[:, :4])
    with pytest.raises(TypeError, match="share a dtype"):
        swiglu(gate, up.half())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        swiglu(gate.long(), up.long())
    with pytest.raises(TypeError, match="torch.Tensor"):
        swiglu(gate.tolist(), up)
    with pytest.raises(ValueError, match="scalar"):
        swiglu(gate[0, 0], up[0, 0])
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', got 'erf'"):
        geglu(gate, up, approximate="erf")
    with pytest.raises(ValueError, match="one device"):
        swiglu(gate, torch.empty_like(up, device="meta"))
    # the process is still healthy after the errors
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_bf16_numerics_gpu(act):
    name, kernel, reference, _ = act
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 2 * 14336, device="cuda", generator=gen).mul_(3).bfloat16()
    dout = torch.randn(4096, 14336, device="cuda", generator=gen).bfloat16()
    gate, up = h[:, :14336], h[:, 14336:]
    _check_against_reference(kernel, reference, gate, up, dout, tag=f"{name} cuda bf16 fused")
    _check_against_reference(
        kernel, reference, gate.contiguous(), up.contiguous(), dout, tag=f"{name} cuda bf16"
    )


@pytest.mark.gpu
def test_int32_path_at_16k_tokens_gpu(monkeypatch):
    fwd, bwd = LaunchSpy(glu._glu_fwd_kernel), LaunchSpy(glu._glu_bwd_kernel)
    monkeypatch.setattr(glu, "_glu_fwd_kernel", fwd)
    monkeypatch.setattr(glu, "_glu_bwd_kernel", bwd)
    h = torch.randn(16384, 2 * 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = swiglu(h[:, :14336], h[:, 14336:])
    torch.autograd.grad(out, h, torch.randn_like(out))
    assert fwd.launches[0][1]["LONG_INDEXING"] is False
    assert bwd.launches[0][1]["LONG_INDEXING"] is False


def _check_row_slices(kernel, reference, gate, up, out, dout, dgate, dup, rows, tag):
    for lo, hi in rows:
        sl = slice(lo, hi)
        g = gate[sl].detach()
        u = up[sl].detach()
        refs = {}
        for key, dtype in (("hi", torch.float64), ("lo", g.dtype)):
            gr, ur = g.to(dtype).requires_grad_(), u.to(dtype).requires_grad_()
            o = reference(gr, ur)
            refs[key] = (o, *torch.autograd.grad(o, (gr, ur), dout[sl].to(dtype)))
        assert_numerics(f"{tag} out rows {lo}:{hi}", out[sl], refs["hi"][0], refs["lo"][0])
        assert_numerics(f"{tag} dgate {lo}:{hi}", dgate[sl], refs["hi"][1], refs["lo"][1], factor=3)
        assert_numerics(f"{tag} dup {lo}:{hi}", dup[sl], refs["hi"][2], refs["lo"][2], factor=3)


@pytest.mark.gpu
@pytest.mark.big_memory
def test_swiglu_past_int32_elements_gpu(monkeypatch):
    """gate/up (150016, 14336) bf16: 2.15e9 elements each; rows past the 2^31 offset checked."""
    spy = LaunchSpy(glu._glu_fwd_kernel)
    monkeypatch.setattr(glu, "_glu_fwd_kernel", spy)
    n_tok, n_ff = 150_016, 14336
    assert n_tok * n_ff > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(n_tok, n_ff, device="cuda", dtype=torch.bfloat16, generator=gen)
    up = torch.randn(n_tok, n_ff, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate.requires_grad_()
    up.requires_grad_()
    out = swiglu(gate, up)
    assert spy.launches[0][1]["LONG_INDEXING"] is True
    dout = torch.randn(n_tok, n_ff, device="cuda", dtype=torch.bfloat16, generator=gen)
    dgate, dup = torch.autograd.grad(out, (gate, up), dout)
    edge = 2**31 // n_ff
    rows = [(0, 64), (edge - 32, edge + 32), (n_tok - 64, n_tok)]
    _check_row_slices(swiglu, swiglu_reference, gate, up, out, dout, dgate, dup, rows, "swiglu")
    del gate, up, out, dout, dgate, dup
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.big_memory
def test_geglu_fused_view_past_int32_offsets_gpu():
    """h (80000, 2*14336): up = h[:, F:] ends past offset 2^31 though it has < 2^31 elements."""
    n_tok, n_ff = 80_000, 14336
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n_tok, 2 * n_ff, device="cuda", dtype=torch.bfloat16, generator=gen)
    h.requires_grad_()
    gate, up = h[:, :n_ff], h[:, n_ff:]
    assert gate.numel() < 2**31 < (n_tok - 1) * 2 * n_ff + 2 * n_ff

    def kernel(g, u):
        return geglu(g, u, approximate="tanh")

    def reference(g, u):
        return geglu_reference(g, u, approximate="tanh")

    out = kernel(gate, up)
    dout = torch.randn(n_tok, n_ff, device="cuda", dtype=torch.bfloat16, generator=gen)
    dgate, dup = torch.autograd.grad(out, (gate, up), dout)
    edge = 2**31 // (2 * n_ff)
    rows = [(0, 64), (edge - 32, edge + 32), (n_tok - 64, n_tok)]
    _check_row_slices(kernel, reference, gate, up, out, dout, dgate, dup, rows, "geglu fused")
    del h, gate, up, out, dout, dgate, dup
    torch.cuda.empty_cache()
