"""Attention sinks (gpt-oss ``s_aux``): one learned logit per query head joins every row's softmax
denominator, with no value. The reference against a closed form; every backend that serves sinks
against the reference under the numerics rule (outputs, dq/dk/dv and the sinks' gradient); the
backends that do not serve them are refused by name, and "auto" skips them."""

from __future__ import annotations

import pytest
import torch
from attn_cases import cu_from_lengths, make_qkv

import hf_varlen
from hf_varlen.backends import Request, get_spec
from hf_varlen.ops.attention import triton_varlen_attention
from hf_varlen.reference.attention import attention_reference
from hf_varlen.testing import assert_numerics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the triton op: interpreter on CPU
LENGTHS = [1, 6, 13, 4]
H_Q, H_KV, D = 4, 2, 16


def _sinks(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(H_Q, generator=g) * 2).to(device, dtype)


def test_reference_sinks_closed_form():
    """A causal row that sees one key j: o = v_j * e^s / (e^s + e^sink) = v_j * sigmoid(s - sink);
    and a very negative sink is no sink."""
    q, k, v = make_qkv([5], H_Q, H_KV, D, torch.float64)
    cu = cu_from_lengths([5])
    sinks = _sinks(torch.float64)
    out = attention_reference(q, k, v, cu, cu, sinks=sinks)
    kv0 = k[0].repeat_interleave(H_Q // H_KV, 0)
    s = (q[0] * kv0).sum(-1) * D**-0.5  # (H_Q,)
    want = v[0].repeat_interleave(H_Q // H_KV, 0) * torch.sigmoid(s - sinks)[:, None]
    torch.testing.assert_close(out[0], want, rtol=1e-12, atol=1e-12)
    none = attention_reference(q, k, v, cu, cu)
    far = attention_reference(q, k, v, cu, cu, sinks=torch.full((H_Q,), -1e4, dtype=torch.float64))
    torch.testing.assert_close(far, none, rtol=0, atol=0)


def _grads(fn, q, k, v, sinks, g):
    q, k, v, sinks = (t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks))
    out = fn(q, k, v, sinks)
    if not out.requires_grad:
        return out.detach(), None, None, None, None
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


CASES = [
    ("sdpa", torch.float32, dict()),
    ("sdpa", torch.float32, dict(window_size=(3, 0))),
    ("sdpa", torch.float32, dict(causal=False)),
    ("flex", torch.float32, dict()),
    ("flex", torch.float32, dict(window_size=(3, 0), softcap=4.0)),
    ("triton", torch.float32, dict()),
    ("triton", torch.float16, dict()),
    ("triton", torch.float16, dict(window_size=(3, 0), softcap=4.0)),
    ("triton", torch.float32, dict(causal=False)),
]


@pytest.mark.parametrize("backend,dtype,kw", CASES)
def test_sinks_match_reference(backend, dtype, kw):
    dev = DEVICE if backend == "triton" else "cpu"
    q, k, v, g = make_qkv(LENGTHS, H_Q, H_KV, D, dtype, dev, with_grad_out=True)
    sinks = _sinks(dtype, dev)
    cu = cu_from_lengths(LENGTHS, dev)
    m = max(LENGTHS)

    def run(a, b, c, s):
        if backend == "triton":
            return triton_varlen_attention(a, b, c, cu, cu, sinks=s, **kw)
        with torch.set_grad_enabled(backend != "flex"):  # flex: no CPU backward
            return hf_varlen.varlen_attention(a, b, c, cu, cu, m, m, sinks=s, backend=backend, **kw)

    def ref(a, b, c, s):
        return attention_reference(a, b, c, cu, cu, sinks=s, **kw)

    got = _grads(run, q, k, v, sinks, g)
    lo = _grads(ref, q, k, v, sinks, g)
    hi_dtype = torch.float64 if dev == "cpu" else torch.float32
    hi = _grads(ref, *(t.to(hi_dtype) for t in (q, k, v, sinks, g)))
    names = ("out", "dq", "dk", "dv", "dsinks")
    for name, x, h, low, factor in zip(names, got, hi, lo, (2, 3, 3, 3, 3)):
        if x is None:
            continue
        assert_numerics(f"{backend} {dtype} {kw} {name}", x, h, low, factor=factor)
    # the sinks matter: the result differs from attention without them
    plain = attention_reference(q, k, v, cu, cu, **kw)
    assert not torch.allclose(got[0].float(), plain.float(), atol=1e-3)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_sinks_under_the_opaque_op(backend):
    """The host-offset backends run as an opaque op under torch.compile: sinks and their gradient
    pass through it."""
    from hf_varlen.backends.opaque import call_opaque
    from hf_varlen.backends.params import AttentionParams, VarlenMetadata

    q, k, v, g = make_qkv(LENGTHS, H_Q, H_KV, D, torch.float64, with_grad_out=True)
    sinks = _sinks(torch.float64)
    cu = cu_from_lengths(LENGTHS)
    meta = VarlenMetadata(cu, cu, 13, 13)

    def opaque(a, b, c, s):
        params = AttentionParams.create(head_dim=D, causal=True, sinks=s)
        return call_opaque(backend, a, b, c, meta, params)

    got = _grads(opaque, q, k, v, sinks, g)
    want = _grads(
        lambda a, b, c, s: attention_reference(a, b, c, cu, cu, sinks=s), q, k, v, sinks, g
    )
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["flash_attn", "fa4", "torch", "xformers"])
def test_backends_without_sinks_are_not_eligible(name):
    q, k, v = make_qkv([4], H_Q, H_KV, D, torch.float16)
    params = hf_varlen.backends.AttentionParams.create(head_dim=D, causal=True, sinks=_sinks())
    meta = hf_varlen.backends.VarlenMetadata(*(cu_from_lengths([4]),) * 2, 4, 4)
    missing = Request.for_call(q, k, v, meta, params).unsupported(get_spec(name))
    assert "attention sinks (sinks / s_aux)" in missing


def test_sinks_refused_by_name_and_checked():
    q, k, v = make_qkv([4], H_Q, H_KV, D, torch.float32)
    cu = cu_from_lengths([4])
    with pytest.raises(ValueError, match=r"sinks must have one logit per query head, shape \(4,\)"):
        hf_varlen.varlen_attention(q, k, v, cu, cu, 4, 4, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        hf_varlen.varlen_attention(q, k, v, cu, cu, 4, 4, sinks=torch.zeros(4, dtype=torch.long))


def test_auto_picks_a_backend_with_sinks():
    q, k, v = make_qkv([3, 5], H_Q, H_KV, D, torch.float32)
    cu = cu_from_lengths([3, 5])
    sinks = _sinks()
    out = hf_varlen.varlen_attention(q, k, v, cu, cu, 5, 5, sinks=sinks)  # CPU auto: sdpa
    want = attention_reference(q, k, v, cu, cu, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flex", "sdpa"])
@pytest.mark.parametrize("lengths", [[1, 2, 113, 1023, 300], [2048]])
def test_gpu_sinks_bf16_forward_backward(backend, lengths):
    """bf16 on the GPU (the interpreter cannot run bf16 dots): outputs, dq/dk/dv and dsinks."""
    q, k, v, g = make_qkv(lengths, 32, 8, 64, torch.bfloat16, "cuda", with_grad_out=True)
    sinks = (torch.randn(32, generator=torch.Generator().manual_seed(1)) * 2).cuda()
    cu = cu_from_lengths(lengths, "cuda")
    m = max(lengths)

    def run(a, b, c, s):
        return hf_varlen.varlen_attention(a, b, c, cu, cu, m, m, sinks=s, backend=backend)

    def ref(a, b, c, s):
        return attention_reference(a, b, c, cu, cu, sinks=s)

    got = _grads(run, q, k, v, sinks.bfloat16(), g)
    lo = _grads(ref, q, k, v, sinks.bfloat16(), g)
    hi = _grads(ref, *(t.float() for t in (q, k, v, sinks, g)))
    for name, x, h, low, factor in zip(
        ("out", "dq", "dk", "dv", "ds"), got, hi, lo, (2, 3, 3, 3, 3)
    ):
        assert_numerics(f"{backend} {name}", x, h, low, factor=factor)


def test_triton_sinks_compile_fullgraph_and_opcheck():
    """Under torch.compile the registered op carries the sinks (its optional last argument) and
    the same numbers come out, gradients included."""
    from torch._dynamo.utils import counters

    from hf_varlen.ops.attention.torch_library import forward_op

    q, k, v, g = make_qkv(LENGTHS, H_Q, H_KV, D, torch.float32, DEVICE, with_grad_out=True)
    sinks = _sinks(device=DEVICE)
    cu = cu_from_lengths(LENGTHS, DEVICE)
    torch.library.opcheck(forward_op, (q, k, v, cu, cu, 0.25, -1, 0, 0.0, False, sinks))

    def f(a, b, c, s):
        return triton_varlen_attention(a, b, c, cu, cu, sinks=s)

    want = _grads(f, q, k, v, sinks, g)
    torch._dynamo.reset()
    counters.clear()
    got = _grads(torch.compile(f, backend="aot_eager", fullgraph=True), q, k, v, sinks, g)
    assert dict(counters["graph_break"]) == {}
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
