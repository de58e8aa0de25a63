"""The captured step inside HF ``Trainer`` (``VarlenTrainer``) and TRL's ``SFTTrainer``
(``VarlenSFTTrainer``): issue 46 item 2 on the CPU.

Capture is simulated as in tests/training/test_train_cuda_graphs.py (a "replay" runs the captured
function again on the same static buffers; the batch's device reads as CUDA), so what is checked is
all around the capture: padding to a bucket on the device, per-shape static buffers, the loss with
``num_items_in_batch`` and the accumulation scale as device tensors, gradients accumulated into
static buffers that Trainer's ``zero_grad`` resets, a shape first seen late in an accumulation,
TRL's metrics, and every refusal. Step by step against the same trainer with ``cuda_graphs="off"``:
loss, gradient norm and every parameter after every optimizer step.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    TrainerCallback,
    TrainingArguments,
)

import hf_varlen  # noqa: E402
from hf_varlen.captured_step import graphs as step_graphs  # noqa: E402
from hf_varlen.integrations.trainers import captured as ct  # noqa: E402
from hf_varlen.integrations.trainers.captured import (  # noqa: E402
    CaptureError,
    VarlenTrainer,
    pad_to_bucket,
)
from hf_varlen.testing import assert_numerics  # noqa: E402

VOCAB = 96


def _eager_capture(fn, pool):
    return fn


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setattr(step_graphs, "_capture_cuda", _eager_capture)
    monkeypatch.setattr(ct, "_device_type", lambda t: "cuda")


def _model(seed=0, attn="varlen_packed", dropout=0.0):
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        use_cache=False, attention_dropout=dropout,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def _data(n=24, seed=0):
    rng = random.Random(seed)
    rows = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 60))] for _ in range(n)]
    return Dataset.from_list([{"input_ids": r} for r in rows])


class _Record(TrainerCallback):
    """Every parameter after every optimizer step."""

    def __init__(self):
        self.params: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


# transformers 5.25 renamed gradient_checkpointing (now its deprecated alias); older releases
# have only the old name
_CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def _args(tmp_path, name, **kw):
    base = dict(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_steps=3, learning_rate=3e-3, max_grad_norm=0.5,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        remove_unused_columns=False, seed=0, data_seed=0, optim="adamw_torch",
    )  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def _train(tmp_path, name, cuda_graphs, model=None, **kw):
    rec = _Record()
    trainer = VarlenTrainer(
        model=_model() if model is None else model,
        args=_args(tmp_path, name, **kw),
        train_dataset=_data(),
        data_collator=hf_varlen.PackingCollator(),
        callbacks=[rec],
        cuda_graphs=cuda_graphs,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, rec.params, trainer


def test_pad_to_bucket():
    rows = [{"input_ids": list(range(1, n + 1))} for n in (5, 3, 7)]
    batch = hf_varlen.PackingCollator()(rows)
    out = pad_to_bucket(batch, (8, 16, 24))
    assert out["input_ids"].shape == (1, 16) and out["max_length_q"] == 16
    assert out["cu_seq_lens_q"].tolist() == [0, 5, 8, 15, 16, 16, 16, 16]
    assert out["labels"][0, 15:].tolist() == [-100] and out["input_ids"][0, 15] == 1
    assert out["position_ids"][0, 15:].tolist() == [0]
    assert torch.equal(out["labels"][:, :15], batch["labels"])
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        pad_to_bucket(batch, (8,))


def test_varlen_trainer_captured_equals_eager_step_by_step(tmp_path, simulated):
    eager, p_eager, _ = _train(tmp_path, "eager", "off")
    graphed, p_graphed, trainer = _train(tmp_path, "graphed", "on")
    info = trainer.captured_step_summary()
    assert info["mode"].startswith("captured (on") and len(info["shapes"]) >= 2, info
    assert len(eager) == len(graphed) == 3
    for e, g in zip(eager, graphed, strict=True):
        assert g["loss"] == pytest.approx(e["loss"], rel=2e-5)
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=2e-5)
    assert any(e["grad_norm"] > 0.5 for e in eager)  # the clip bites
    for step, (pe, pg) in enumerate(zip(p_eager, p_graphed, strict=True)):
        for name, p in pe.items():
            torch.testing.assert_close(pg[name], p, rtol=1e-4, atol=1e-6, msg=f"{step} {name}")


def test_peft_lora_captured_equals_eager(tmp_path, simulated):
    """A user's own ``get_peft_model`` model under Trainer: the adapters alone get the static
    gradient buffers; step by step equal to the eager step; the base weights never move."""
    from peft import LoraConfig, get_peft_model

    def lora():
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        return get_peft_model(_model(), cfg)

    eager, p_eager, _ = _train(tmp_path, "eager", "off", model=lora())
    graphed, p_graphed, trainer = _train(tmp_path, "graphed", "on", model=lora())
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert {id(p) for p in trainer._graphed.params} == {id(p) for p in trained}
    assert len(trained) < len(list(trainer.model.parameters()))
    for e, g in zip(eager, graphed, strict=True):
        assert g["loss"] == pytest.approx(e["loss"], rel=2e-5)
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=2e-5)
    first, last = p_graphed[0], p_graphed[-1]
    for name in first:
        if "lora_" not in name:
            assert torch.equal(first[name], last[name]), name
    for step, (pe, pg) in enumerate(zip(p_eager, p_graphed, strict=True)):
        for name, p in pe.items():
            torch.testing.assert_close(pg[name], p, rtol=1e-4, atol=1e-6, msg=f"{step} {name}")


def test_refusals(tmp_path, monkeypatch, caplog):
    # No CUDA and no simulation: "on" refuses at the first batch, "auto" says why once.
    with pytest.raises(CaptureError, match="CUDA graphs need a CUDA device"):
        _train(tmp_path, "on", "on")
    with caplog.at_level(logging.WARNING, logger="hf_varlen"):
        _, _, trainer = _train(tmp_path, "auto", "auto", max_steps=1)
    lines = [r.message for r in caplog.records if "hf_varlen training step" in r.message]
    assert len(lines) == 1 and "eager (auto: CUDA graphs need a CUDA device" in lines[0], lines
    assert trainer.captured_step_summary()["mode"].startswith("eager (auto:")
    # Known at construction: refused before any training.
    with pytest.raises(CaptureError, match="attn_implementation 'sdpa'"):
        VarlenTrainer(model=_model(attn="sdpa"), args=_args(tmp_path, "x"), cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs: expected"):
        VarlenTrainer(model=_model(), args=_args(tmp_path, "x"), cuda_graphs="yes")
    trainer = VarlenTrainer(model=_model(), args=_args(tmp_path, "x"), cuda_graphs="off")
    from accelerate.utils import DistributedType

    acc = type(trainer.accelerator)
    monkeypatch.setattr(acc, "distributed_type", property(lambda s: DistributedType.DEEPSPEED))
    monkeypatch.setattr(acc, "num_processes", property(lambda s: 2))
    trainer.is_fsdp_enabled = True
    reasons = " | ".join(trainer._static_blockers())
    for needle in ("DeepSpeed", "FSDP", "one process only (this run has 2)"):
        assert needle in reasons, reasons


def test_forward_that_syncs_with_the_host(tmp_path, monkeypatch, caplog):
    """A capture that fails because the forward syncs: "on" names the reason, "auto" trains
    eagerly from that micro-batch on, like the eager run."""

    def failing_capture(fn, pool):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(step_graphs, "_capture_cuda", failing_capture)
    monkeypatch.setattr(ct, "_device_type", lambda t: "cuda")
    with pytest.raises(CaptureError, match="synchronises with the host"):
        _train(tmp_path, "on", "on")
    eager, _, _ = _train(tmp_path, "eager", "off")
    with caplog.at_level(logging.WARNING, logger="hf_varlen"):
        auto, _, trainer = _train(tmp_path, "auto", "auto")
    assert "synchronises with the host" in trainer.captured_step_summary()["mode"]
    for e, a in zip(eager, auto, strict=True):
        assert a["loss"] == pytest.approx(e["loss"], rel=1e-6)


def test_checkpointing_with_dropout_is_refused(tmp_path, simulated):
    trainer = VarlenTrainer(
        model=_model(dropout=0.1),
        args=_args(tmp_path, "x", **{_CHECKPOINTING: True}),
        train_dataset=_data(),
        data_collator=hf_varlen.PackingCollator(),
        cuda_graphs="on",
    )
    with pytest.raises(CaptureError, match="attention_dropout=0.1"):
        trainer.train()


# -- TRL -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_setup():
    """A tokenizer for TRL's processing_class, and pre-tokenized data in the tiny model's vocab
    (TRL skips its tokenization when the dataset has input_ids): the 151k-token head of a real
    vocabulary would cost minutes on the CPU and add nothing to what is checked."""
    from conftest import shared_data_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data_path("tokenizers", "qwen2"))
    return tokenizer, _data(n=16, seed=1)


def _trl(trl_setup, tmp_path, name, cuda_graphs, mode="padding_free", **cfg):
    from accelerate.state import AcceleratorState
    from trl import SFTConfig

    from hf_varlen.integrations.trainers import VarlenSFTTrainer

    AcceleratorState._reset_state(reset_partial_state=True)  # runs of other precisions
    tokenizer, data = trl_setup
    config = dict(
        output_dir=str(tmp_path / name), report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=True, padding_free=mode == "padding_free", packing=mode == "bfd",
        packing_strategy="bfd", max_length=None if mode == "padding_free" else 96,
        per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=3e-3, max_grad_norm=1.0, seed=0, data_seed=0, optim="adamw_torch",
    )  # fmt: skip
    config.update(cfg)  # TRL's defaults otherwise: bf16 autocast, gradient checkpointing
    rec = _Record()
    trainer = VarlenSFTTrainer(
        model=_model(),
        args=SFTConfig(**config),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[rec],
        cuda_graphs=cuda_graphs,
        # The Triton interpreter (CPU tests) cannot run bf16 dots.
        fused_cross_entropy_kwargs={"backend": "torch"},
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, rec.params, trainer


@pytest.mark.parametrize("mode", ["padding_free", "bfd"])
def test_trl_defaults_captured_equals_eager(trl_setup, tmp_path, simulated, mode):
    """TRL's defaults (bf16 autocast over fp32 weights, gradient checkpointing): loss, grad norm
    and parameters by the numerics rule (ref_hi: eager fp32; ref_lo: eager bf16-mixed), and TRL's
    num_tokens exactly as eager (counted from the unpadded batch)."""
    hi, p_hi, _ = _trl(trl_setup, tmp_path, "hi", "off", mode, bf16=False)
    lo, p_lo, _ = _trl(trl_setup, tmp_path, "lo", "off", mode)
    x, p_x, trainer = _trl(trl_setup, tmp_path, "x", "on", mode)
    info = trainer.captured_step_summary()
    assert info["mode"].startswith("captured") and info["graphs"] >= 1, info
    assert trainer._graphed.autocast_dtype == torch.bfloat16
    assert trainer.args.gradient_checkpointing and step_graphs.model_blockers(trainer.model) == []
    for step, (h, lo_, x_) in enumerate(zip(hi, lo, x, strict=True)):
        assert x_["num_tokens"] == lo_["num_tokens"] == h["num_tokens"]
        for key in ("loss", "grad_norm"):
            t = [torch.tensor(float(r[key]), dtype=torch.float64) for r in (x_, h, lo_)]
            assert_numerics(f"step {step} {key}", *t, dtype=torch.bfloat16)
    for step in range(len(p_hi)):
        for name in p_hi[step]:
            assert_numerics(
                f"step {step} {name}", p_x[step][name], p_hi[step][name], p_lo[step][name],
                factor=3, dtype=torch.bfloat16,
            )  # fmt: skip


@pytest.mark.gpu
def test_gpu_varlen_trainer_captured_trains_like_eager(tmp_path):
    """The real capture on CUDA inside Trainer under bf16 autocast over fp32 weights with
    gradient checkpointing: per-step loss and grad norm by the numerics rule (ref_hi: eager fp32,
    ref_lo: eager bf16-mixed)."""

    def run(name, cuda_graphs, bf16):
        rec = _Record()
        args = _args(tmp_path, name, use_cpu=False, bf16=bf16, **{_CHECKPOINTING: True})
        trainer = VarlenTrainer(
            model=_model().cuda(),
            args=args,
            train_dataset=_data(),
            data_collator=hf_varlen.PackingCollator(),
            callbacks=[rec],
            cuda_graphs=cuda_graphs,
        )
        trainer.train()
        return [h for h in trainer.state.log_history if "loss" in h], trainer

    from accelerate.state import AcceleratorState

    hi, _ = run("hi", "off", False)
    AcceleratorState._reset_state(reset_partial_state=True)
    lo, _ = run("lo", "off", True)
    AcceleratorState._reset_state(reset_partial_state=True)
    x, trainer = run("x", "on", True)
    assert trainer.captured_step_summary()["mode"].startswith("captured")
    for step, (h, lo_, x_) in enumerate(zip(hi, lo, x, strict=True)):
        for key in ("loss", "grad_norm"):
            t = [torch.tensor(float(r[key]), dtype=torch.float64) for r in (x_, h, lo_)]
            assert_numerics(f"step {step} {key}", *t, dtype=torch.bfloat16)


def test_checkpointing_kwargs_read_under_either_name():
    """transformers before 5.25 has only ``gradient_checkpointing_kwargs``: a user's offload /
    RNG options there must reach the captured step's checks, not be ignored."""
    from types import SimpleNamespace

    from hf_varlen.integrations.trainers.captured import checkpointing_kwargs

    old = SimpleNamespace(gradient_checkpointing_kwargs={"offload": True})
    assert checkpointing_kwargs(old) == {"offload": True}
    new = SimpleNamespace(
        activation_checkpointing_kwargs={"every_n_layers": 2}, gradient_checkpointing_kwargs=None
    )
    got = checkpointing_kwargs(new)
    assert got == {"every_n_layers": 2}
    got["x"] = 1  # a copy: the caller's arguments stay as the user wrote them
    assert new.activation_checkpointing_kwargs == {"every_n_layers": 2}
    assert checkpointing_kwargs(SimpleNamespace()) == {}
