"""``hf-varlen train --static-shapes`` (issue 14, item 1 in the trainer): every packed micro-batch
is padded to a rung of ``hf_varlen.bucket_ladder(token budget)`` and has ``max_documents + 2``
``cu_seq_lens`` entries. CPU, fp32, a tiny Llama, a few steps: per-step losses equal the unbucketed
run's under the numerics rule (ref_lo: unbucketed fp32; ref_hi: unbucketed fp64), at most as many
distinct shapes as the ladder has rungs, throughput and efficiency count real tokens only, and
``--compile --compile-backend aot_eager`` compiles at most twice.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from tiny_runs import tiny_train_config
from torch._dynamo.utils import counters

import hf_varlen
from hf_varlen.testing import assert_numerics
from hf_varlen.training import PackedTrainer
from hf_varlen.training.config import parse_args
from hf_varlen.training.metrics import read_log

_tiny = tiny_train_config


def _run(cfg, hook=None):
    summary = PackedTrainer(cfg, model_hook=hook).run()
    records = [r for r in read_log(cfg.output_dir) if "loss" in r]
    return torch.tensor([r["loss"] for r in records], dtype=torch.float64), summary, records


def _double(model):
    model.double()


@pytest.mark.parametrize("batching", ["budget", "batch_size"])
def test_static_shapes_losses_equal_unbucketed(tmp_path, batching):
    kw = (
        dict(tokens_per_batch=384)
        if batching == "budget"
        else dict(tokens_per_batch=None, batch_size=3)
    )
    budget = 384 if batching == "budget" else 3 * 128
    lo, plain, plain_recs = _run(_tiny(tmp_path, "lo", **kw))
    hi, _, _ = _run(_tiny(tmp_path, "hi", fused_loss="off", **kw), hook=_double)
    x, summary, records = _run(_tiny(tmp_path, "x", static_shapes=True, **kw))
    assert_numerics(f"--static-shapes losses ({batching})", x.float(), hi, lo)

    ladder = hf_varlen.bucket_ladder(budget)
    info = summary["static_shapes"]
    assert info["buckets"] == list(ladder), info
    assert 1 <= info["distinct_shapes"] <= len(ladder), info
    assert set(info["shapes"]) <= set(ladder), info
    assert all(r["tensor_tokens"] in ladder for r in records)  # grad_accum 1: one pack a step
    assert "distinct shape" in info["text"] and "padding" in info["text"]
    assert plain["static_shapes"] is None

    # Real tokens only: the same data, so the same real and label tokens, step by step.
    for a, b in zip(plain_recs, records, strict=True):
        assert a["real_tokens"] == b["real_tokens"] and a["label_tokens"] == b["label_tokens"]
        assert b["tensor_tokens"] >= b["real_tokens"]
        assert b["tokens_per_s"] == pytest.approx(b["real_tokens"] / b["step_time"])
        assert b["packing_efficiency"] == pytest.approx(b["real_tokens"] / b["tensor_tokens"])
    assert summary["real_tokens"] == plain["real_tokens"]
    held = sum(r["tensor_tokens"] for r in records)
    assert held > summary["real_tokens"]  # the buckets really pad
    assert info["extra_tokens"] == held - summary["real_tokens"]
    assert info["extra_share"] == pytest.approx(1 - summary["real_tokens"] / held)
    assert summary["packing_efficiency"] == pytest.approx(summary["real_tokens"] / held)


def test_static_shapes_fixed_cu_seq_lens_and_dummy(tmp_path):
    trainer = PackedTrainer(_tiny(tmp_path, "s", static_shapes=True))
    m = trainer.sampler.max_documents
    ladder = hf_varlen.bucket_ladder(384)
    for idx in list(trainer.sampler)[:4]:
        mb = trainer.batcher(idx)
        assert mb.inputs["cu_seq_lens_q"].shape == (m + 2,)
        assert mb.inputs["input_ids"].shape[1] in ladder
        assert mb.real_tokens == int(trainer.train_ex.lengths[idx].sum())
    dummy = trainer.batcher([])  # an empty rank slot: the smallest bucket, no label
    assert dummy.dummy and dummy.real_tokens == 0 and dummy.label_tokens == 0
    assert dummy.inputs["input_ids"].shape == (1, ladder[0])
    assert dummy.inputs["cu_seq_lens_q"].shape == (m + 2,)
    assert (dummy.inputs["labels"] == -100).all()


def test_static_shapes_flag_and_refusals(tmp_path):
    assert parse_args(["--static-shapes"]).static_shapes is True
    assert parse_args([]).static_shapes is None  # unset: follows the captured step (auto)
    assert parse_args(["--no-static-shapes"]).static_shapes is False
    with pytest.raises(ValueError, match="--static-shapes .*--padded"):
        _tiny(tmp_path, "p", static_shapes=True, padded=True).validate()
    with pytest.raises(ValueError, match="--static-shapes .*--pad-to-multiple-of"):
        _tiny(tmp_path, "m", static_shapes=True, pad_to_multiple_of=64).validate()


def test_static_shapes_compile_at_most_twice(tmp_path):
    # 2 examples of up to 256 tokens a micro-batch: packs of changing size, so several buckets
    # run (a 384-token budget fills every pack to its top rung).
    kw = dict(max_steps=6, max_length=256, tokens_per_batch=None, batch_size=2)
    lo, _, _ = _run(_tiny(tmp_path, "lo", **kw))
    hi, _, _ = _run(_tiny(tmp_path, "hi", fused_loss="off", **kw), hook=_double)
    torch._dynamo.reset()
    counters.clear()
    cfg = _tiny(tmp_path, "x", static_shapes=True, compile=True, compile_backend="aot_eager", **kw)
    x, summary, records = _run(cfg)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert len({r["tensor_tokens"] for r in records}) >= 2  # several buckets really ran
    assert 1 <= summary["compile"]["compilations"] <= 2, summary["compile"]
    assert summary["static_shapes"]["distinct_shapes"] >= 2
    assert_numerics("--static-shapes --compile losses", x.float(), hi, lo)
