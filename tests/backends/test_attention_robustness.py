"""Attention on adversarial input (issue 12, items 5-6): malformed offsets never change the
output's shape, read out of bounds or make NaN; where the offsets are on the host they are always
checked; inside a model, collator offsets that do not cover the batch raise a clear error; T = 0
and softmax_scale = 0 work on every backend; the oracle computes fp64 in fp64."""

from __future__ import annotations

import pytest
import torch
from attn_cases import cu_from_lengths, make_qkv
from tiny_packed import collator_batch, tiny_llama

import hf_varlen
from hf_varlen.ops.attention import triton_varlen_attention
from hf_varlen.reference.attention import attention_reference

CPU_BACKENDS = ["sdpa", "flex", "reference"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the triton op: interpreter on CPU
T = 10
BAD_OFFSETS = {
    "ends early": [0, 4, 5],
    "past T": [0, 4, 12],
    "negative": [0, -2, 10],
    "decreasing": [0, 6, 4],
    "starts late": [2, 4, 10],
}
HOST_BACKENDS = {"sdpa", "reference"}  # offsets copied to the host: always fully checked


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_bad_offsets_raise_on_host_backends_and_keep_shape_elsewhere(backend, case):
    q, k, v = make_qkv([T], 4, 2, 16, torch.float32)
    cu = torch.tensor(BAD_OFFSETS[case], dtype=torch.int32)
    if backend in HOST_BACKENDS:
        with pytest.raises(ValueError, match=r"cu_seqlens_q"):
            hf_varlen.varlen_attention(q, k, v, cu, cu, 8, 8, backend=backend)
        return
    out = hf_varlen.varlen_attention(q, k, v, cu, cu, 8, 8, backend=backend)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_host_backends_check_max_seqlen(backend):
    q, k, v = make_qkv([4, 6], 2, 2, 16, torch.float32)
    cu = cu_from_lengths([4, 6])
    with pytest.raises(ValueError, match="longest document has 6"):
        hf_varlen.varlen_attention(q, k, v, cu, cu, 5, 5, backend=backend)


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_triton_bad_offsets_stay_in_bounds(case):
    """q/k/v/grad live inside NaN buffers: any read outside [0, T) would turn up as NaN."""
    h_q, h_kv, d = 4, 2, 16
    q, k, v, g = make_qkv([T], h_q, h_kv, d, torch.float32, DEVICE, with_grad_out=True)
    views = []
    for t in (q, k, v, g):
        buf = torch.full((T + 40, t.shape[1], d), float("nan"), device=DEVICE)
        buf[20 : 20 + T] = t
        views.append(buf[20 : 20 + T].requires_grad_(t is not g))
    cu = torch.tensor(BAD_OFFSETS[case], dtype=torch.int32, device=DEVICE)
    qv, kv, vv, gv = views
    out = triton_varlen_attention(qv, kv, vv, cu, cu)
    assert out.shape == q.shape and torch.isfinite(out).all()
    out.backward(gv)
    for x in (qv, kv, vv):
        assert torch.isfinite(x.grad).all()


def test_plan_clamps_offsets_on_device():
    from hf_varlen.ops.attention.schedule import EMPTY_LO, row_bounds

    cu = torch.tensor([-5, 4, 30], dtype=torch.int32)
    lo, hi, qlo, qhi = row_bounds(cu, cu, T, T, -1, 0)
    for a, b, n in ((lo, hi, T), (qlo, qhi, T)):
        seen = a != EMPTY_LO
        assert ((a[seen] >= 0) & (b[seen] <= n - 1)).all()


# ---- T = 0 and softmax_scale = 0 on every backend ------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_pack(backend):
    q = torch.zeros(0, 4, 16, requires_grad=backend != "flex")
    kv = torch.zeros(0, 2, 16)
    cu = torch.zeros(2, dtype=torch.int32)
    out = hf_varlen.varlen_attention(q, kv, kv, cu, cu, 0, 0, backend=backend, validate=True)
    assert out.shape == (0, 4, 16)


def test_empty_pack_triton_op():
    q = torch.zeros(0, 4, 16, device=DEVICE, requires_grad=True)
    kv = torch.zeros(0, 2, 16, device=DEVICE)
    cu = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = triton_varlen_attention(q, kv, kv, cu, cu)
    assert out.shape == (0, 4, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["triton-op"])
@pytest.mark.parametrize("causal", [True, False])
def test_softmax_scale_zero_is_uniform_attention(backend, causal):
    lengths = [3, 7]
    q, k, v = make_qkv(lengths, 4, 2, 16, torch.float32)
    cu = cu_from_lengths(lengths)
    if backend == "triton-op":
        out = triton_varlen_attention(
            q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), cu.to(DEVICE),
            softmax_scale=0.0, causal=causal,
        ).cpu()  # fmt: skip
    else:
        out = hf_varlen.varlen_attention(
            q, k, v, cu, cu, 7, 7, softmax_scale=0.0, causal=causal, backend=backend
        )
    want = torch.empty_like(out)
    for s, n in ((0, 3), (3, 7)):
        vv = v[s : s + n].repeat_interleave(2, dim=1)  # (n, H_q, D)
        if causal:  # query i averages keys 0..i
            want[s : s + n] = vv.cumsum(0) / torch.arange(1, n + 1)[:, None, None]
        else:
            want[s : s + n] = vv.mean(0, keepdim=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# ---- the oracle computes in the input dtype ------------------------------------------------------


def test_reference_fp64_is_fp64_throughout():
    q, k, v = make_qkv([40], 2, 2, 32, torch.float64)
    cu = cu_from_lengths([40])
    got = attention_reference(q, k, v, cu, cu, causal=False)
    s = torch.einsum("qhd,khd->hqk", q, k) * 32**-0.5
    want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    assert (got - want).abs().max().item() < 1e-12


def test_reference_rejects_malformed_offsets():
    q, k, v = make_qkv([T], 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] must equal"):
        attention_reference(q, k, v, cu_from_lengths([T]), cu_from_lengths([4, 3]))


# ---- inside a model: collator offsets must cover the batch ---------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "flex", "reference"])
@pytest.mark.parametrize(
    "cu,max_len,match",
    [
        ([0, 5, 9], 5, r"cu_seq_lens_q runs from 0 to 9 .* batch has 12 tokens"),
        ([0, 5, 14], 9, r"cu_seq_lens_q runs from 0 to 14"),
        ([0, 7, 5, 12], 7, r"smallest step -2"),
        ([0, 5, 12], 4, r"max_length_q is 4 but cu_seq_lens_q holds a 7-token document"),
    ],
)
def test_model_rejects_collator_offsets_that_do_not_cover_the_batch(backend, cu, max_len, match):
    model = tiny_llama()
    hf_varlen.set_backend(backend, model=model)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model(**collator_batch(cu, max_len))


def test_model_offsets_checked_with_one_sync_per_forward(monkeypatch):
    from hf_varlen import metadata

    calls = []
    real = metadata._check_covers

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(metadata, "_check_covers", spy)
    model = tiny_llama()  # three layers
    batch = collator_batch([0, 5, 12], 7)
    batch["max_length_q"] = batch["max_length_k"] = torch.tensor(7)  # 0-d: read in the same sync
    model(**batch).logits.sum().backward()
    assert calls == [1]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    metadata._KWARGS_CACHE.clear()
    bad = collator_batch([0, 5, 9], 5)
    meta = metadata.from_collator_kwargs(
        bad["cu_seq_lens_q"], bad["cu_seq_lens_k"], 5, 5, 12, 12
    )  # no sync while compiling: not checked here
    assert meta.max_seqlen_q == 5 and calls == [1]


def test_model_rejects_position_ids_of_another_length():
    from hf_varlen.integrations.transformers import varlen_packed_forward

    q = torch.randn(1, 2, 12, 8)  # (B, H, T, D)
    pos = torch.arange(3 * 12).view(3, 1, 12)  # e.g. multimodal RoPE: not one entry per token
    with pytest.raises(ValueError, match=r"position_ids of shape \(3, 1, 12\)"):
        varlen_packed_forward(torch.nn.Module(), q, q, q, None, position_ids=pos)


def test_model_rejects_empty_collator_offsets():
    from hf_varlen.metadata import from_collator_kwargs

    cu = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="empty batch"):
        from_collator_kwargs(cu, cu, 0, 0, 0, 0)
