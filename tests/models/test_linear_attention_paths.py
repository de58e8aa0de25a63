"""The two paths of a packed gated DeltaNet layer (hf_varlen.integrations.linear_attention).

Tiny qwen3_next / qwen3_5 / olmo_hybrid models (tests/model_families.py's shrunk configs), CPU:

- ``path="loop"``: packed (PackingCollator) == each document alone under eager (numerics rule);
- ``path="fla"`` with a recording stand-in for FLA's ``chunk_gated_delta_rule`` (CPU has no FLA):
  it is called once per layer with the documents' ``cu_seqlens`` (int64), ``initial_state=None``
  and no final state, and what it is given for each document (q, k, v, g, beta: our restated
  projections and the convolution restarted per document) equals what it is given for that
  document run alone; with transformers' own torch delta rule per document behind it, the model
  equals each document alone;
- ``auto`` logs its choice and why; an explicit ``fla`` that cannot run raises one line;
- ``varlen_causal_conv1d`` == the layer's convolution run on each document alone.
The same selection runs on a GPU with FLA installed (``gpu`` marker): the real kernels, bf16.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from unittest import mock

import model_families as mf
import pytest
import torch
import torch.nn.functional as F

import hf_varlen
from hf_varlen.integrations import linear_attention as la
from hf_varlen.integrations import linear_attention_fla as fla_path
from hf_varlen.testing import assert_numerics

ATTN = hf_varlen.ATTN_IMPLEMENTATION
FAMILIES = ["qwen3_next", "qwen3_5_text", "olmo_hybrid"]
CU = [0, 5, 12, 15]  # mf.LENGTHS


def _model(family, attn=ATTN, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    cfg = mf.tiny_config(family)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return cfg, model.eval().to(device=device, dtype=dtype)


def _refs(family, docs, device="cpu", low=torch.float32):
    """Each document alone through transformers' own model: fp64 on the CPU (with
    flash-linear-attention installed, transformers runs FLA's kernels on CUDA, which have no
    fp64), and ``low`` on ``device``."""
    refs = []
    for dtype, where in ((torch.float64, "cpu"), (low, device)):
        _, ref = _model(family, "eager", dtype, where)
        # transformers < 5.25 runs FLA whenever it is installed, also on CPU tensors (where its
        # Triton kernels cannot run): the CPU pass takes the torch rule itself
        plain = (
            mock.patch.object(
                _modeling_module(family), "torch_chunk_gated_delta_rule", _torch_rule(family)
            )
            if where == "cpu"
            else contextlib.nullcontext()
        )
        with plain, torch.no_grad():
            logits = [ref(input_ids=d[None].to(where)).logits[0] for d in docs]
        refs.append(torch.cat(logits).to(device))
    return refs


def _batch(docs, device="cpu"):
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def _modeling_module(family):
    name = {"qwen3_5_text": "qwen3_5"}.get(family, family)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _torch_rule(family):
    """transformers' own torch delta rule of the family, without its wrappers: the FLA fallback
    (``functools.wraps``, so ``__wrapped__``) inside a kernels hub layer (an ``nn.Module`` whose
    ``forward`` closes over the function it wraps). Fails loudly if that layering changes."""
    fn = _modeling_module(family).torch_chunk_gated_delta_rule
    for _ in range(4):
        if hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif isinstance(fn, torch.nn.Module):
            cells = type(fn).forward.__closure__ or ()
            fn = next(c.cell_contents for c in cells if callable(c.cell_contents))
        else:
            break
    assert inspect.isfunction(fn) and fn.__name__ == "torch_chunk_gated_delta_rule", fn
    return fn


class Recorder:
    """Stands in for FLA's chunk_gated_delta_rule: records its arguments, and computes each
    document with transformers' torch delta rule from a zero state (what FLA's varlen kernel
    computes)."""

    def __init__(self, family):
        self.rule = _torch_rule(family)
        self.calls = []

    def __call__(self, q, k, v, g, beta, **kw):
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, **kw))
        edges = kw["cu_seqlens"].tolist()
        outs = [
            self.rule(
                *(x[:, s:e] for x in (q, k, v)),
                g=g[:, s:e],
                beta=beta[:, s:e],
                initial_state=None,
                output_final_state=False,
                use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"],
            )[0]
            for s, e in zip(edges[:-1], edges[1:])
        ]
        return torch.cat(outs, dim=1), None


@pytest.fixture
def stand_in(monkeypatch):
    """Route the FLA path to a Recorder on the CPU; returns a factory taking the family."""
    monkeypatch.setattr(la, "_LOGGED", set())

    def make(family, runs_here=True):
        recorder = Recorder(family)
        monkeypatch.setattr(fla_path, "fla_chunk_gated_delta_rule", lambda: recorder)
        monkeypatch.setattr(fla_path, "fla_runs_on", lambda device: runs_here)
        return recorder

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_loop_path_equals_each_document_alone(family):
    cfg, model = _model(family)
    docs = mf._docs(cfg)
    refs = _refs(family, docs)
    assert hf_varlen.install_linear_attention(model, path="loop") >= 1
    with torch.no_grad():
        got = model(**_batch(docs)).logits[0]
    assert_numerics(f"{family} loop path", got, *refs)


@pytest.mark.parametrize("family", FAMILIES)
def test_fla_path_gives_fla_each_document_as_alone(family, stand_in):
    recorder = stand_in(family)
    cfg, model = _model(family, dtype=torch.float64)
    docs = mf._docs(cfg)
    layers = hf_varlen.install_linear_attention(model, path="fla")
    with torch.no_grad():
        packed = model(**_batch(docs)).logits[0]
    assert len(recorder.calls) == layers
    packed_calls, recorder.calls = recorder.calls, []
    for call in packed_calls:
        assert call["cu_seqlens"].dtype == torch.long and call["cu_seqlens"].tolist() == CU
        assert call["initial_state"] is None and call["output_final_state"] is False
        assert call["use_qk_l2norm_in_kernel"] is True and call["q"].shape[:2] == (1, CU[-1])
    for i, d in enumerate(docs):  # each document packed alone: what FLA gets for it
        with torch.no_grad():
            model(**_batch([d]))
        alone, recorder.calls = recorder.calls, []
        s, e = CU[i], CU[i + 1]
        for p, a in zip(packed_calls, alone, strict=True):
            for name in ("q", "k", "v", "g", "beta"):
                torch.testing.assert_close(p[name][:, s:e], a[name], msg=f"{name}, document {i}")
    refs = _refs(family, docs)
    assert_numerics(f"{family} FLA path (stand-in)", packed.float(), *refs)


def test_auto_says_which_path_it_took(stand_in, caplog, monkeypatch):
    cfg, model = _model("qwen3_5_text")
    batch = _batch(mf._docs(cfg))
    caplog.set_level(logging.INFO, logger="hf_varlen")
    hf_varlen.install_linear_attention(model)  # auto
    monkeypatch.setattr(fla_path, "fla_chunk_gated_delta_rule", lambda: None)
    with torch.no_grad():
        model(**batch)
    assert (
        "'auto' chose 'loop' for Qwen3_5GatedDeltaNet on cpu (flash-linear-attention is not "
        in (caplog.text)
    )
    recorder = stand_in("qwen3_5_text", runs_here=False)
    with torch.no_grad():
        model(**batch)
    assert "FLA's kernels run on CUDA, this batch is on cpu" in caplog.text and not recorder.calls
    stand_in("qwen3_5_text", runs_here=True)
    with torch.no_grad():
        model(**batch)
    assert "'auto' chose 'fla' for Qwen3_5GatedDeltaNet on cpu" in caplog.text


def test_explicit_fla_that_cannot_run_raises_one_line(stand_in, monkeypatch):
    cfg, model = _model("qwen3_5_text")
    batch = _batch(mf._docs(cfg))
    with pytest.raises(ValueError, match=r"path must be one of"):
        hf_varlen.install_linear_attention(model, path="triton")
    monkeypatch.setattr(fla_path, "fla_chunk_gated_delta_rule", lambda: None)
    with pytest.raises(ValueError) as exc:
        hf_varlen.install_linear_attention(model, path="fla")
    assert "\n" not in str(exc.value)
    assert "flash-linear-attention is not installed (pip install 'hf_varlen[fla]')" in str(
        exc.value
    )
    stand_in("qwen3_5_text", runs_here=False)
    hf_varlen.install_linear_attention(model, path="fla")
    with (
        pytest.raises(
            ValueError, match=r"path='fla'\): FLA's kernels run on CUDA, this batch is on cpu"
        ),
        torch.no_grad(),
    ):
        model(**batch)


def test_varlen_conv_restarts_at_each_document():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, CU[-1], generator=g, dtype=torch.float64)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=True).double()
    pos = torch.cat([torch.arange(e - s) for s, e in zip(CU[:-1], CU[1:])])
    got = fla_path.varlen_causal_conv1d(x, conv.weight, conv.bias, "silu", pos)
    want = torch.cat(
        [F.silu(conv(x[..., s:e])[..., : e - s]) for s, e in zip(CU[:-1], CU[1:])], dim=-1
    )
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_fla_kernels_packed_equal_each_document_gpu(family):
    pytest.importorskip("fla")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg, model = _model(family, dtype=torch.bfloat16, device="cuda")
    docs = mf._docs(cfg)
    refs = _refs(family, docs, "cuda", low=torch.bfloat16)
    hf_varlen.install_linear_attention(model, path="fla")
    with torch.no_grad():
        got = model(**_batch(docs, "cuda")).logits[0]
    assert_numerics(f"{family} FLA kernels", got.float(), *refs)
