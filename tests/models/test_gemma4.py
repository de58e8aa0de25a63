"""Gemma 4 under varlen_packed (tiny random configs, CPU, fp32) against eager, each document alone.

From transformers 5.25 ``Gemma4TextModel._maybe_slice_kv_shared_inputs`` runs the KV-shared layers
on the last ``logits_to_keep`` positions only and slices every mask as 4-D (``[:, :, -n:, :]``)
unless the implementation name contains "flash" or is flex: our mask function hands the padding
mask on as (B, 1, 1, K), which survives that slice. Checked: a packed batch (collator kwargs and
position_ids alone), a left- and a right-padded batch (all logits, and ``logits_to_keep=1`` as
``generate`` uses it), and greedy generation.
"""

from __future__ import annotations

import pytest
import torch
from tiny_packed import TINY, TOKENS, padded
from transformers import AutoConfig, AutoModelForCausalLM

import hf_varlen
from hf_varlen.testing import assert_numerics

ATTN = hf_varlen.ATTN_IMPLEMENTATION
VOCAB = TINY["vocab_size"]
LENGTHS = [5, 8, 3]
GEMMA4 = dict(
    TINY,
    num_hidden_layers=4,
    head_dim=16,
    global_head_dim=16,
    num_kv_shared_layers=2,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    **TOKENS,
)


def _build(attn, dtype=torch.float32):
    cfg = AutoConfig.for_model("gemma4_text", **GEMMA4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.eval().to(dtype)


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


@pytest.fixture(scope="module")
def refs():
    """(hi, lo) per document: eager logits of each document alone, fp64 and fp32."""
    docs = _docs()
    out = []
    for dtype in (torch.float64, torch.float32):
        model = _build("eager", dtype)
        with torch.no_grad():
            out.append([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    return docs, out[0], out[1]


@pytest.fixture(scope="module")
def model():
    return _build(ATTN)


def test_gemma4_packed_equals_each_document(refs, model):
    docs, hi, lo = refs
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    hi, lo = torch.cat(hi), torch.cat(lo)
    with torch.no_grad():
        got = model(**batch, use_cache=False).logits[0]
        assert_numerics("gemma4 packed by the collator", got, hi, lo)
        got = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits[0]
        assert_numerics("gemma4 packed by position_ids", got, hi, lo)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gemma4_padded_batch_equals_each_document(refs, model, side):
    docs, hi, lo = refs
    ids, mask, spans = padded(docs, side)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        last = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    for i, span in enumerate(spans):
        assert_numerics(f"gemma4 {side}-padded row {i}", full[i, span], hi[i], lo[i])
        if side == "left":  # the last position is each row's last real token
            assert_numerics(
                f"gemma4 {side}-padded row {i}, logits_to_keep=1", last[i], hi[i][-1:], lo[i][-1:]
            )


def test_gemma4_left_padded_generation_equals_eager(model):
    ids, mask, _ = padded(_docs(), "left")
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = _build("eager").generate(ids, **kw)
    got = model.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)
