"""Fused linear cross-entropy: the op against the full-logits reference, and the HF wiring.

Op tests compare the loss and every gradient (hidden, weight, bias) with the numerics rule
(``hf_varlen.testing.assert_numerics``): ref_hi is the reference in fp64, ref_lo the reference in
the input dtype (bf16 logits + fp32 loss, as HF computes it). Both row-step backends run: "torch"
and "triton" (under TRITON_INTERPRET=1 on CPU, so kept to small shapes). The HF model wiring is
tested in tests/integrations/test_cross_entropy_model.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hf_varlen.ops import cross_entropy as ce
from hf_varlen.ops.cross_entropy import chunks, fused_linear_cross_entropy
from hf_varlen.reference.cross_entropy import linear_cross_entropy_reference
from hf_varlen.testing import assert_numerics

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BACKENDS = [
    "torch",
    pytest.param(
        "triton", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
    ),
]


def _inputs(n=37, hidden=16, vocab=300, *, dtype=torch.float32, bias=False, lead=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (n,) if lead is None else lead
    h = torch.randn(*shape, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5 * 2
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.5 if bias else None
    y = torch.randint(0, vocab, shape, generator=gen)
    y.view(-1)[::4] = -100
    return h, w, b, y


def _leaves(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]


def _close(name, x, ref_hi, ref_lo, factor, dtype):
    """fp32 inputs: fp32 tolerance of the fp64 reference; fp16/bf16 inputs: the numerics rule."""
    if dtype == torch.float32:
        scale = ref_hi.abs().max().item() if ref_hi.numel() else 0.0
        torch.testing.assert_close(x.double(), ref_hi, rtol=2e-5, atol=2e-6 * scale, msg=name)
    else:
        assert_numerics(name, x, ref_hi, ref_lo, factor=factor)


def _check_against_reference(h, w, b, y, dtype, *, kwargs, op_kwargs):
    """Run the op in ``dtype`` and the reference in fp64 and in ``dtype``; compare (``_close``)."""
    ours, hi, lo = (
        _leaves((h, w, b), dtype),
        _leaves((h, w, b), torch.float64),
        _leaves((h, w, b), dtype),
    )
    out = fused_linear_cross_entropy(ours[0], ours[1], y, bias=ours[2], **kwargs, **op_kwargs)
    out_hi = linear_cross_entropy_reference(hi[0], hi[1], y, bias=hi[2], **kwargs)
    out_lo = linear_cross_entropy_reference(lo[0], lo[1], y, bias=lo[2], **kwargs)
    assert out.dtype == torch.float32 and out.shape == out_hi.shape
    _close("loss", out, out_hi, out_lo, 2.0, dtype)
    grad = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64, device=out.device)
    grad = grad.view(out.shape)
    out.backward(grad.float())
    out_hi.backward(grad)
    out_lo.backward(grad.float())
    for name, a, b_hi, b_lo in zip(("hidden", "weight", "bias"), ours, hi, lo):
        if a is not None:
            assert a.grad.dtype == a.dtype
            _close(f"d{name}", a.grad, b_hi.grad, b_lo.grad, 3.0, dtype)


CASES = {
    "plain": {},
    "softcap": {"softcap": 2.5},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "everything": {"softcap": 4.0, "label_smoothing": 0.2, "z_loss": 0.05, "logit_scale": 0.7},
    "mean": {"reduction": "mean"},
    "none": {"reduction": "none"},
}


# ----------------------------------------------------------------------------------------------
# The op against the reference
# ----------------------------------------------------------------------------------------------


def test_reference_is_f_cross_entropy():
    h, w, _, y = _inputs()
    logits = h @ w.T
    for reduction in ("sum", "mean", "none"):
        want = F.cross_entropy(logits, y, reduction=reduction, label_smoothing=0.1)
        got = linear_cross_entropy_reference(h, w, y, reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(backend, case):
    h, w, b, y = _inputs(bias=case == "everything")
    # chunk 16 does not divide 37 tokens (28 kept): three chunks, the last one partial
    _check_against_reference(
        h,
        w,
        b,
        y,
        torch.float32,
        kwargs=CASES[case],
        op_kwargs={"chunk_size": 16, "backend": backend},
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["plain", "everything", "none"])
def test_matches_reference_bf16(backend, case):
    h, w, b, y = _inputs(n=64, hidden=32, vocab=500, bias=True, seed=1)
    _check_against_reference(
        h,
        w,
        b,
        y,
        torch.bfloat16,
        kwargs=CASES[case],
        op_kwargs={"chunk_size": 24, "backend": backend},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_computes_dw_in_one_matmul(monkeypatch, dtype):
    """All rows in one chunk: dW is the single matmul HF's head does, in the weight's dtype (no
    fp32 accumulator); more chunks accumulate in fp32 (_accumulate_wgrad)."""
    calls = []
    real = chunks._accumulate_wgrad
    monkeypatch.setattr(chunks, "_accumulate_wgrad", lambda *a: calls.append(1) or real(*a))
    h, w, b, y = _inputs(n=64, hidden=32, vocab=500, bias=True, seed=2)
    op = {"backend": "torch"}
    _check_against_reference(h, w, b, y, dtype, kwargs={}, op_kwargs={**op, "chunk_size": 64})
    assert calls == []
    _check_against_reference(h, w, b, y, dtype, kwargs={}, op_kwargs={**op, "chunk_size": 24})
    assert len(calls) == 3


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fp32_dh_is_summed_in_vocabulary_blocks(monkeypatch, backend):
    """fp32: dh adds its products over blocks of DH_VOCAB_BLOCK_FP32 vocabulary columns (here 64
    of 300: four whole blocks and a partial one), two chunks of rows; still the reference's."""
    monkeypatch.setattr(chunks, "DH_VOCAB_BLOCK_FP32", 64)
    h, w, b, y = _inputs(bias=True, seed=3)
    op = {"chunk_size": 24, "backend": backend}
    _check_against_reference(h, w, b, y, torch.float32, kwargs={}, op_kwargs=op)
    g = torch.randn(5, 300, dtype=torch.float64).float()
    out = torch.empty(5, 16)
    chunks._dlogits_times_weight(g, w.float(), out)
    torch.testing.assert_close(out.double(), g.double() @ w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batched_hidden_and_int32_labels(backend):
    h, w, b, y = _inputs(lead=(3, 11), bias=True)
    _check_against_reference(
        h,
        w,
        b,
        y.int(),
        torch.float32,
        kwargs={"reduction": "none"},
        op_kwargs={"chunk_size": 7, "backend": backend},
    )


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_ignored_rows_and_all_ignored(reduction):
    h, w, _, y = _inputs(n=40)
    y[:16] = -100  # the first whole chunk of 16 is ignored
    _check_against_reference(
        h, w, None, y, torch.float32, kwargs={"reduction": reduction}, op_kwargs={"chunk_size": 16}
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction, backend):
    """No label token at all: loss 0 (also for "mean", where F.cross_entropy gives NaN) and
    exactly zero, finite gradients for hidden, weight and bias (as HF's loss gives)."""
    h, w, b, y = _inputs(n=40, bias=True)
    ignored = torch.full_like(y, -100)
    hh, ww, bb = _leaves((h, w, b), torch.float32)
    out = fused_linear_cross_entropy(
        hh, ww, ignored, bias=bb, reduction=reduction, backend=backend, chunk_size=16
    )
    want = linear_cross_entropy_reference(h, w, ignored, bias=b, reduction=reduction)
    assert torch.count_nonzero(out) == 0 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want)
    out.sum().backward()
    for name, t in (("hidden", hh), ("weight", ww), ("bias", bb)):
        assert torch.isfinite(t.grad).all() and torch.count_nonzero(t.grad) == 0, name


def test_row_kernel_vocab_tail_ignored_and_out_of_range_rows():
    """The Triton row step (several BLOCK_V blocks, a partial last one) equals the torch one."""
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen) * 4
    labels = torch.tensor([5, -100, 299, 0, 300, 17])  # ignored row, last column, out of range
    for kwargs in (
        {},
        {"softcap": 3.0, "label_smoothing": 0.1, "z_loss": 0.01, "logit_scale": 1.5},
    ):
        cfg = chunks.LossConfig(
            -100,
            "sum",
            kwargs.get("softcap"),
            kwargs.get("logit_scale", 1.0),
            kwargs.get("label_smoothing", 0.0),
            kwargs.get("z_loss", 0.0),
            None,
            "triton",
        )
        scale = torch.linspace(0.5, 2.0, 6)
        a, b = logits.clone(), logits.clone()
        loss_a, loss_b = torch.empty(6), torch.empty(6)
        ce.ce_rows_triton(a, labels, loss_a, cfg, compute_grad=True, row_scale=scale, block_v=64)
        ce.ce_rows_torch(b, labels, loss_b, cfg, compute_grad=True, row_scale=scale)
        torch.testing.assert_close(loss_a, loss_b, equal_nan=True)
        assert loss_a[1] == 0 and torch.isnan(loss_a[4])
        keep = torch.tensor([0, 1, 2, 3, 5])  # the NaN row's gradient is unspecified
        torch.testing.assert_close(a[keep], b[keep])
        assert torch.count_nonzero(a[1]) == 0


def test_forward_only_and_partial_grads():
    h, w, b, y = _inputs(bias=True)
    hh, ww, bb = _leaves((h, w, b), torch.float32)
    with torch.no_grad():
        out = fused_linear_cross_entropy(hh, ww, y, bias=bb, chunk_size=8)
    torch.testing.assert_close(out.double(), linear_cross_entropy_reference(h, w, y, bias=b))
    ww.requires_grad_(False)  # frozen head (e.g. LoRA without lm_head): dW is not computed
    fused_linear_cross_entropy(hh, ww, y, bias=bb.detach(), chunk_size=8).backward()
    hr = h.clone().requires_grad_()
    linear_cross_entropy_reference(hr, w, y, bias=b).backward()
    torch.testing.assert_close(hh.grad.double(), hr.grad, rtol=1e-5, atol=1e-6)
    assert ww.grad is None


def test_tied_embeddings_accumulate():
    gen = torch.Generator().manual_seed(4)
    emb = torch.randn(300, 16, generator=gen)
    ids = torch.randint(0, 300, (30,), generator=gen)
    y = torch.randint(0, 300, (30,), generator=gen)
    grads = []
    for fn in (fused_linear_cross_entropy, linear_cross_entropy_reference):
        e = emb.clone().requires_grad_()
        hidden = torch.tanh(F.embedding(ids, e))
        fn(hidden, e, y).backward()
        grads.append(e.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def test_autocast_casts_like_linear():
    h, w, _, y = _inputs()
    hh, ww = _leaves((h, w), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_cross_entropy(hh, ww, y)
        want = linear_cross_entropy_reference(h.float(), w.float(), y)
    out.backward()
    assert (
        out.dtype == torch.float32
        and hh.grad.dtype == torch.float32
        and ww.grad.dtype == torch.float32
    )
    torch.testing.assert_close(out, want, rtol=1e-3, atol=0)


def test_backward_twice_raises_and_inputs_unchanged():
    h, w, b, y = _inputs(bias=True)
    hh, ww, bb = _leaves((h, w, b), torch.float32)
    before = [t.detach().clone() for t in (hh, ww, bb, y)]
    out = fused_linear_cross_entropy(hh, ww, y, bias=bb)
    out.backward(retain_graph=True)
    for t, t0 in zip((hh, ww, bb, y), before):
        assert torch.equal(t, t0)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"hidden": torch.zeros(5, 8, dtype=torch.float64)}, TypeError, "hidden: expected dtype"),
        ({"weight": torch.zeros(10, 8, dtype=torch.bfloat16)}, TypeError, "weight: expected dtype"),
        ({"weight": torch.zeros(10, 7)}, ValueError, r"weight: expected shape \(V, 8\)"),
        ({"labels": torch.zeros(6, dtype=torch.long)}, ValueError, "labels: expected shape"),
        ({"labels": torch.zeros(5)}, TypeError, "labels: expected dtype"),
        ({"bias": torch.zeros(9)}, ValueError, "bias: expected a tensor of shape"),
        ({"reduction": "avg"}, ValueError, "reduction: expected one of"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"label_smoothing": 1.0}, ValueError, "label_smoothing"),
        ({"z_loss": -1.0}, ValueError, "z_loss"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"backend": "cuda"}, ValueError, "backend: expected one of"),
    ],
)
def test_bad_input_raises_before_launch(change, error, match):
    args = {
        "hidden": torch.zeros(5, 8),
        "weight": torch.zeros(10, 8),
        "labels": torch.zeros(5, dtype=torch.long),
    }
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(args["hidden"], args["weight"], args["labels"], **kwargs)
    h, w, _, y = _inputs()  # a valid call in the same process still works
    assert torch.isfinite(fused_linear_cross_entropy(h.float(), w.float(), y))


def test_default_chunk_size():
    cuda = torch.device("cuda")
    assert ce.default_chunk_size(32768, 151936, torch.bfloat16, cuda) == 3328
    assert ce.default_chunk_size(100, 151936, torch.bfloat16, cuda) == 100
    assert ce.default_chunk_size(10**6, 10**7, torch.float32, torch.device("cpu")) == 256


# ----------------------------------------------------------------------------------------------
# GPU (bf16 numerics, int64 indexing, memory)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", ["plain", "everything", "mean", "none"])
def test_gpu_bf16_numerics(backend, case):
    h, w, b, y = _inputs(n=3001, hidden=256, vocab=32003, bias=case == "everything", seed=5)
    h, w, b, y = (None if t is None else t.cuda() for t in (h, w, b, y))
    _check_against_reference(
        h,
        w,
        b,
        y,
        torch.bfloat16,
        kwargs=CASES[case],
        op_kwargs={"chunk_size": 1024, "backend": backend},
    )


@pytest.mark.gpu
def test_gpu_fp32_weight_accumulator_and_fp16():
    h, w, b, y = _inputs(n=2048, hidden=128, vocab=5000, bias=True, seed=6)
    h, w, b, y = (t.cuda() for t in (h, w, b, y))
    _check_against_reference(h, w, b, y, torch.float16, kwargs={}, op_kwargs={"chunk_size": 256})
    assert isinstance(chunks._addmm_out_dtype_ok(h.device, torch.float16), bool)  # probed


@pytest.mark.gpu
def test_gpu_row_kernel_long_indexing():
    """A (C, V) chunk past 2^31 elements: the last rows match the torch row step."""
    rows, vocab = 16400, 131101  # 2.15e9 elements
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    cfg = chunks.LossConfig(-100, "sum", 30.0, 1.0, 0.0, 0.0, None, "triton")
    tail = logits[-8:].clone()
    loss = torch.empty(rows, device="cuda")
    ce.ce_rows_triton(logits, labels, loss, cfg, compute_grad=True)
    loss_ref = torch.empty(8, device="cuda")
    ce.ce_rows_torch(tail, labels[-8:], loss_ref, cfg, compute_grad=True)
    torch.testing.assert_close(loss[-8:], loss_ref)
    torch.testing.assert_close(logits[-8:].float(), tail.float(), rtol=0.02, atol=1e-6)


def _gpu_peak_extra_bytes(n: int, hidden: int, vocab: int, chunk: int) -> int:
    """Peak memory a bf16 forward + backward of the op allocates beyond its inputs."""
    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(h, w, y, chunk_size=chunk).backward()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_gpu_peak_memory_is_chunk_sized():
    n, hidden, vocab, chunk = 8192, 1024, 128256, 2048
    extra = _gpu_peak_extra_bytes(n, hidden, vocab, chunk)
    # chunk logits + fp32 dW accumulator + dW + dh (+ 64 MiB of slack for small buffers)
    budget = chunk * vocab * 2 + vocab * hidden * 6 + n * hidden * 2 + (64 << 20)
    assert extra <= budget, f"peak extra {extra / 2**30:.2f} GiB > budget {budget / 2**30:.2f} GiB"
    assert extra < n * vocab * 2  # less than the bf16 logits alone


@pytest.mark.gpu
def test_gpu_one_chunk_has_no_fp32_accumulator():
    """All tokens in one chunk (batch-8/32 packs): dW is written in bf16 by one matmul; the V x H
    fp32 accumulator (here 0.5 GiB) is never allocated."""
    n, hidden, vocab = 2048, 1024, 128256
    extra = _gpu_peak_extra_bytes(n, hidden, vocab, chunk=n)
    # chunk logits + dW (bf16) + dh (+ 64 MiB of slack), no 4 V H bytes of accumulator
    budget = n * vocab * 2 + vocab * hidden * 2 + n * hidden * 2 + (64 << 20)
    assert extra <= budget, f"peak extra {extra / 2**30:.2f} GiB > budget {budget / 2**30:.2f} GiB"
