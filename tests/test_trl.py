"""TRL 1.16 SFTTrainer with attn_implementation="varlen_packed" (examples/trl_sft.py).

One optimizer step over the same alpaca examples (lr 0, so the model is the same in every run) in
each mode: padding-free with TRL's cu_seq_lens kwargs, padding-free with position_ids only (the
TRL <= 1.15 input), bfd packing, and the unpacked padded reference with sdpa. The per-token loss and
the gradient norm must agree, and a spy on the attention function checks that the packed modes
really reached varlen_packed with one document per example.

TRL's own defaults (bf16=True mixed precision over fp32 weights, gradient checkpointing on) run
too, on CPU bf16 autocast: RoPE hands the attention function fp32 q and k with a bf16 v there, and
varlen_packed must cast them to one dtype as transformers' FlashAttention path does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from transformers import AutoTokenizer  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import hf_varlen  # noqa: E402
from hf_varlen.testing import assert_numerics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_EXAMPLES = 6


def _example_module():
    spec = importlib.util.spec_from_file_location("trl_sft", ROOT / "examples" / "trl_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def setup(shared_data):
    tok_dir = shared_data("tokenizers", "qwen2")
    alpaca = shared_data("alpaca", "alpaca_5000.json")
    ex = _example_module()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    data = ex.alpaca_dataset(str(alpaca), 64)
    # The shortest responses keep TRL's (tokens x 151k vocab) head cheap on CPU.
    order = sorted(range(len(data)), key=lambda i: len(data[i]["prompt"] + data[i]["completion"]))
    return ex, tokenizer, data.select(order[:N_EXAMPLES])


def _one_step(setup, mode, tmp_path, monkeypatch, max_steps=1, attn=None, **config):
    """(first-step loss, first-step grad norm, attention calls seen, losses of every step).

    ``attn`` overrides the example's choice of attention implementation for ``mode``."""
    ex, tokenizer, data = setup
    seen: list[dict] = []
    inner = ALL_ATTENTION_FUNCTIONS[hf_varlen.ATTN_IMPLEMENTATION]

    def spy(module, q, k, v, mask, **kwargs):
        out = inner(module, q, k, v, mask, **kwargs)
        seen.append(
            {
                "cu": kwargs.get("cu_seq_lens_q"),
                "pos": kwargs.get("position_ids"),
                "dtypes": (q.dtype, k.dtype, v.dtype),
                "out": out[0].dtype,
            }
        )
        return out

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, hf_varlen.ATTN_IMPLEMENTATION, spy)
    if attn is None:
        model = ex.load_model("tiny-llama", tokenizer, mode, seed=0)
    else:
        model = ex.tiny_llama(len(tokenizer), attn, seed=0)
    trainer = ex.make_trainer(
        model,
        tokenizer,
        data,
        mode,
        str(tmp_path / f"{mode}-{attn}"),
        per_device_train_batch_size=N_EXAMPLES,
        max_steps=max_steps,
        learning_rate=0.0,
        seed=0,
        **config,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = [float(h["loss"]) for h in logs]
    return losses[0], float(logs[0]["grad_norm"]), seen, losses


@pytest.mark.slow
def test_trl_packed_modes_match_unpacked(setup, tmp_path, monkeypatch):
    # fp32 throughout (make_trainer keeps SFTConfig's bf16=True default otherwise)
    ref_loss, ref_norm, ref_seen, _ = _one_step(setup, "padded", tmp_path, monkeypatch, bf16=False)
    assert not ref_seen  # the reference runs sdpa, not varlen_packed
    for mode in ("padding_free", "position_ids", "bfd"):
        loss, norm, seen, _ = _one_step(setup, mode, tmp_path, monkeypatch, bf16=False)
        assert seen, f"{mode}: varlen_packed was never called"
        call = seen[0]
        if mode == "position_ids":
            assert call["cu"] is None and call["pos"] is not None
            starts = int((call["pos"][0] == 0).sum())
            assert starts == N_EXAMPLES, f"{mode}: {starts} documents in the packed row"
        else:
            assert call["cu"] is not None and call["cu"].dtype == torch.int32
            assert call["cu"].numel() - 1 == N_EXAMPLES, f"{mode}: cu_seq_lens {call['cu']}"
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"{mode}: loss {loss} vs {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"{mode}: grad norm {norm} vs {ref_norm}"


@pytest.mark.slow
def test_trl_defaults_bf16_gradient_checkpointing(setup, tmp_path, monkeypatch):
    """TRL's default mixed precision (bf16=True over fp32 weights, gradient checkpointing on) in the
    padding-free and bfd modes, on CPU bf16 autocast (CUDA autocast on a GPU): the attention
    function gets fp32 q/k with a bf16 v, runs in bf16, and the loss and gradient norm follow the
    numerics rule against the fp32 padded run (ref_hi) and the bf16 padded sdpa run (ref_lo)."""
    defaults = dict(bf16=True, gradient_checkpointing=True)  # SFTConfig's own defaults
    hi_loss, hi_norm, _, _ = _one_step(setup, "padded", tmp_path, monkeypatch, bf16=False)
    lo_loss, lo_norm, _, _ = _one_step(setup, "padded", tmp_path, monkeypatch, **defaults)
    assert lo_loss != hi_loss  # bf16 autocast really ran
    for mode in ("padding_free", "bfd"):
        loss, norm, seen, losses = _one_step(
            setup, mode, tmp_path, monkeypatch, max_steps=2, **defaults
        )
        assert seen, f"{mode}: varlen_packed was never called"
        mixed = {c["dtypes"] for c in seen}
        assert (torch.float32, torch.float32, torch.bfloat16) in mixed, f"{mode}: {mixed}"
        assert {c["out"] for c in seen} == {torch.bfloat16}, f"{mode}: output dtypes"
        assert all(torch.isfinite(torch.tensor(losses))), f"{mode}: losses {losses}"
        t = torch.tensor
        assert_numerics(f"{mode} bf16 loss", t(loss), t(hi_loss, dtype=torch.float64), t(lo_loss))
        assert_numerics(
            f"{mode} bf16 grad norm", t(norm), t(hi_norm, dtype=torch.float64), t(lo_norm), factor=3
        )


@pytest.mark.slow
def test_trl_wrapped_packing_bf16_matches_sdpa(setup, tmp_path, monkeypatch):
    """packing_strategy="wrapped" (fixed-length rows cut across examples, no padding-free kwargs:
    each row is one sequence) under TRL's bf16 defaults: varlen_packed == sdpa on the same rows."""
    cfg = dict(packing_strategy="wrapped", max_length=48, gradient_checkpointing=True)
    hi = _one_step(setup, "bfd", tmp_path, monkeypatch, attn="sdpa", bf16=False, **cfg)
    lo = _one_step(setup, "bfd", tmp_path, monkeypatch, attn="sdpa", bf16=True, **cfg)
    x = _one_step(
        setup, "bfd", tmp_path, monkeypatch, attn=hf_varlen.ATTN_IMPLEMENTATION, bf16=True, **cfg
    )
    seen = x[2]
    assert seen and all(c["cu"] is None for c in seen), "wrapped rows carry no packed kwargs"
    t = torch.tensor
    assert_numerics("wrapped bf16 loss", t(x[0]), t(hi[0], dtype=torch.float64), t(lo[0]))
    assert_numerics(
        "wrapped bf16 grad norm", t(x[1]), t(hi[1], dtype=torch.float64), t(lo[1]), factor=3
    )
