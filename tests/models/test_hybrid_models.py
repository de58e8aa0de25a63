"""Hybrid models (full attention + gated DeltaNet linear attention) packed under varlen_packed.

Tiny qwen3_next / qwen3_5-shaped models (one linear-attention and one full-attention layer), CPU,
fp32. After ``hf_varlen.install_linear_attention(model)`` a PackingCollator batch equals each
document run alone under eager (numerics rule, fp64 and fp32 references): the linear-attention
layers restart their recurrent state and short convolution at every document boundary. Without
the installer, or packed by position_ids alone (which these layers never receive), the forward
raises; uninstalling restores the layers' own forward.
"""

from __future__ import annotations

import pytest
import torch
from tiny_packed import TINY, TOKENS, docs_and_batch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_varlen
from hf_varlen.integrations.linear_attention import (
    is_installed,
    is_linear_attention_layer,
    is_packed_layer,
)
from hf_varlen.testing import assert_numerics

ATTN = hf_varlen.ATTN_IMPLEMENTATION
VOCAB = TINY["vocab_size"]
LENGTHS = [5, 9, 3]
SHAPE = dict(
    TINY,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    **TOKENS,
    use_cache=False,
)
FAMILIES = {
    "qwen3_next": dict(
        SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3_5_text": SHAPE,
}


def _build(family, attn, dtype=torch.float32):
    cfg = AutoConfig.for_model(family, **FAMILIES[family])
    cfg._experts_implementation = "eager"  # fp64 references
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval().to(dtype)


def _docs_and_batch():
    return docs_and_batch(LENGTHS, VOCAB)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_hybrid_equals_each_document(family):
    docs, batch = _docs_and_batch()
    refs = []
    for dtype in (torch.float64, torch.float32):
        ref = _build(family, "eager", dtype)
        with torch.no_grad():
            refs.append(torch.cat([ref(input_ids=d[None]).logits[0] for d in docs]))
    model = _build(family, ATTN)
    assert hf_varlen.install_linear_attention(model) == 1
    assert hf_varlen.install_linear_attention(model) == 1  # idempotent
    with torch.no_grad():
        got = model(**batch).logits[0]
    assert_numerics(f"{family} packed by the collator", got, *refs)


def test_hybrid_refusals_and_uninstall():
    docs, batch = _docs_and_batch()
    model = _build("qwen3_5_text", ATTN)
    layer = next(m for m in model.modules() if is_linear_attention_layer(m))
    # not installed: transformers' torch fallback refuses offsets it cannot honour, else ours
    with (
        pytest.raises(ValueError, match=r"packed sequences apart|install_linear_attention"),
        torch.no_grad(),
    ):
        model(**batch)
    hf_varlen.install_linear_attention(model)
    assert is_packed_layer(layer) and is_installed(model.config)
    ids, pos = batch["input_ids"], batch["position_ids"]
    with pytest.raises(ValueError, match=r"position_ids alone.*cu_seq_lens_q/k"), torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    with pytest.raises(ValueError, match=r"use_cache=False"), torch.no_grad():
        model(**batch, use_cache=True)
    assert hf_varlen.uninstall_linear_attention(model) == 1
    assert not is_packed_layer(layer) and not is_installed(model.config)
    # position_ids alone, uninstalled: refused for the installer first
    with pytest.raises(ValueError, match=r"install_linear_attention"), torch.no_grad():
        model(input_ids=ids, position_ids=pos)


def test_install_survives_transformers_rekernelizing(tmp_path):
    """transformers >= 5.25 loads kernelized by default and re-kernelizes on train() / eval(),
    which drops instance forwards of these layers: the install must still hold afterwards."""
    docs, batch = _docs_and_batch()
    refs = []
    for dtype in (torch.float64, torch.float32):
        ref = _build("qwen3_5_text", "eager", dtype)
        with torch.no_grad():
            refs.append(torch.cat([ref(input_ids=d[None]).logits[0] for d in docs]))
    _build("qwen3_5_text", ATTN).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTN)
    hf_varlen.install_linear_attention(model)
    model.train()
    model.eval()
    layer = next(m for m in model.modules() if is_linear_attention_layer(m))
    assert is_packed_layer(layer) and type(layer).__name__ == "Qwen3_5GatedDeltaNet"
    with torch.no_grad():
        got = model(**batch).logits[0]
    assert_numerics("qwen3_5 packed after train() / eval()", got, *refs)
