"""Loud where varlen_packed cannot be right (real transformers model classes, tiny configs, CPU).
(Attention sinks, gpt-oss's s_aux, are served now: tests/models/test_sink_models.py.)

- a model whose attention needs a 4-D mask (DSA indexer: deepseek_v32, glm_moe_dsa) or that does
  not use transformers' attention interface (bloom, xglm, mpt; codegen, falcon and gptj up to
  transformers 5.24): the first forward raises from the mask function, before any layer runs;
  ``check_model`` says the same without a forward. Classes a later transformers moves onto the
  interface must then be exact (packed = each document alone);
- models that never pass position_ids to their attention layers (persimmon, cohere_compass;
  ministral3 up to 5.24): a batch packed by position_ids alone raises, pointing at the collator
  kwargs; the same batch with cu_seq_lens kwargs equals each document run alone.
"""

from __future__ import annotations

import re

import pytest
import torch
from tiny_packed import TOKENS, docs_and_batch, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.cohere_compass.configuration_cohere_compass import (
    CohereCompassTextConfig,
)
from transformers.models.cohere_compass.modeling_cohere_compass import CohereCompassForCausalLM

import hf_varlen
from hf_varlen.integrations.transformers import _unsupported_reason, check_model
from hf_varlen.testing import assert_numerics

ATTN = hf_varlen.ATTN_IMPLEMENTATION
VOCAB = 97
LLAMA_LIKE = tiny_config(vocab_size=VOCAB, **TOKENS)
LEGACY = {
    "bloom": dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
    "codegen": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
    "xglm": dict(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64),
    "mpt": dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4),
}
DSA = {
    "deepseek_v32": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
    ),
}


def _ids(n=8):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(0))


def _tiny(model_type, **kw):
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN).eval()


def _uses_attention_interface(model) -> bool:
    # transformers moves legacy classes onto its attention interface release by release (5.25:
    # codegen, falcon, gptj), and some keep a stale False class flag (5.25's falcon); the tests
    # follow hf_varlen's reading of the installed release (the flag, or a modeling file that
    # dispatches through ALL_ATTENTION_FUNCTIONS), and such a class must then be exact
    cls = model if isinstance(model, type) else type(model)
    return _unsupported_reason(cls) is None


def _docs_and_batch():
    return docs_and_batch(LENGTHS, VOCAB)


def _each_document_alone(build, docs) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo): the logits of each document run alone under eager, in fp64 and in fp32, from the
    weights ``build(attn)`` makes after seed 0 (the numerics rule's references)."""
    refs = []
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(0)
        ref = build("eager").eval().to(dtype)
        with torch.no_grad():
            refs.append(
                torch.cat([ref(input_ids=d[None], use_cache=False).logits[0] for d in docs])
            )
    return refs[0], refs[1]


def _packed_matches_each_document(name, build) -> None:
    """``build(attn)`` -> model: a PackingCollator batch under varlen_packed equals each document
    run alone under eager, and so does the same batch packed by position_ids alone."""
    docs, batch = _docs_and_batch()
    hi, lo = _each_document_alone(build, docs)
    torch.manual_seed(0)
    model = build(ATTN).eval()
    with torch.no_grad():
        got = model(**batch, use_cache=False).logits[0]
        assert_numerics(f"{name} packed by the collator", got, hi, lo)
        ids, pos = batch["input_ids"], batch["position_ids"]
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        assert_numerics(f"{name} packed by position_ids", got, hi, lo)


@pytest.mark.parametrize("model_type", list(LEGACY))
def test_legacy_attention_classes_refused_at_first_forward(model_type):
    """Refused while the class keeps its own attention; exact once transformers moves it."""
    model = _tiny(model_type, **LEGACY[model_type])  # loads: transformers checks only the name
    if _uses_attention_interface(model):
        check_model(model)
        _packed_matches_each_document(model_type, _auto(model_type, **LEGACY[model_type]))
        return
    pattern = rf"cannot serve model_type='{model_type}'.*AttentionInterface.*'sdpa' or 'eager'"
    with pytest.raises(ValueError, match=pattern):
        check_model(model)
    with pytest.raises(ValueError, match=pattern), torch.no_grad():
        model(input_ids=_ids())


@pytest.mark.parametrize("model_type", list(DSA))
def test_models_needing_a_4d_mask_refused_at_first_forward(model_type):
    model = _tiny(model_type, **DSA[model_type])
    pattern = rf"cannot serve model_type='{model_type}'.*_supports_flash_attn = False.*4-D mask"
    with pytest.raises(ValueError, match=pattern):
        check_model(model)
    with pytest.raises(ValueError, match=pattern), torch.no_grad():
        model(input_ids=_ids())


@pytest.mark.parametrize("model_type", ["falcon", "gptj"])
def test_legacy_classes_that_pick_an_attention_class_by_name_fail_at_load(model_type):
    """falcon / gptj indexed their own attention-class table by the name (loud already at load)
    until transformers moved them onto its attention interface (5.25); then they are exact."""
    kw = {
        "falcon": dict(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
        ),
        "gptj": dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, rotary_dim=4),
    }[model_type]
    cls = type(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)))
    if not _uses_attention_interface(cls):
        # refused either way: at load by the class's own table (transformers <= 5.24), or by
        # check_model from the class flag (5.25's falcon calls the interface but keeps the flag)
        try:
            model = _tiny(model_type, **kw)
        except KeyError as exc:
            assert ATTN in str(exc)
            return
        with pytest.raises(ValueError, match=rf"cannot serve model_type='{model_type}'"):
            check_model(model)
        return
    check_model(_tiny(model_type, **kw))
    _packed_matches_each_document(model_type, _auto(model_type, **kw))


def test_supported_model_passes_check_model():
    check_model(_tiny("llama", **LLAMA_LIKE))


def _compass_text(attn):
    # a text LM class reachable only directly: its auto entry is the multimodal model
    cfg = CohereCompassTextConfig(
        **LLAMA_LIKE,
        sliding_window=64,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [4, 2, 2],
            }
        },
    )
    return CohereCompassForCausalLM._from_config(cfg, attn_implementation=attn)


def _auto(model_type, **kw):
    return lambda attn: AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **kw), attn_implementation=attn
    )


# Their attention layers take position_ids as a named argument and do not pass it on.
NO_POSITIONS = {
    "ministral3": _auto("ministral3", **LLAMA_LIKE, head_dim=16),
    "persimmon": _auto(
        "persimmon", **{k: v for k, v in LLAMA_LIKE.items() if k != "num_key_value_heads"}
    ),
    "cohere_compass": _compass_text,
}
LENGTHS = [5, 7, 4]


def _build(kind, attn):
    torch.manual_seed(0)
    return NO_POSITIONS[kind](attn).eval()


@pytest.mark.parametrize("kind", list(NO_POSITIONS))
def test_dropped_position_ids_of_a_packed_batch_raise(kind):
    """Where the installed transformers' attention layer drops position_ids the packed-by-position
    batch raises; where it passes them on (ministral3 from 5.25) it is exact: never silently
    wrong."""
    model = _build(kind, ATTN)
    docs, batch = _docs_and_batch()
    ids, pos = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        # use_cache=False, as every trainer runs packed batches: with a cache transformers does
        # not look for packed position_ids (nor can we), for any model and attention
        try:
            model(input_ids=ids, position_ids=pos, use_cache=False)
        except ValueError as exc:
            assert re.search(r"does not receive position_ids.*PackingCollator", str(exc)), exc
        else:  # the layers pass position_ids on: the batch must then be exact
            _packed_matches_each_document(kind, NO_POSITIONS[kind])
            return
        # the documented fix: the collator's document offsets reach every attention layer
        got = model(**batch).logits[0]
        hi, lo = _each_document_alone(NO_POSITIONS[kind], docs)
        assert_numerics(f"{kind} packed by the collator", got, hi, lo)
        # one unpacked sequence, a padded batch and plain decoding raise nothing
        model(input_ids=ids, use_cache=False)
        model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 5:] = 0
        model(input_ids=_ids(8).expand(2, 8), attention_mask=mask)
        model.generate(input_ids=docs[0][None], max_new_tokens=3, do_sample=False)


def test_config_fields_transformers_refuses_for_flash_are_refused():
    """ALiBi (falcon) needs a position bias in the mask: refused as transformers refuses it for
    FlashAttention, while the same class without it runs (hrm_text's config.prefix_lm=True, the
    other such field, is refused in tests/models/test_all_families.py's sweep)."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    model = _tiny("falcon", **kw, alibi=True)
    with pytest.raises(ValueError, match=r"model_type='falcon'.*config.alibi=True.*'sdpa'"):
        check_model(model)
    with pytest.raises(ValueError, match=r"config.alibi=True"), torch.no_grad():
        model(input_ids=_ids())
    check_model(_tiny("falcon", **kw, alibi=False))
