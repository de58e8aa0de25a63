"""``generate(..., cache_implementation="static")`` under varlen_packed equals eager (tiny Llama,
greedy, scores under the numerics rule), unpadded and left-padded batches. A static cache hands
the attention function all of its slots; the empty ones must never count as keys."""

from __future__ import annotations

import pytest
import torch
from tiny_packed import TOKENS, tiny_config
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_varlen
from hf_varlen.testing import assert_numerics

CFG = tiny_config(**TOKENS)


def _generate(attn, dtype, ids, mask, cache):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG), attn_implementation=attn)
    model = model.to(dtype).eval()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation=cache,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("padded", [False, True])
def test_generation_matches_eager(cache, padded):
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :2] = 0
        ids[1, :2] = 0
    # fp64 reference: each row alone, unpadded (eager fp64 turns its fully masked pad rows into
    # NaN); the low-precision one is eager's own fp32 batch
    rows = [
        _generate("eager", torch.float64, r[m.bool()][None], None, cache) for r, m in zip(ids, mask)
    ]
    hi = torch.cat([s for _, s in rows], dim=1)
    seq_hi = torch.stack([s[0, -5:] for s, _ in rows])
    seq_lo, lo = _generate("eager", torch.float32, ids, mask, cache)
    seq_lo = seq_lo[:, -5:]
    seq, got = _generate(hf_varlen.ATTN_IMPLEMENTATION, torch.float32, ids, mask, cache)
    seq = seq[:, -5:]  # the new tokens
    assert torch.equal(seq_lo, seq_hi)  # the data leave no near-tie for greedy decoding
    assert torch.equal(seq, seq_hi)
    assert_numerics(f"{cache} padded={padded} scores", got, hi, lo)
