"""transformers' FlashAttention-2 model checks, restated for attn_implementation="varlen_packed".

Written from the published behaviour of transformers' FA2 test-suite (not its code), for the nine
families it was run on: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Phi3, Granite, OLMo2. Tiny
random configs, CPU, fp32, against the ``eager`` implementation of the same weights:

- padding-free with position_ids: a right-padded batch through eager with its attention_mask ==
  the same real tokens flattened to one row with restarting position_ids (and nothing else);
- padding-free with FlashAttention kwargs: the same, the row built by transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (cu_seq_lens_q/k, max_length_q/k);
- inference equivalence: one batch without padding, left-padded and right-padded, through both
  implementations (logits and last hidden state on real tokens);
- continue generation: prefill with explicit position_ids and a cache, then decode steps that pass
  only the next position; every step's logits and greedy token == eager's, and == one uncached
  forward over the whole sequence;
- eager vs generate: greedy ``generate`` on a left-padded batch gives the same tokens.

Tolerances are the peers': ``finfo(bfloat16).eps`` (atol and rtol) for the padding-free and
continue-generation logits, 4e-2 for inference equivalence, exact tokens for generation.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_packed import TINY, TOKENS, family_config, tiny_config
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    GemmaConfig,
    GraniteConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
)

import hf_varlen

VOCAB = TINY["vocab_size"]
PAD = TOKENS["pad_token_id"]
COMMON = tiny_config(**TOKENS)
CONFIGS = {
    "llama": functools.partial(family_config, "llama", **TOKENS),
    "mistral": functools.partial(family_config, "mistral", **TOKENS),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": functools.partial(family_config, "qwen3", **TOKENS),
    "gemma": lambda: GemmaConfig(**COMMON, head_dim=16),
    "gemma2": functools.partial(family_config, "gemma2", **TOKENS),
    "phi3": lambda: Phi3Config(**COMMON),
    "granite": lambda: GraniteConfig(
        **COMMON,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
    ),
    "olmo2": lambda: Olmo2Config(**COMMON),
}
FAMILIES = list(CONFIGS)
LENGTHS = [9, 6, 4]  # one row per example; 9 = the padded width
PADFREE_TOL = torch.finfo(torch.bfloat16).eps
EQUIVALENCE_TOL = 4e-2


@functools.cache
def _model(kind, attn):
    """The same random weights under either implementation (eval mode, fp32; not mutated)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation=attn)
    return model.eval()


def _examples():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


def _padded(side):
    """(input_ids, attention_mask) of the examples padded on ``side`` ("left", "right", "none")."""
    docs = _examples()
    if side == "none":  # every example extended to the full width
        g = torch.Generator().manual_seed(2)
        width = max(LENGTHS)
        docs = [
            torch.cat([d, torch.randint(3, VOCAB, (width - len(d),), generator=g)]) for d in docs
        ]
    width = max(len(d) for d in docs)
    ids = torch.full((len(docs), width), PAD)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        sl = slice(width - len(d), width) if side == "left" else slice(0, len(d))
        ids[i, sl], mask[i, sl] = d, 1
    return ids, mask


@torch.no_grad()
def _forward(kind, attn, **inputs):
    return _model(kind, attn)(**inputs, use_cache=False, output_hidden_states=True)


@pytest.mark.parametrize("style", ["position_ids", "fa_kwargs"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_padding_free_matches_padded_eager(kind, style):
    ids, mask = _padded("right")
    ref = _forward(kind, "eager", input_ids=ids, attention_mask=mask).logits[mask.bool()]
    docs = [row[m.bool()] for row, m in zip(ids, mask)]
    if style == "position_ids":
        inputs = dict(
            input_ids=torch.cat(docs)[None],
            position_ids=torch.cat([torch.arange(len(d)) for d in docs])[None],
        )
    else:
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": d.tolist()} for d in docs]
        )
        batch.pop("labels")
        assert "cu_seq_lens_q" in batch and "max_length_k" in batch
        inputs = batch
    got = _forward(kind, hf_varlen.ATTN_IMPLEMENTATION, **inputs).logits[0]
    torch.testing.assert_close(got, ref, atol=PADFREE_TOL, rtol=PADFREE_TOL)


@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_inference_equivalence_with_eager(kind, side):
    ids, mask = _padded(side)
    ref = _forward(kind, "eager", input_ids=ids, attention_mask=mask)
    got = _forward(kind, hf_varlen.ATTN_IMPLEMENTATION, input_ids=ids, attention_mask=mask)
    real = mask.bool()
    for name, g, r in (
        ("logits", got.logits, ref.logits),
        ("last hidden state", got.hidden_states[-1], ref.hidden_states[-1]),
    ):
        torch.testing.assert_close(
            g[real],
            r[real],
            atol=EQUIVALENCE_TOL,
            rtol=EQUIVALENCE_TOL,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@torch.no_grad()
def _continue(model, prompt, steps):
    """Prefill with position_ids and a cache, then decode feeding only the next position."""
    pos = torch.arange(prompt.shape[1])[None]
    out = model(input_ids=prompt, position_ids=pos, use_cache=True)
    cache, logits = out.past_key_values, [out.logits[:, -1]]
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(steps):
        pos = pos[:, -1:] + 1
        out = model(input_ids=tokens[-1][:, None], position_ids=pos, past_key_values=cache)
        cache = out.past_key_values
        logits.append(out.logits[:, -1])
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(logits, 1), torch.stack(tokens, 1)


@pytest.mark.parametrize("kind", FAMILIES)
def test_continue_generate_with_position_ids(kind):
    prompt = _examples()[0][None]
    got_logits, got_tokens = _continue(_model(kind, hf_varlen.ATTN_IMPLEMENTATION), prompt, 4)
    ref_logits, ref_tokens = _continue(_model(kind, "eager"), prompt, 4)
    assert torch.equal(got_tokens, ref_tokens)
    torch.testing.assert_close(got_logits, ref_logits, atol=PADFREE_TOL, rtol=PADFREE_TOL)
    # the cached steps == one uncached forward over prompt + generated tokens
    full = torch.cat([prompt, got_tokens[:, :-1]], 1)
    whole = _forward(kind, hf_varlen.ATTN_IMPLEMENTATION, input_ids=full).logits
    torch.testing.assert_close(
        got_logits, whole[:, prompt.shape[1] - 1 :], atol=PADFREE_TOL, rtol=PADFREE_TOL
    )


@pytest.mark.parametrize("kind", FAMILIES)
def test_generate_left_padded_matches_eager(kind):
    ids, mask = _padded("left")
    outs = [
        _model(kind, attn).generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD
        )
        for attn in (hf_varlen.ATTN_IMPLEMENTATION, "eager")
    ]
    assert torch.equal(outs[0], outs[1])
