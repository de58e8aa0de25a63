"""Models with attention sinks (``s_aux``) under varlen_packed, CPU fp32: a packed batch equals
each document run alone under eager (logits, loss, gradients of every parameter including the
sinks), for tiny gpt-oss- and granite_swa-shaped models with sliding and full layers; a backend
without sinks is refused by name, and "auto" skips it."""

from __future__ import annotations

import pytest
import torch
from tiny_packed import TINY, TOKENS, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

import hf_varlen
from hf_varlen.backends import BackendSpec, registry
from hf_varlen.integrations.transformers import varlen_packed_forward
from hf_varlen.testing import assert_numerics

ATTN = hf_varlen.ATTN_IMPLEMENTATION
VOCAB = TINY["vocab_size"]
LENGTHS = [5, 9, 4]
COMMON = tiny_config(
    head_dim=16,
    sliding_window=3,  # shorter than the documents: the sliding layers really slide
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    **TOKENS,
)
MODELS = {
    "gpt_oss": dict(
        COMMON,
        num_local_experts=2,
        num_experts_per_tok=2,  # every expert: no discrete routing choice between precisions
        layer_types=["sliding_attention", "full_attention"],
    ),
    "granite_swa": dict(COMMON, layer_types=["full_attention", "sliding_attention"]),
}


def _build(model_type, attn, dtype):
    cfg = AutoConfig.for_model(model_type, **MODELS[model_type])
    torch.manual_seed(0)
    # eager experts: torch's grouped matmul has no fp64 (the high-precision reference)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn, experts_implementation="eager"
    ).to(dtype)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # granite_swa starts its sinks at 0: give them weight
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    return model


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


def _nll(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum")


def _each_document_alone(model_type, dtype):
    """(logits, loss, {param: grad}) of every document run alone under eager."""
    model = _build(model_type, "eager", dtype)
    logits, loss = [], 0.0
    for d in _docs():
        out = model(input_ids=d[None], use_cache=False).logits[0]
        loss = loss + _nll(out, d)
        logits.append(out.detach())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return torch.cat(logits), loss.detach(), grads


@pytest.mark.parametrize("model_type", list(MODELS))
def test_sink_model_packed_equals_each_document_alone(model_type):
    docs = _docs()
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    model = _build(model_type, ATTN, torch.float32)
    logits = model(**batch, use_cache=False).logits[0]
    starts = [0]
    for n in LENGTHS:
        starts.append(starts[-1] + n)
    loss = sum(_nll(logits[a:b], d) for a, b, d in zip(starts[:-1], starts[1:], docs))
    loss.backward()
    hi = _each_document_alone(model_type, torch.float64)
    lo = _each_document_alone(model_type, torch.float32)
    assert_numerics(f"{model_type} logits", logits.detach(), hi[0], lo[0])
    assert_numerics(f"{model_type} loss", loss.detach(), hi[1], lo[1], terms=sum(LENGTHS))
    sinks_seen = 0
    for name, p in model.named_parameters():
        assert_numerics(f"{model_type} grad {name}", p.grad, hi[2][name], lo[2][name], factor=3)
        sinks_seen += name.endswith("sinks") and bool(p.grad.abs().sum() > 0)
    assert sinks_seen == MODELS[model_type]["num_hidden_layers"]


def _no_sinks_backend(q, k, v, metadata, params):
    return registry.get_spec("reference").fn(q, k, v, metadata, params)


@pytest.fixture
def no_sinks_backend(monkeypatch):
    """A CPU backend that does not serve sinks, first in the CPU "auto" order."""
    spec = BackendSpec(
        name="no_sinks", fn=_no_sinks_backend, description="test", requires="nothing",
        devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
    )  # fmt: skip
    monkeypatch.setitem(registry._REGISTRY, "no_sinks", spec)
    monkeypatch.setitem(registry._AUTO_ORDER, "cpu", ["no_sinks", "sdpa", "reference"])
    return spec


def test_backend_without_sinks_refused_by_name_and_skipped_by_auto(no_sinks_backend):
    q = torch.randn(1, 2, 4, 16)
    s_aux = torch.randn(2)
    module = torch.nn.Module()
    setattr(module, registry.MODEL_BACKEND_ATTR, "no_sinks")
    pattern = r"backend='no_sinks' does not support: attention sinks \(sinks / s_aux\)"
    with pytest.raises(ValueError, match=pattern):
        varlen_packed_forward(module, q, q, q, None, s_aux=s_aux)
    calls = []
    spec = registry._REGISTRY["no_sinks"]
    registry._REGISTRY["no_sinks"] = BackendSpec(
        **{**spec.__dict__, "fn": lambda *a: calls.append(1) or _no_sinks_backend(*a)}
    )
    plain = torch.nn.Module()
    varlen_packed_forward(plain, q, q, q, None)  # auto: the first backend, no sinks needed
    assert calls == [1]
    out, _ = varlen_packed_forward(plain, q, q, q, None, s_aux=s_aux)  # auto skips it
    assert calls == [1] and torch.isfinite(out).all()


def test_sink_model_padded_batch_matches_each_row_alone():
    """A left-padded 2-D mask batch (the unpadding path) with sinks: non-pad tokens as eager."""
    docs = _docs()[:2]
    width = max(len(d) for d in docs)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, width - len(d) :], mask[row, width - len(d) :] = d, 1
    with torch.no_grad():
        got = _build("gpt_oss", ATTN, torch.float32)(input_ids=ids, attention_mask=mask).logits
        got = torch.cat([got[r, width - len(d) :] for r, d in enumerate(docs)])
        refs = []
        for dtype in (torch.float64, torch.float32):
            model = _build("gpt_oss", "eager", dtype)
            refs.append(
                torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
            )
    assert_numerics("gpt_oss padded", got, refs[0], refs[1])
