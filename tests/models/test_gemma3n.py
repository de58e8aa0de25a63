"""Gemma 3n under varlen_packed: the "inference equivalence" mismatch is the padding token.

transformers' inference-equivalence check compares ``hidden_states[-1]`` of a left-padded batch
with eager's. Gemma 3n's last hidden state stacks its AltUp streams, (altup_num_inputs, B, T, H), and
at the padding position eager's fully-masked softmax spreads uniformly over the row while sdpa and
varlen_packed (FlashAttention's contract) give that query no keys: the padding token differs by
~6 there, sdpa as much as varlen_packed, while every real token agrees. A tiny gemma3n_text (KV
sharing, AltUp, LAuReL, per-layer inputs, activation sparsity), CPU: real tokens == eager (numerics
rule, all AltUp streams), the padding position == sdpa's.
"""

from __future__ import annotations

import model_families as mf
import torch
from transformers import AutoConfig

from hf_varlen.testing import assert_numerics

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _config():
    d = mf._shrink(AutoConfig.for_model("gemma3n_text").to_dict())
    d.update(num_hidden_layers=4, layer_types=LAYERS, intermediate_size=[96] * 4)
    d.update(num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0])
    cfg = type(AutoConfig.for_model("gemma3n_text")).from_dict(d)
    cfg.use_cache = True  # the shared layers read the cache, as in transformers' test
    return cfg


def _last_hidden(model, ids, mask=None, **kw):
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True, **kw)
    return out.hidden_states[-1]  # (altup_num_inputs, B, T, H)


def test_left_padded_gemma3n_real_tokens_equal_eager_padding_equals_sdpa():
    cfg = _config()
    ids = torch.randint(3, mf.VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :1] = 0  # left padding, as transformers' check makes it
    got = _last_hidden(mf._build(cfg, mf.ATTN), ids, mask)
    # fp64 reference: each row's real tokens alone at their padded positions (eager's fp64
    # padded run puts NaN in the fully-masked padding row, which the real tokens then read at
    # weight 0)
    positions = torch.arange(1, ids.shape[1])[None]
    eager64 = mf._build(cfg, "eager", torch.float64)
    hi = torch.cat([_last_hidden(eager64, r[None, 1:], position_ids=positions) for r in ids], dim=1)
    lo = _last_hidden(mf._build(cfg, "eager"), ids, mask)
    assert got.shape[0] == cfg.altup_num_inputs and got.shape[-2] == ids.shape[1]
    assert_numerics("gemma3n real tokens", got[..., 1:, :], hi, lo[..., 1:, :])
    sdpa = _last_hidden(mf._build(cfg, "sdpa"), ids, mask)
    pad_gap = (lo[..., :1, :] - sdpa[..., :1, :]).abs().max()
    assert pad_gap > 1.0  # eager's padding token is not what sdpa (or FlashAttention) gives
    sdpa_hi = _last_hidden(mf._build(cfg, "sdpa", torch.float64), ids, mask)
    assert_numerics(
        "gemma3n padding token vs sdpa", got[..., :1, :], sdpa_hi[..., :1, :], sdpa[..., :1, :]
    )
