"""The ``triton`` attention backend end to end on CPU (the kernels under TRITON_INTERPRET=1).

The backend's spec lists CUDA only, so on CPU the public function and the transformers
integration refuse it; here its own spec is registered again with CPU added (``served_on_cpu``),
so the path is the real one: ``hf_varlen.varlen_attention`` / ``attn_implementation=
"varlen_packed"`` -> backend dispatch -> ``backends/triton.py`` -> the tile plan and the kernels.
(On a CUDA machine the same tests run on the GPU, with the compiled kernels.)

Capture safety (what a CUDA graph capture of the attention needs; the captured training step
replays it with new offsets in the same tensors), checked by proxy as the fused loss's
``test_default_reads_no_number_back`` does:

- no tensor is read back to the host anywhere in the attention path (validation, dispatch, the
  backend, the tile plan, the launches): every host read of a tensor from library code raises;
- nothing is written to a cache while a capture is in progress (``ops.common.capturing`` answers
  True): a value cached then would hold the warm-up's data at every replay; the capture computes
  the same numbers as the uncaptured call.

Inside a model: a tiny fp16 Llama with ``attn_implementation="varlen_packed"`` on the triton
backend gives, for a packed row, the logits and parameter gradients of each document run alone,
by the numerics rule (hi: eager fp64 per document, lo: eager fp16 per document; gradients 3x),
from collator offsets and from position_ids alone.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys

import pytest
import torch

import hf_varlen
from hf_varlen.backends import get_spec, register_backend
from hf_varlen.ops import common
from hf_varlen.ops.common import TensorCache
from hf_varlen.testing import assert_numerics

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU
# Tensor methods that bring a value back to the host (a device sync; illegal in a capture)
HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero")
HOST_READS += ("cpu", "numpy")


@pytest.fixture
def served_on_cpu():
    """The triton backend's own spec, also allowed on CPU; the real one is restored after."""
    spec = get_spec("triton")
    register_backend(dataclasses.replace(spec, devices=spec.devices | {"cpu"}, probe=lambda: None))
    yield
    register_backend(spec)


def _packed(lengths, h_q=4, h_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v, grad_out = (
        torch.randn(t, h, d, generator=g).to(DEVICE, torch.float16) for h in (h_q, h_kv, h_kv, h_q)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, grad_out, cu.to(DEVICE)


def _attention(q, k, v, grad_out, cu, **kw):
    """(out, dq, dk, dv) of the public function on the triton backend."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    m = q.shape[0]  # an upper bound, as the captured step passes it
    out = hf_varlen.varlen_attention(q, k, v, cu, cu, m, m, backend="triton", **kw)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


# ---- no host read --------------------------------------------------------------------------------


def _library_caller() -> str | None:
    """The module of the first caller outside torch when that is hf_varlen's, else None (the
    triton interpreter reads its arguments on the host by design; that is not our code)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "torch" or name.startswith("torch.")):
            return name if name.startswith("hf_varlen") else None
        frame = frame.f_back
    return None


@pytest.fixture
def refuse_host_reads(monkeypatch):
    """After ``refuse_host_reads()``: a host read of a tensor from hf_varlen code raises."""

    def arm():
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)

            def guard(self, *args, _real=real, _name=name, **kwargs):
                caller = _library_caller()
                if caller is not None:
                    raise AssertionError(f"{caller} read a tensor back to the host ({_name})")
                return _real(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, guard)

    return arm


@pytest.mark.parametrize(
    "kw",
    [{}, dict(window_size=(5, -1), softcap=10.0), dict(causal=False, deterministic=True)],
    ids=["causal", "window-softcap", "full-deterministic"],
)
def test_triton_path_reads_nothing_back(served_on_cpu, refuse_host_reads, monkeypatch, kw):
    monkeypatch.delenv("HF_VARLEN_VALIDATE", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    args = _packed([7, 1, 20, 4])
    want = _attention(*args, **kw)
    refuse_host_reads()
    got = _attention(*args, **kw)
    monkeypatch.undo()
    for x, ref in zip(got, want):
        assert torch.equal(x, ref)


def test_host_read_proxy_catches_a_read(served_on_cpu, refuse_host_reads):
    """The proxy can fail: the full offsets check (validate=True) reads them on the host."""
    args = _packed([3, 5])
    refuse_host_reads()
    with pytest.raises(AssertionError, match="hf_varlen.* read a tensor back to the host"):
        _attention(*args, validate=True)


# ---- no cache write while capturing --------------------------------------------------------------


def _cache_state() -> dict[int, list]:
    """Every TensorCache in the process (wherever its module now lives): its keys, in order."""
    return {id(c): list(c._entries) for c in gc.get_objects() if type(c) is TensorCache}


@pytest.fixture
def capture(monkeypatch):
    """capture(fn): run fn as if a CUDA graph were being captured (``ops.common.capturing``
    answers True); returns (fn's result, how often the library asked)."""

    def run(fn):
        asked = []

        def capturing(tensors):
            asked.append(1)
            return True

        with monkeypatch.context() as m:
            m.setattr(common, "capturing", capturing)
            result = fn()
        return result, len(asked)

    return run


def test_attention_capture_writes_no_cache(served_on_cpu, capture):
    args = _packed([9, 2, 30])
    before = _cache_state()
    got, asked = capture(lambda: _attention(*args))
    assert asked > 0, "the capture predicate was never asked: the proxy does not reach the caches"
    assert _cache_state() == before, "a cache was written while capturing"
    # the same call outside a capture does cache (so the check above can see a write) ...
    want = _attention(*args)
    warm = _cache_state()
    assert warm != before
    # ... and a capture after that warm-up writes nothing either, and computes the same numbers
    again, _ = capture(lambda: _attention(*args))
    assert _cache_state() == warm
    for x, y, z in zip(got, want, again):
        assert torch.equal(x, y) and torch.equal(z, y)


# ---- inside a transformers model -----------------------------------------------------------------

LENGTHS = [6, 13, 1, 9]
VOCAB = 61


def _collator_kwargs() -> dict:
    """cu_seq_lens_q/k and max_length_q/k as a packing collator emits them for LENGTHS."""
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    cu, m = cu.to(DEVICE), max(LENGTHS)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)


def _llama():
    """A tiny Llama in fp64 with varlen_packed (its backend chosen by the caller)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    # head dim 16, two query heads per KV head
    sizes = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    cfg = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, **sizes)
    cfg.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="varlen_packed")
    return model.to(DEVICE, torch.float64)


def _step(model, ids, weight, **kwargs):
    """(logits, parameter gradients) of sum(logits * weight): one upstream gradient per token."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **kwargs).logits
    (logits.double() * weight).sum().backward()
    return logits.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _each_alone(model, ids, weight):
    """Each document alone (its own row, positions from 0) with eager attention: the logits
    concatenated and the parameter gradients summed over documents."""
    logits, grads, start = [], None, 0
    for n in LENGTHS:
        x, g = _step(model, ids[:, start : start + n], weight[:, start : start + n])
        logits.append(x)
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        start += n
    return torch.cat(logits, dim=1), grads


@pytest.mark.parametrize("style", ["collator", "position_ids"])
def test_llama_packed_on_triton_equals_each_document_alone(served_on_cpu, style):
    g = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    ids = torch.randint(0, VOCAB, (1, total), generator=g).to(DEVICE)
    weight = torch.randn(1, total, VOCAB, generator=g, dtype=torch.float64).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(DEVICE)
    kwargs = {"position_ids": positions}
    if style == "collator":
        kwargs |= _collator_kwargs()
    hi_model = _llama()
    hi_model.config._attn_implementation = "eager"
    lo_model = copy.deepcopy(hi_model).half()
    model = copy.deepcopy(hi_model).half()
    model.config._attn_implementation = "varlen_packed"
    hf_varlen.set_backend("triton", model=model)
    calls = []
    spec = get_spec("triton")
    register_backend(dataclasses.replace(spec, fn=lambda *a: calls.append(1) or spec.fn(*a)))

    x = _step(model, ids, weight, **kwargs)
    hi = _each_alone(hi_model, ids, weight)
    lo = _each_alone(lo_model, ids, weight)
    assert len(calls) == 2, f"the triton backend ran {len(calls)} times for 2 layers"
    assert_numerics(f"{style} logits", x[0], hi[0], lo[0], factor=2)
    names = [n for n, _ in model.named_parameters()]
    for name, gx, gh, gl in zip(names, x[1], hi[1], lo[1]):
        assert_numerics(f"{style} d{name}", gx, gh, gl, factor=3)


def test_llama_capture_writes_no_cache(served_on_cpu, capture):
    """The model's whole attention path (the offsets' metadata, the tile plan) under a capture:
    no cache written, the same logits and gradients as outside it."""
    model = _llama().half()
    hf_varlen.set_backend("triton", model=model)
    total = sum(LENGTHS)
    ids = torch.randint(0, VOCAB, (1, total), generator=torch.Generator().manual_seed(2))
    ids, weight = ids.to(DEVICE), torch.ones(1, total, VOCAB, dtype=torch.float64, device=DEVICE)
    kwargs = dict(position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None].to(DEVICE))
    kwargs |= _collator_kwargs()
    before = _cache_state()
    got, asked = capture(lambda: _step(model, ids, weight, **kwargs))
    assert asked > 0 and _cache_state() == before, "a cache was written while capturing"
    want = _step(model, ids, weight, **kwargs)
    assert _cache_state() != before  # outside a capture the metadata and plan are cached
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
