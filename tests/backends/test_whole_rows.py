"""Whole-row calls (``VarlenMetadata.rows``): how "auto" routes them and how ``sdpa`` runs them.

A call whose every document is one whole row (no documents packed, no padding: the metadata
``from_rows`` builds) is plain dense attention. Vision encoders under ``varlen_packed`` make such
calls by the hundred per forward (transformers splits each layer per window or image for an
attention name without "flash"), so:

- on CUDA, "auto" sends them to ``sdpa`` first (one fused kernel each way, measured faster than
  our kernel on whole rows of every length); deterministic backwards, packed and padded calls keep
  the usual order. Checked with the backends pretended available (no GPU needed), on the
  requests a tiny Qwen2.5-VL's own forward builds;
- ``sdpa`` runs them as one batched call that reads nothing back from the device, equal to the
  per-document reference by the numerics rule (outputs and gradients, GQA, causal with
  L_q != L_k, windows, sinks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_varlen
from hf_varlen import functional
from hf_varlen.backends import AttentionParams, registry
from hf_varlen.backends.sdpa import sdpa_backend
from hf_varlen.metadata import from_collator_kwargs, from_rows
from hf_varlen.reference.attention import attention_reference
from hf_varlen.testing import assert_numerics

CPU = torch.device("cpu")
# Tensor methods that bring a value back to the host (a device sync per call on a GPU)
HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero")


def _on_cuda(req: registry.Request, **changes) -> registry.Request:
    """The same call as a bf16 CUDA call would describe it."""
    return dataclasses.replace(req, device="cuda", dtype=torch.bfloat16, **changes)


def _request(metadata, t_q, t_k, *, head_dim=80, heads=16, causal=False, softcap=0.0):
    q = torch.zeros(t_q, heads, head_dim)
    k = torch.zeros(t_k, heads, head_dim)
    params = AttentionParams.create(head_dim=head_dim, causal=causal, softcap=softcap)
    return registry.Request.for_call(q, k, k, metadata, params)


@pytest.fixture
def every_backend_available(monkeypatch):
    monkeypatch.setattr(registry, "unavailable_reason", lambda name: None)


@pytest.mark.parametrize(
    "rows,len_q,len_k,causal",
    [
        (1, 64, 64, False),  # a vision window
        (1, 256, 256, False),  # a whole image in a full-attention layer
        (8, 256, 256, True),  # a batch of plain rows, no padding
        (4, 1, 512, True),  # one decoding step of 4 rows
    ],
)
def test_auto_sends_short_whole_rows_to_sdpa_on_cuda(
    every_backend_available, rows, len_q, len_k, causal
):
    meta = from_rows(rows, len_q, len_k, CPU)
    req = _on_cuda(_request(meta, rows * len_q, rows * len_k, causal=causal))
    assert req.rows
    assert registry.resolve("auto", req).name == "sdpa"


def test_auto_keeps_the_order_for_other_calls(every_backend_available):
    def usual(req):  # what the order gives the same call without the whole-rows rule
        return registry.resolve("auto", dataclasses.replace(req, rows=False)).name

    window = _on_cuda(_request(from_rows(1, 64, 64, CPU), 64, 64))
    # a deterministic backward stays on our kernel (deterministic at no cost)
    det = dataclasses.replace(window, deterministic=True)
    assert registry.resolve("auto", det).name == usual(det) == "triton"
    # SDPA has no softcap: the call goes on down the usual order
    capped = _on_cuda(_request(from_rows(1, 64, 64, CPU), 64, 64, softcap=5.0))
    assert registry.resolve("auto", capped).name == usual(capped) == "triton"
    # documents packed into one row by the collator's offsets: the usual order
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    packed = _request(from_collator_kwargs(cu, cu, 34, 34, 64, 64), 64, 64, causal=True)
    assert not packed.rows
    assert registry.resolve("auto", _on_cuda(packed)).name == "triton"
    # an explicitly chosen backend is never second-guessed
    assert registry.resolve("triton", window).name == "triton"


@pytest.mark.parametrize("rows,length", [(1, 3072), (1, 8192), (4, 8192), (2, 32768)])
@pytest.mark.parametrize("head_dim", [80, 128, 256])
def test_auto_sends_long_whole_rows_to_sdpa_too(every_backend_available, rows, length, head_dim):
    """Long rows go to SDPA as well (measured faster than our kernel at every length), ahead of
    the long-documents rules, whose FA4 still takes a pack of long documents of the same size."""
    total = rows * length
    row = _on_cuda(_request(from_rows(rows, length, length, CPU), total, total, head_dim=head_dim))
    assert row.rows and registry.resolve("auto", row).name == "sdpa"
    assert registry.resolve("auto", dataclasses.replace(row, rows=False)).name == "fa4"


def test_qwen2_5_vl_vision_calls_leave_our_kernel_on_cuda(every_backend_available, monkeypatch):
    """Every attention call of a tiny packed Qwen2.5-VL step (forward + backward), described as a
    bf16 CUDA call: the vision tower's per-window and per-image calls go to sdpa, the text
    model's packed row to our kernel."""
    from test_multimodal import _model, _run, _samples

    from hf_varlen.multimodal import MultimodalPackingCollator

    seen = []
    real_resolve = functional.resolve

    def spy(name, req):
        seen.append(req)
        return real_resolve(name, req)

    monkeypatch.setattr(functional, "resolve", spy)
    model = _model("qwen2_5_vl", "varlen_packed", torch.float32)
    collator = MultimodalPackingCollator(rope_index=model.model.get_rope_index)
    _run(model, collator(_samples(torch.Generator().manual_seed(0))), torch.float32)
    vision = [r for r in seen if not r.causal]
    text = [r for r in seen if r.causal]
    # 2 layers: one windowed (one call per window), one full (one call per image)
    assert len(vision) > 2 and text
    chosen = {(r.causal, registry.resolve("auto", _on_cuda(r)).name) for r in seen}
    assert chosen == {(False, "sdpa"), (True, "triton")}


CASES = {  # (rows, L_q, L_k, h_q, h_kv, causal, window, sinks)
    "full": (3, 5, 5, 4, 4, False, (-1, -1), False),
    "causal-gqa": (2, 6, 6, 4, 2, True, (-1, -1), False),
    "causal-decode": (3, 2, 7, 4, 2, True, (-1, -1), False),
    "window": (2, 7, 7, 2, 2, False, (2, 1), False),
    "causal-window": (2, 7, 7, 4, 1, True, (3, -1), False),
    "sinks-gqa": (2, 5, 5, 4, 2, True, (-1, -1), True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_runs_whole_rows_as_one_batch_without_host_reads(monkeypatch, case):
    rows, len_q, len_k, h_q, h_kv, causal, window, with_sinks = CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (
        torch.randn(rows * n, h, 8, generator=g, dtype=torch.float64)
        for n, h in ((len_q, h_q), (len_k, h_kv), (len_k, h_kv), (len_q, h_q))
    )
    sinks = torch.randn(h_q, generator=g, dtype=torch.float64) if with_sinks else None
    meta = from_rows(rows, len_q, len_k, CPU)
    assert meta.rows

    def run(dtype, fn):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        s = sinks.detach().to(dtype).requires_grad_() if with_sinks else None
        out = fn(*leaves, s)
        out.backward(grad_out.to(dtype))
        return [out.detach(), *(t.grad for t in leaves), *([s.grad] if with_sinks else [])]

    def reference(q_, k_, v_, s):
        cu_q, cu_k = meta.cu_seqlens_q, meta.cu_seqlens_k
        kw = dict(causal=causal, window_size=window, sinks=s)
        return attention_reference(q_, k_, v_, cu_q, cu_k, **kw)

    def backend(q_, k_, v_, s):
        params = AttentionParams.create(head_dim=8, causal=causal, window_size=window, sinks=s)
        with monkeypatch.context() as m:  # any read of a tensor's values raises
            for name in HOST_READS:
                m.setattr(torch.Tensor, name, _raise(name), raising=False)
            return sdpa_backend(q_, k_, v_, meta, params)

    hi = run(torch.float64, reference)
    lo = run(torch.float32, reference)
    got = run(torch.float32, backend)
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for name, x, h, low in zip(names, got, hi, lo):
        assert_numerics(f"{case} {name}", x, h, low, factor=2.0 if name == "out" else 3.0)


def _raise(name):
    def read(*args, **kwargs):
        raise AssertionError(f"Tensor.{name}: whole rows need no host read")

    return read


def test_model_rows_reach_sdpa_as_one_call(monkeypatch):
    """A plain (unpadded, unpacked) batch through varlen_packed on CPU: one SDPA call per layer
    for the whole batch, not one per row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.set_attn_implementation("varlen_packed")
    hf_varlen.set_backend("sdpa", model=model)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    model(input_ids=torch.randint(0, 64, (3, 10)), use_cache=False)
    assert calls == [torch.Size([3, 4, 10, 8])] * 2
