"""Attention backends on CUDA in bf16/fp16 (run on the GPU machine: `pytest -m gpu tests/`).

Each backend that cannot run on this machine is reported as skipped with the reason (not installed,
wrong GPU); on a machine without CUDA the whole file is skipped loudly by conftest.
"""

from __future__ import annotations

import pytest
import torch
from attn_cases import check_backend_against_reference, cu_from_lengths, fwd_bwd, make_qkv

import hf_varlen
from hf_varlen.backends import unavailable_reason

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["torch", "flex", "fa4", "flash_attn", "xformers", "triton", "sdpa"]


def _need(backend):
    if backend not in hf_varlen.backends.registry._REGISTRY:
        pytest.skip(f"backend {backend!r} is not registered in this build")
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(f"backend {backend!r} unavailable here: {reason}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("lengths", [[1, 2, 113], [1023, 1024, 2048], [4096], [77] * 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference(backend, lengths, dtype):
    _need(backend)
    check_backend_against_reference(backend, lengths, 8, 2, 128, dtype, "cuda")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("h_q,h_kv,d", [(8, 8, 64), (8, 1, 128), (32, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_gqa_heads_causality(backend, h_q, h_kv, d, causal):
    _need(backend)
    check_backend_against_reference(
        backend, [300, 17, 513], h_q, h_kv, d, torch.bfloat16, "cuda", causal=causal
    )


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_sliding_window_and_softcap(backend):
    _need(backend)
    spec = hf_varlen.backends.get_spec(backend)
    if spec.sliding_window:
        check_backend_against_reference(
            backend, [700, 64, 300], 8, 2, 128, torch.bfloat16, "cuda", window=(127, -1)
        )
    if spec.softcap:
        check_backend_against_reference(
            backend, [700, 64, 300], 8, 2, 128, torch.bfloat16, "cuda", softcap=30.0
        )


def test_gpu_flex_windows_change_between_calls():
    """The compiled flex call turns what changes between calls dynamic (automatic dynamic): the
    window must reach the mask as tensors, since Inductor cannot lower a symbolic int captured by a
    mask_mod (torch 2.11: LoweringException on the second window). Sizes and windows change here in
    one process, as they do between a Mistral's and a Gemma2's layers or runs."""
    _need("flex")
    for lengths, window in (
        ([300, 17, 513], (-1, -1)),
        ([700, 64, 300], (127, -1)),
        ([200, 90], (31, -1)),
        ([513, 17], (7, -1)),
    ):
        check_backend_against_reference(
            "flex", lengths, 8, 2, 128, torch.bfloat16, "cuda", window=window
        )


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_ten_thousand_tiny_documents(backend):
    _need(backend)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 5, (10_000,), generator=g).tolist()
    q, k, v = make_qkv(lengths, 8, 2, 128, torch.bfloat16, "cuda")
    cu = cu_from_lengths(lengths, "cuda")
    grad = torch.randn_like(q)
    out, dq, dk, dv = fwd_bwd(
        lambda a, b, c: hf_varlen.varlen_attention(a, b, c, cu, cu, 4, 4, backend=backend),
        q,
        k,
        v,
        grad,
    )
    ref = fwd_bwd(
        lambda a, b, c: hf_varlen.varlen_attention(a, b, c, cu, cu, 4, 4, backend="sdpa"),
        q.float(),
        k.float(),
        v.float(),
        grad.float(),
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(
            a.float(), b, rtol=0.05, atol=0.05, msg=lambda m, n=name: f"{backend} {n}: {m}"
        )


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_cross_contamination_and_nan_probe(backend):
    _need(backend)
    lengths = [200, 150, 333]
    total = sum(lengths)
    q, k, v = make_qkv(lengths, 8, 2, 128, torch.bfloat16, "cuda")
    cu = cu_from_lengths(lengths, "cuda")
    fn = lambda a, b, c: hf_varlen.varlen_attention(a, b, c, cu, cu, 333, 333, backend=backend)
    base = fn(q, k, v)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[200:350] = torch.randn_like(t[200:350])
    pert = fn(q2, k2, v2)
    keep = torch.cat([torch.arange(0, 200), torch.arange(350, total)]).cuda()
    torch.testing.assert_close(base[keep], pert[keep], rtol=0, atol=0)
    bufs = []
    for t in (q, k, v):
        buf = torch.full((total + 256, t.shape[1], 128), float("nan"), device="cuda", dtype=t.dtype)
        buf[128 : 128 + total] = t
        bufs.append(buf[128 : 128 + total])
    probe = fn(*bufs)
    assert torch.isfinite(probe).all()
    torch.testing.assert_close(probe, base, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["fa4", "flash_attn", "triton", "flex"])
def test_gpu_deterministic_backward(backend):
    _need(backend)
    lengths = [1000, 37, 2000]
    q, k, v = make_qkv(lengths, 16, 2, 128, torch.bfloat16, "cuda")
    cu = cu_from_lengths(lengths, "cuda")
    g = torch.randn_like(q)
    fn = lambda a, b, c: hf_varlen.varlen_attention(
        a, b, c, cu, cu, 2000, 2000, backend=backend, deterministic=True
    )
    first, second = fwd_bwd(fn, q, k, v, g), fwd_bwd(fn, q, k, v, g)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_gpu_model_packed_matches_eager_bf16():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        use_cache=False,
    )
    lengths = [100, 37, 300]
    torch.manual_seed(0)
    docs = [torch.randint(0, 1000, (n,)) for n in lengths]
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    batch = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in batch.items()}
    outs = {}
    for attn in ("varlen_packed", "eager"):
        torch.manual_seed(0)
        m = (
            AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
            .cuda()
            .to(torch.bfloat16)
        )
        if attn == "eager":
            outs[attn] = torch.cat([m(input_ids=d[None].cuda()).logits[0] for d in docs]).float()
        else:
            outs[attn] = m(**{k: v for k, v in batch.items() if k != "labels"}).logits[0].float()
    err = (outs["varlen_packed"] - outs["eager"]).abs().max().item()
    assert err < 0.1, (
        err
    )  # bf16 logits of a random model: same order as eager-vs-eager kernel noise
