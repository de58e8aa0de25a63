"""The trainer on CPU: exact loss normalisation, gradient accumulation, exact resume, the padded
baseline, data formats, configuration errors, and the embedded default run (`hf-varlen train`).

Tiny models (0.8M parameters, byte tokenizer, built-in data) keep every test to seconds except the
default run, which is the README's main command and is run as users run it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_runs import epoch_train_config

from hf_varlen.ops.common import IGNORE_INDEX
from hf_varlen.testing import assert_numerics
from hf_varlen.training import PackedTrainer, TrainConfig
from hf_varlen.training.builtin import byte_tokenizer
from hf_varlen.training.data import tokenize

ROOT = Path(__file__).resolve().parents[2]


tiny = epoch_train_config


def sgd(tmp_path, **overrides) -> TrainConfig:
    """Plain SGD, constant lr, no clipping, no shuffling: nothing but the gradient moves weights."""
    return tiny(
        tmp_path,
        optim="sgd",
        lr=1.0,
        max_grad_norm=0.0,
        lr_schedule="constant",
        warmup_steps=0,
        shuffle=False,
        **overrides,
    )


def params(trainer: PackedTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def one_step_grads(trainer: PackedTrainer, group: list[list[int]]) -> tuple[float, dict]:
    """Run one optimizer step; return its logged loss and the gradients the optimizer saw."""
    grads: dict[str, torch.Tensor] = {}

    def spy(optimizer, args, kwargs):
        grads.update({k: p.grad.detach().clone() for k, p in trainer.model.named_parameters()})

    handle = trainer.optimizer.optimizer.register_step_pre_hook(spy)
    try:
        counts = trainer.train_step(group)
    finally:
        handle.remove()
    return counts["loss"], grads


def reference_loss_and_grads(model, examples, idx, dtype):
    """Per-token mean CE over the examples, each run alone and unpacked with eager attention."""
    ref = copy.deepcopy(model).to(dtype)
    ref.set_attn_implementation("eager")
    total = torch.zeros((), dtype=dtype)
    count = 0
    for i in idx:
        ids = torch.as_tensor(examples.input_ids[i])[None]
        labels = torch.as_tensor(examples.labels[i])[None]
        logits = ref(input_ids=ids).logits[0, :-1]
        target = labels[0, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits, target, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        count += int((target != IGNORE_INDEX).sum())
    loss = total / count
    loss.backward()
    return loss.detach(), {k: p.grad.detach() for k, p in ref.named_parameters()}


def test_grad_accum_2x4_equals_1x8_equals_unpacked_reference(tmp_path):
    idx = list(range(8))
    ga = PackedTrainer(sgd(tmp_path, grad_accum=2, tokens_per_batch=2048))
    full = PackedTrainer(sgd(tmp_path, grad_accum=1, tokens_per_batch=2048))
    model0 = copy.deepcopy(full.model)
    examples = full.train_ex
    lens = examples.lengths[idx]
    assert lens[:4].sum() != lens[4:].sum()  # the two micro-batches hold different token counts

    loss_ga, grads_ga = one_step_grads(ga, [idx[:4], idx[4:]])
    loss_full, grads_full = one_step_grads(full, [idx])
    hi_loss, hi_grads = reference_loss_and_grads(model0, examples, idx, torch.float64)
    lo_loss, lo_grads = reference_loss_and_grads(model0, examples, idx, torch.float32)

    for name, loss in (("2x4", loss_ga), ("1x8", loss_full)):
        assert_numerics(f"loss {name}", torch.tensor([loss]), hi_loss[None], lo_loss[None])
    for k in hi_grads:
        assert_numerics(f"grad {k} (2x4)", grads_ga[k], hi_grads[k], lo_grads[k], factor=3.0)
        assert_numerics(f"grad {k} (1x8)", grads_full[k], hi_grads[k], lo_grads[k], factor=3.0)


def test_padded_baseline_matches_packed(tmp_path):
    group = [[0, 1, 2, 3, 4, 5]]
    packed = PackedTrainer(sgd(tmp_path))
    padded = PackedTrainer(sgd(tmp_path, padded=True))
    assert padded.model.config._attn_implementation == "sdpa"
    mb_packed, mb_padded = packed.batcher(group[0]), padded.batcher(group[0])
    assert mb_packed.inputs["input_ids"].shape[0] == 1
    assert mb_padded.inputs["input_ids"].shape[0] == len(group[0])
    assert mb_packed.label_tokens == mb_padded.label_tokens
    assert mb_packed.real_tokens == mb_padded.real_tokens
    loss_packed, g_packed = one_step_grads(packed, group)
    loss_padded, g_padded = one_step_grads(padded, group)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=0)
    for k in g_packed:
        torch.testing.assert_close(g_packed[k], g_padded[k], rtol=1e-4, atol=1e-6)


def test_batch_size_mode_padded_and_packed_curves_match(tmp_path):
    """--batch-size B: B examples per micro-batch, the same ones packed and padded; AdamW losses
    of several steps agree within fp32 rounding."""
    runs = {}
    for padded in (False, True):
        cfg = tiny(
            tmp_path / str(padded), tokens_per_batch=None, batch_size=6, padded=padded,
            max_steps=4, lr=1e-3, warmup_steps=0,
        )  # fmt: skip
        trainer = PackedTrainer(cfg)
        groups = list(trainer.sampler)
        assert all(len(g) == 6 for g in groups[:-1]) and 1 <= len(groups[-1]) <= 6
        runs[padded] = (groups, [r["loss"] for r in _records(trainer.run())])
    assert runs[False][0] == runs[True][0]
    torch.testing.assert_close(
        torch.tensor(runs[False][1]), torch.tensor(runs[True][1]), rtol=2e-6, atol=0
    )


def _records(summary) -> list[dict]:
    from hf_varlen.training.metrics import read_log

    return [r for r in read_log(summary["output_dir"]) if "loss" in r]


def test_fused_loss_toggle_is_independent_of_layer_kernels(tmp_path):
    trainer = PackedTrainer(tiny(tmp_path, fused_kernels="off", fused_loss="on", max_steps=1))
    assert "cross_entropy x1" in trainer.kernels and "layer kernels off" in trainer.kernels
    assert trainer.eval_kwargs == {"fused_loss": True}
    assert "off" in PackedTrainer(tiny(tmp_path, fused_loss="off", max_steps=1)).kernels


def test_dummy_batch_adds_exact_zero(tmp_path):
    trainer = PackedTrainer(sgd(tmp_path))
    loss, grads = one_step_grads(trainer, [[]])
    assert loss == 0.0, loss  # no label token: a zero, never NaN
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_resume_is_bit_identical(tmp_path):
    common = dict(grad_accum=2, max_steps=8, eval_split=0.1, eval_every=2)
    straight = PackedTrainer(tiny(tmp_path, output_dir=str(tmp_path / "a"), save_every=3, **common))
    assert 2 * 3 < len(straight.sampler) < 2 * 8  # resumes mid-epoch 0, then crosses into epoch 1
    straight.run()
    resumed = PackedTrainer(
        tiny(
            tmp_path,
            output_dir=str(tmp_path / "b"),
            resume=str(tmp_path / "a" / "checkpoint-3"),
            **common,
        )
    )
    assert resumed.state.step == 3
    resumed.run()

    def log(run):
        with open(tmp_path / run / "metrics.jsonl") as fh:
            recs = [json.loads(line) for line in fh]
        drop = ("elapsed", "step_time", "tokens_per_s", "tflops_per_s", "mfu", "peak_mem_gib")
        return [{k: v for k, v in r.items() if k not in drop} for r in recs if r["step"] > 3]

    assert log("a") == log("b")  # losses, grad norms, lr, eval losses: bit-identical
    a, b = params(straight), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "checkpoint-3" / "model.safetensors").exists()


def test_resume_refuses_other_data_order(tmp_path):
    PackedTrainer(tiny(tmp_path, max_steps=2, save_every=2)).run()
    assert (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").exists()
    with pytest.raises(ValueError, match="tokens_per_batch: checkpoint 512 vs now 1024"):
        PackedTrainer(tiny(tmp_path, max_steps=4, tokens_per_batch=1024, resume="latest"))


def test_gradient_checkpointing_gives_the_same_step(tmp_path):
    group = [[0, 1, 2], [3, 4]]
    loss, grads = one_step_grads(PackedTrainer(sgd(tmp_path, grad_accum=2)), group)
    loss_gc, grads_gc = one_step_grads(
        PackedTrainer(sgd(tmp_path, grad_accum=2, gradient_checkpointing=True)), group
    )
    assert loss_gc == loss
    for k in grads:
        torch.testing.assert_close(grads_gc[k], grads[k], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet", "dir"])
def test_local_dataset_files(tmp_path, suffix):
    from hf_varlen.training.data import load_records

    recs = [{"text": f"example {i}"} for i in range(5)]
    path = tmp_path / f"d{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"train": recs}))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in recs))
    elif suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(recs), path)
    else:
        path.mkdir()
        (path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs[:2]))
        (path / "b.json").write_text(json.dumps(recs[2:]))
    assert load_records(str(path), TrainConfig(max_examples=4)) == recs[:4]


def test_alpaca_labels_mask_the_prompt():
    tok = byte_tokenizer()
    cfg = TrainConfig(max_length=512)
    rec = {"instruction": "Add.", "input": "1 + 2", "output": "3"}
    ex = tokenize([rec], "alpaca", tok, cfg)
    ids, labels = ex.input_ids[0], ex.labels[0]
    n_answer = len(tok("3", add_special_tokens=False)["input_ids"]) + 1  # + eos
    assert (labels[:-n_answer] == IGNORE_INDEX).all()
    assert (labels[-n_answer:] == ids[-n_answer:]).all()
    assert ids[-1] == tok.eos_token_id


def test_chat_labels_cover_assistant_turns_only():
    tok = byte_tokenizer()
    cfg = TrainConfig(max_length=512)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    ex = tokenize([{"messages": msgs}], "chat", tok, cfg)
    ids, labels = ex.input_ids[0], ex.labels[0]
    trained = tok.decode(ids[labels != IGNORE_INDEX])
    assert trained == "hello<|im_end|>\nciao<|im_end|>\n"


def test_truncation_and_drop(tmp_path):
    tok = byte_tokenizer()
    cfg = TrainConfig(max_length=48)
    recs = [
        {"instruction": "x" * 40, "input": "", "output": "never seen"},  # prompt fills max_length
        {"instruction": "y", "input": "", "output": "z" * 40},  # truncated, still trained
        {"instruction": "y", "input": "", "output": "z"},  # untouched
    ]
    ex = tokenize(recs, "alpaca", tok, cfg)
    assert len(ex) == 2 and ex.dropped == 1 and ex.truncated == 2
    assert ex.lengths.tolist() == [48, 34 + 2]


def _write(path: Path, records) -> str:
    path.write_text(json.dumps(records))
    return str(path)


@pytest.mark.parametrize(
    "overrides, error, pattern",
    [
        (dict(attn_backend="no-such-backend"), ValueError, "--attn-backend.*no-such-backend"),
        (dict(max_length=1), ValueError, "--max-length: expected >= 2"),
        (
            dict(max_length=512, tokens_per_batch=256),
            ValueError,
            "--tokens-per-batch.*>= --max-length",
        ),
        (dict(batch_size=4), ValueError, "--tokens-per-batch 512 and --batch-size 4"),
        (dict(format="chat"), ValueError, "lacks the fields --format chat needs"),
        (dict(dataset="WRONG_FIELDS"), ValueError, "cannot tell the format.*Pass --format"),
        (dict(dataset="MISSING_OUTPUT", format="alpaca"), ValueError, "record 1 lacks"),
        (dict(model="BLOOM"), ValueError, "does not dispatch attention.*--padded"),
        (dict(model="GEMMA2", attn_backend="sdpa"), ValueError, "trial forward.*softcap.*Hint"),
        (dict(lora=True, _hide_peft=True), ImportError, "--lora needs the `peft` package"),
        (dict(ddp_timeout=0), ValueError, "--ddp-timeout must be >= 1, got 0"),
    ],
)
def test_bad_config_fails_before_training(tmp_path, monkeypatch, overrides, error, pattern):
    overrides = dict(overrides)
    if overrides.get("dataset") == "WRONG_FIELDS":
        overrides["dataset"] = _write(tmp_path / "d.json", [{"question": "q", "answer": "a"}])
    if overrides.get("dataset") == "MISSING_OUTPUT":
        recs = [{"instruction": "a", "output": "b"}, {"instruction": "c"}]
        overrides["dataset"] = _write(tmp_path / "d.json", recs)
    if overrides.get("model") == "BLOOM":
        from transformers import BloomConfig, BloomForCausalLM

        cfg = BloomConfig(vocab_size=320, hidden_size=32, n_layer=1, n_head=2)
        BloomForCausalLM(cfg).save_pretrained(tmp_path / "bloom")
        overrides.update(model=str(tmp_path / "bloom"), tokenizer="bytes")
    if overrides.get("model") == "GEMMA2":  # logit softcap: the sdpa backend cannot do it
        from transformers import Gemma2Config, Gemma2ForCausalLM

        cfg = Gemma2Config(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            attn_logit_softcapping=50.0,
        )
        Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "gemma2")
        overrides.update(model=str(tmp_path / "gemma2"), tokenizer="bytes")
    if overrides.pop("_hide_peft", False):
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
        )
    started = []
    # run() starts each step with launch_step
    monkeypatch.setattr(PackedTrainer, "launch_step", lambda self, *a, **k: started.append(1))
    with pytest.raises(error, match=pattern):
        PackedTrainer(tiny(tmp_path, **overrides)).run()
    assert not started


def test_lora_trains_adapters_only(tmp_path):
    trainer = PackedTrainer(tiny(tmp_path, lora=True, lora_r=4, max_steps=2))
    summary = trainer.run()
    assert 0 < summary["trainable"] < summary["params"] / 5
    assert np.isfinite(summary["loss_last"])


@pytest.mark.slow
def test_default_run_via_cli(tmp_path):
    """`hf-varlen train` with no options (output redirected): finishes, sane metrics, plots."""
    out = tmp_path / "default"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hf_varlen.cli", "train", "--output-dir", str(out)]
    proc = subprocess.run(
        [*cmd, "--plot", "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hf-varlen train: summary" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_s"] > 0
    assert 0 < summary["packing_efficiency"] <= 1
    assert 0 < summary["budget_fill"] <= 1
    assert summary["loss_last_10pct"] < summary["loss_first_10pct"] - 1.0, summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    for png in ("loss_vs_step.png", "loss_vs_time.png", "tokens_per_s.png"):
        assert (out / png).stat().st_size > 1000
    assert (out / "final" / "model.safetensors").exists()
    print(f"default run: {summary['wall_time_s']:.1f} s, {summary['tokens_per_s']:.0f} tokens/s")


def test_loss_and_norm_are_read_together_exactly():
    """The step reads its loss and gradient norm in one device read; the values are exactly
    float() of each, whatever the norm's dtype; a norm that is not a plain tensor passes through."""
    from hf_varlen.training.stepping import read_loss_and_norm

    loss = torch.tensor(2.7182817459106445, dtype=torch.float32) / 3
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        norm = torch.tensor(1.2345678901234567, dtype=dtype)
        got = read_loss_and_norm(loss, norm)
        assert got == (float(loss), float(norm)) and all(type(v) is float for v in got)
    assert read_loss_and_norm(loss, None) == (float(loss), None)


def test_ddp_timeout_reaches_the_process_group(tmp_path):
    """--ddp-timeout is the timeout accelerate gives init_process_group (where this trainer's
    Accelerator creates the group), so a stuck rank fails with an error instead of hanging."""
    import datetime

    trainer = PackedTrainer(tiny(tmp_path, ddp_timeout=45, max_steps=1))
    try:
        assert trainer.acc.init_handler.to_kwargs() == {"timeout": datetime.timedelta(seconds=45)}
    finally:
        trainer.close()


def test_next_step_is_collated_before_this_steps_read_back(tmp_path, monkeypatch):
    """The next step's micro-batches are collated after this step's last launch and before its
    one read-back (the GPU runs meanwhile), each exactly once and in the sampler's order; the last
    step and the last step of an epoch collate nothing ahead."""
    from tiny_runs import tiny_train_config

    import hf_varlen.training.stepping as stepping
    from hf_varlen.training.data import Batcher

    events = []
    collate, read = Batcher.__call__, stepping.read_loss_and_norm

    def spy_collate(self, indices):
        events.append(("collate", tuple(indices)))
        return collate(self, indices)

    def spy_read(*args):
        events.append(("read",))
        return read(*args)

    monkeypatch.setattr(Batcher, "__call__", spy_collate)
    monkeypatch.setattr(stepping, "read_loss_and_norm", spy_read)
    cfg = tiny_train_config(tmp_path, "run", grad_accum=2, max_steps=None, builtin_examples=24)
    trainer = PackedTrainer(cfg)
    slots = [tuple(s) for s in trainer.sampler]  # epoch 0's order (set_epoch(0) is the first)
    trainer.run()
    steps = trainer.state.step
    assert steps == -(-len(slots) // 2) and [e[0] for e in events].count("read") == steps
    collated = [e[1] for e in events if e[0] == "collate"]
    assert collated == slots  # once each, in order: nothing collated twice or ahead of the epoch
    # Step n's read-back follows step n + 1's collation, except at the end of the epoch.
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    for n, at in enumerate(reads[:-1]):
        before = [e for e in events[:at] if e[0] == "collate"]
        assert len(before) == min(2 * (n + 2), len(slots)), (n, events)
