"""Attention numerics policy (docs/attention-numerics.md), the same on every backend:

- a NaN or inf in one document's q, k or v stays inside that document: the outputs and gradients
  of the other documents are bit-identical to a run without it (and finite);
- no backend hides one: every output row that attends to a NaN (its own query, or a key or value
  row it sees), or to an infinite value or query, is non-finite, and so are gradients of the
  poisoned document.

Backends: reference, sdpa, flex (forward only on CPU), and the triton kernel (interpreter on CPU,
forward and backward). Several short documents share one triton tile, which is where a masked
0 * NaN used to leak.
"""

from __future__ import annotations

import pytest
import torch
from attn_cases import cu_from_lengths, make_qkv

import hf_varlen
from hf_varlen.ops.attention import triton_varlen_attention
from hf_varlen.reference.attention import attention_reference, visibility_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the triton op: interpreter on CPU
BACKENDS = ["reference", "sdpa", "flex", "triton"]
LENGTHS = [5, 7, 4]  # the poisoned document is the middle one: rows 5..11
H_Q, H_KV, D = 4, 2, 16
CASES = [("q", "nan"), ("k", "nan"), ("v", "nan"), ("q", "inf"), ("v", "inf"), ("k", "inf")]


def _run(backend, q, k, v, g, causal, lengths=LENGTHS, softcap=0.0):
    """(out, dq, dk, dv) on CPU; gradients None where the backend has no backward here."""
    dev = DEVICE if backend == "triton" else "cpu"
    cu = cu_from_lengths(lengths, dev)
    q, k, v = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v))
    backward = backend != "flex" or dev == "cuda"
    with torch.set_grad_enabled(backward):
        if backend == "triton":
            out = triton_varlen_attention(q, k, v, cu, cu, causal=causal, softcap=softcap)
        else:
            m = max(lengths)
            out = hf_varlen.varlen_attention(
                q, k, v, cu, cu, m, m, causal=causal, softcap=softcap, backend=backend
            )
    if not backward:
        return out.detach().cpu(), None, None, None
    out.backward(g.to(dev))
    return tuple(t.detach().cpu() for t in (out, q.grad, k.grad, v.grad))


def _seers(which, row, causal, doc):
    """Rows of the packed output that attend to element ``row`` of q / k / v."""
    if which == "q":
        return [row]
    n = doc[1] - doc[0]
    mask = visibility_mask(n, n, causal=causal, window_size=(-1, -1))
    j = row - doc[0]
    return [doc[0] + i for i in range(n) if mask[i, j]]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("which,value", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_stays_in_its_document(backend, which, value, causal):
    check_isolation(backend, which, value, causal, LENGTHS, doc=1, row=8)


@pytest.mark.parametrize("backward", ["split", "fused"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_triton_long_documents_softcap_and_fused_backward(which, backward, request):
    """Documents longer than a tile (unmasked inner blocks), a softcap, both backward kernels."""
    if backward == "fused":
        request.getfixturevalue("fused_backward")
    check_isolation("triton", which, "nan", True, [10, 40, 6], doc=1, row=30, softcap=5.0)


def check_isolation(backend, which, value, causal, lengths, *, doc, row, softcap=0.0):
    """Poison element (row, head 0, 2) of q / k / v inside document ``doc``; see module doc."""
    q, k, v, g = make_qkv(lengths, H_Q, H_KV, D, torch.float32, with_grad_out=True)
    clean = _run(backend, q, k, v, g, causal, lengths, softcap)
    bad = {"q": q, "k": k, "v": v}[which].clone()
    bad[row, 0, 2] = float(value)
    args = {"q": q, "k": k, "v": v, which: bad}
    got = _run(backend, args["q"], args["k"], args["v"], g, causal, lengths, softcap)
    start = sum(lengths[:doc])
    span = (start, start + lengths[doc])
    others = torch.ones(sum(lengths), dtype=torch.bool)
    others[span[0] : span[1]] = False
    for name, x, x0 in zip(("out", "dq", "dk", "dv"), got, clean):
        if x is None:
            continue
        assert torch.isfinite(x[others]).all(), f"{backend}: {which}={value} leaked into {name}"
        assert torch.equal(x[others], x0[others]), f"{backend}: {name} of other documents changed"
    if (which, value) == ("k", "inf"):
        return  # an infinite key is IEEE arithmetic: a score of -inf is a zero weight
    # the poisoned rows: query head 0 (q), or the query heads of KV head 0 (k, v)
    heads = [0] if which == "q" else list(range(H_Q // H_KV))
    seers = _seers(which, row, causal, span)
    out = got[0][seers][:, heads]
    assert (~torch.isfinite(out)).flatten(1).any(1).all(), (
        f"{backend}: {which}={value} hidden in rows {seers}: {out.isfinite().flatten(1).all(1)}"
    )
    if got[1] is not None:
        grads = torch.cat([x[span[0] : span[1]].flatten() for x in got[1:]])
        assert not torch.isfinite(grads).all(), f"{backend}: the gradients hide {which}={value}"


# ---- softmax_scale and softcap: one policy on every backend ---------------------------------------

ARG_BACKENDS = ["reference", "sdpa", "flex", "triton", "oracle"]  # oracle: attention_reference


def _attend(backend, **kw):
    q, k, v = make_qkv([3, 5], 4, 2, 16, torch.float32)
    cu = cu_from_lengths([3, 5])
    if backend == "triton":
        dev = DEVICE
        return triton_varlen_attention(
            q.to(dev), k.to(dev), v.to(dev), cu.to(dev), cu.to(dev), **kw
        )
    if backend == "oracle":
        return attention_reference(q, k, v, cu, cu, **kw)
    return hf_varlen.varlen_attention(q, k, v, cu, cu, 5, 5, backend=backend, **kw)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -0.5])
@pytest.mark.parametrize("backend", ARG_BACKENDS)
def test_bad_softmax_scale_is_refused(backend, value):
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite number >= 0"):
        _attend(backend, softmax_scale=value)


@pytest.mark.parametrize("value", [float("nan"), -1.0, float("-inf")])
@pytest.mark.parametrize("backend", ARG_BACKENDS)
def test_bad_softcap_is_refused(backend, value):
    with pytest.raises(ValueError, match=r"softcap must be >= 0 \(0 or inf = no softcap"):
        _attend(backend, softcap=value)


@pytest.mark.parametrize("backend", ARG_BACKENDS)
def test_infinite_softcap_is_no_softcap(backend):
    """softcap * tanh(s / softcap) -> s as softcap -> inf: the same as softcap 0 (off), bitwise."""
    off = _attend(backend, softcap=0.0)
    inf = _attend(backend, softcap=float("inf"))
    assert torch.isfinite(inf).all() and torch.equal(inf, off)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("backend", ["triton", "flex", "sdpa", "torch", "flash_attn", "fa4"])
def test_gpu_non_finite_stays_in_its_document(backend, which):
    """bf16 on the GPU, forward and backward: long documents (unmasked blocks) beside short ones."""
    reason = hf_varlen.backends.unavailable_reason(backend)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    if not hf_varlen.backends.get_spec(backend).deterministic:
        pytest.skip(f"{backend}: no deterministic backward to compare bitwise")
    lengths, doc, row = [300, 700, 50, 3], 1, 900
    q, k, v, g = make_qkv(lengths, 32, 8, 128, torch.bfloat16, "cuda", with_grad_out=True)
    cu = cu_from_lengths(lengths, "cuda")

    def run(a, b, c):
        a, b, c = (t.detach().requires_grad_(True) for t in (a, b, c))
        out = hf_varlen.varlen_attention(
            a, b, c, cu, cu, 700, 700, backend=backend, deterministic=True
        )  # bitwise comparisons: no atomic backward
        out.backward(g)
        return [t.float().cpu() for t in (out.detach(), a.grad, b.grad, c.grad)]

    clean = run(q, k, v)
    bad = {"q": q, "k": k, "v": v}[which].clone()
    bad[row, 0, 5] = float("nan")
    got = run(*({"q": q, "k": k, "v": v} | {which: bad}).values())
    start = sum(lengths[:doc])
    others = torch.ones(sum(lengths), dtype=torch.bool)
    others[start : start + lengths[doc]] = False
    for name, x, x0 in zip(("out", "dq", "dk", "dv"), got, clean):
        assert torch.isfinite(x[others]).all(), f"{backend}: {which}=nan leaked into {name}"
        assert torch.equal(x[others], x0[others]), f"{backend}: {name} of other documents changed"
    assert not torch.isfinite(got[0][start : start + lengths[doc]]).all(), f"{backend}: hidden"
