"""torch.compile where users turn it on (issue 13, item 6): ``hf-varlen train --compile``, HF
``Trainer(torch_compile=True)`` with ``PackingCollator``, TRL ``SFTTrainer(padding_free=True,
torch_compile=True)``; tiny Llama with ``attn_implementation="varlen_packed"`` on CPU.

The compile backend is ``aot_eager`` (``--compile-backend`` / ``torch_compile_backend``): it traces
forward and backward as Inductor would get them, without generating code. Each run: per-step losses
equal the eager run's under the numerics rule (ref_lo: eager fp32; ref_hi: eager fp64), no graph
break (``torch._dynamo.utils.counters["graph_break"]`` empty), and for ``hf-varlen train`` at most
2 compilations over the run (its batches are marked dynamic; the HF / TRL trainers do not mark them
and rely on automatic dynamic shapes, so their count is reported, not bounded).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from hf_varlen.testing import assert_numerics
from hf_varlen.training import PackedTrainer, TrainConfig
from hf_varlen.training.compiling import CompileError
from hf_varlen.training.config import parse_args


def _tiny(tmp_path, name, **overrides) -> TrainConfig:
    base = dict(
        output_dir=str(tmp_path / name),
        builtin_examples=64,
        max_length=128,
        tokens_per_batch=384,
        max_steps=6,
        progress=False,
        save_final=False,
    )
    return TrainConfig(**{**base, **overrides})


def _fresh():
    torch._dynamo.reset()
    counters.clear()


def _losses(cfg, hook=None):
    summary = PackedTrainer(cfg, model_hook=hook).run()
    from hf_varlen.training.metrics import read_log

    records = [r for r in read_log(cfg.output_dir) if "loss" in r]
    return torch.tensor([r["loss"] for r in records], dtype=torch.float64), summary, records


def _double(model):
    model.double()


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
def test_train_compile_equals_eager_without_recompiles(tmp_path, padded):
    """6 steps of packs with changing token and document counts (padded: changing [B, L])."""
    kw = dict(padded=padded)
    lo, _, _ = _losses(_tiny(tmp_path, "lo", **kw))
    # fp64 reference: transformers' cross-entropy (the fused loss takes fp16/bf16/fp32)
    hi, _, _ = _losses(_tiny(tmp_path, "hi", fused_loss="off", **kw), hook=_double)
    _fresh()
    cfg = _tiny(tmp_path, "x", compile=True, compile_backend="aot_eager", **kw)
    x, summary, records = _losses(cfg)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert len({r["tensor_tokens"] for r in records}) >= 2  # the batches really change shape
    info = summary["compile"]
    assert 1 <= info["compilations"] <= 2, info
    assert info["compiled_steps"][0] == 1 and info["backend"] == "aot_eager", info
    assert info["first_step_s"] > info["later_step_s"] > 0, info
    assert "compilation(s)" in info["text"]
    assert_numerics(f"--compile losses ({'padded' if padded else 'packed'})", x.float(), hi, lo)


def test_train_compile_flags_and_refusals(tmp_path):
    cfg = parse_args(["--compile", "--compile-backend", "aot_eager"])
    assert cfg.compile is True and cfg.compile_backend == "aot_eager"
    assert parse_args([]).compile is False
    with pytest.raises(ValueError, match="--compile-backend 'aot_eager' applies only with"):
        PackedTrainer(_tiny(tmp_path, "a", compile_backend="aot_eager"))
    with pytest.raises(ValueError, match="--compile-backend 'no_such_backend': not a torch"):
        PackedTrainer(_tiny(tmp_path, "b", compile=True, compile_backend="no_such_backend"))


def test_train_compile_failure_raises_with_the_reason(tmp_path):
    """A compile that fails is an error naming the reason, never a silent eager run."""
    from torch._dynamo import register_backend

    @register_backend(name="hf_varlen_test_failing")
    def failing(gm, example_inputs):
        raise RuntimeError("this backend refuses every graph")

    _fresh()
    cfg = _tiny(tmp_path, "f", compile=True, compile_backend="hf_varlen_test_failing", max_steps=2)
    trainer = PackedTrainer(cfg)
    with pytest.raises(CompileError, match="this backend refuses every graph") as info:
        trainer.run()
    assert "--compile-backend aot_eager" in str(info.value)
