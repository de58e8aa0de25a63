"""`hf-varlen train` when things go wrong: nothing lost, nothing silently wrong (issue 12).

Non-finite steps stop the run (or are skipped and counted), failed saves are errors, checkpoints
are written atomically and validated before a resume, a used output directory is never silently
reused, and bad data names the file and line (or record). Tiny models on CPU: seconds each.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from tiny_runs import epoch_train_config

import hf_varlen
from hf_varlen import cli
from hf_varlen.training import PackedTrainer, TrainConfig
from hf_varlen.training.checkpoint import CheckpointError
from hf_varlen.training.loop import NonFiniteError

tiny = epoch_train_config


def nan_at_steps(*steps: int):
    """A model hook that turns the logits of the given optimizer steps (1-based) into NaN."""
    calls = {"n": 0}

    def hook(model):
        def forward_hook(module, args, output):
            if not module.training:  # the preflight and eval forwards do not count
                return output
            calls["n"] += 1
            return output * float("nan") if calls["n"] in steps else output

        model.get_output_embeddings().register_forward_hook(forward_hook)

    return hook


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


# --------------------------------------------------------------------------------------------- #
# Non-finite steps


def test_nonfinite_step_stops_the_run_with_step_and_hint(tmp_path):
    trainer = PackedTrainer(
        tiny(tmp_path, max_steps=4, save_final=True, fused_loss="off"), model_hook=nan_at_steps(2)
    )
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss.*--on-nonfinite skip"):
        trainer.run()
    assert not (tmp_path / "run" / "final").exists()  # a broken model is not exported
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert steps == [1]


def test_nonfinite_skip_skips_the_update_and_counts_it(tmp_path):
    cfg = tiny(tmp_path, max_steps=4, on_nonfinite="skip", fused_loss="off", shuffle=False)
    trainer = PackedTrainer(cfg, model_hook=nan_at_steps(2))
    groups = list(trainer.sampler)
    trainer.train_step(groups[:1])
    before = weights(trainer)
    counts = trainer.train_step(groups[1:2])
    assert counts["skipped"] and not torch.isfinite(torch.tensor(counts["loss"]))
    after = weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.optimizer.optimizer.state  # moments exist from step 1 and stayed finite
    assert not trainer.train_step(groups[2:3])["skipped"]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    summary = PackedTrainer(
        tiny(tmp_path / "b", max_steps=4, on_nonfinite="skip", fused_loss="off"),
        model_hook=nan_at_steps(2, 3),
    ).run()
    assert summary["skipped_steps"] == 2 and summary["steps"] == 4
    assert torch.isfinite(torch.tensor(summary["loss_last"]))


def test_divergent_cli_run_exits_nonzero(tmp_path, capsys):
    argv = ["train", "--output-dir", str(tmp_path / "div"), "--builtin-examples", "64"]
    argv += ["--max-length", "256", "--tokens-per-batch", "512", "--max-steps", "6"]
    argv += ["--lr", "1e9", "--no-progress"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "hf-varlen: error: step 2: non-finite loss" in err and "Traceback" not in err
    assert not (tmp_path / "div" / "final").exists()


# --------------------------------------------------------------------------------------------- #
# Saves


def test_failed_final_save_is_an_error(tmp_path):
    # A file in the way before the start is refused up front (tests/training/test_train_rules.py);
    # one that appears during training fails the export.
    trainer = PackedTrainer(tiny(tmp_path, max_steps=1, save_final=True))
    (tmp_path / "run" / "final").write_text("a file where the model folder should go")
    with pytest.raises(CheckpointError, match="final"):
        trainer.run()


def test_failed_checkpoint_save_leaves_no_checkpoint_and_latest_is_the_previous(
    tmp_path, monkeypatch
):
    trainer = PackedTrainer(tiny(tmp_path, max_steps=4, save_every=2))
    real = trainer.acc.save_state
    saves = []

    def full_disk(path, **kwargs):
        saves.append(path)
        real(path, **kwargs)
        if len(saves) == 2:  # the step-4 save: written halfway, then the disk is full
            os.remove(os.path.join(path, "optimizer.bin"))
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.acc, "save_state", full_disk)
    with pytest.raises(CheckpointError, match="checkpoint-4.*No space left"):
        trainer.run()
    names = sorted(os.listdir(tmp_path / "run"))
    assert "checkpoint-2" in names and "checkpoint-4" not in names, names
    assert "custom_checkpoint_1.pkl" in os.listdir(tmp_path / "run" / "checkpoint-2")
    resumed = PackedTrainer(tiny(tmp_path, max_steps=4, save_every=2, resume="latest"))
    assert resumed.state.step == 2


def test_checkpoint_is_written_atomically_with_a_manifest(tmp_path):
    PackedTrainer(tiny(tmp_path, max_steps=2, save_every=2)).run()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    files = state["files"]
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= set(files)
    assert all((run / "checkpoint-2" / f).stat().st_size == n for f, n in files.items())


# --------------------------------------------------------------------------------------------- #
# Resume


@pytest.fixture
def two_checkpoints(tmp_path):
    PackedTrainer(tiny(tmp_path, max_steps=4, save_every=2)).run()
    return tmp_path / "run"


def test_resume_latest_skips_incomplete_checkpoints_with_a_warning(
    tmp_path, two_checkpoints, caplog
):
    (two_checkpoints / "checkpoint-4" / "optimizer.bin").unlink()
    (two_checkpoints / "checkpoint-6").mkdir()  # an old-style save killed before it finished
    with caplog.at_level(logging.WARNING):
        trainer = PackedTrainer(tiny(tmp_path, max_steps=6, save_every=2, resume="latest"))
    assert trainer.state.step == 2
    assert trainer.resumed_from.endswith("checkpoint-2")
    text = caplog.text
    assert "checkpoint-6" in text and "checkpoint-4" in text and "optimizer.bin" in text


@pytest.mark.parametrize(
    "damage, pattern",
    [
        ("truncate:model.safetensors", "model.safetensors.*(damaged|size)"),
        ("garbage:custom_checkpoint_1.pkl", "custom_checkpoint_1.pkl.*damaged"),
        ("delete:custom_checkpoint_0.pkl", "custom_checkpoint_0.pkl.*missing"),
        ("delete:trainer_state.json", "trainer_state.json"),
    ],
)
def test_resume_names_the_missing_or_damaged_file(tmp_path, two_checkpoints, damage, pattern):
    how, name = damage.split(":")
    path = two_checkpoints / "checkpoint-2" / name
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"x" * path.stat().st_size)
    else:
        path.unlink()
    ckpt = str(two_checkpoints / "checkpoint-2")
    started = []
    cfg = tiny(tmp_path, max_steps=4, save_every=2, resume=ckpt)
    with pytest.raises(CheckpointError, match=pattern):
        started.append(PackedTrainer(cfg))
    assert not started


def test_missing_random_states_is_an_error_unless_asked(tmp_path, two_checkpoints, caplog):
    (two_checkpoints / "checkpoint-4" / "random_states_0.pkl").unlink()
    ckpt = str(two_checkpoints / "checkpoint-4")
    with pytest.raises(CheckpointError, match=r"random_states_0.pkl.*--resume-without-rng"):
        PackedTrainer(tiny(tmp_path, max_steps=6, resume=ckpt))
    with caplog.at_level(logging.WARNING):
        trainer = PackedTrainer(tiny(tmp_path, max_steps=6, resume=ckpt, resume_without_rng=True))
    assert trainer.state.step == 4 and "random states" in caplog.text


def test_torn_trailing_metrics_line_is_dropped_with_a_warning(tmp_path, two_checkpoints, caplog):
    log = two_checkpoints / "metrics.jsonl"
    with log.open("a") as fh:
        fh.write('{"step": 5, "loss": 2.3, "lr"')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        summary = PackedTrainer(tiny(tmp_path, max_steps=6, resume="latest")).run()
    assert "metrics.jsonl" in caplog.text and "torn" in caplog.text
    steps = [json.loads(x)["step"] for x in log.open() if "loss" in x]
    assert steps == [1, 2, 3, 4, 5, 6] and summary["steps"] == 6


def test_damaged_metrics_line_in_the_middle_is_an_error(tmp_path, two_checkpoints):
    log = two_checkpoints / "metrics.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:10]
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl line 2"):
        PackedTrainer(tiny(tmp_path, max_steps=6, resume="latest")).run()


# --------------------------------------------------------------------------------------------- #
# Output directories


def test_new_run_in_a_used_output_dir_is_refused(tmp_path, two_checkpoints):
    before = (two_checkpoints / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"--output-dir.*holds a run.*--overwrite-output-dir"):
        PackedTrainer(tiny(tmp_path, max_steps=3))
    assert (two_checkpoints / "metrics.jsonl").read_text() == before
    assert (two_checkpoints / "checkpoint-4").is_dir()


def test_overwrite_output_dir_removes_the_old_run_entirely(tmp_path, two_checkpoints):
    (two_checkpoints / "notes.txt").write_text("mine")  # not the run's: kept
    PackedTrainer(tiny(tmp_path, max_steps=3, overwrite_output_dir=True)).run()
    names = sorted(os.listdir(two_checkpoints))
    assert not [n for n in names if "checkpoint" in n], names
    assert "notes.txt" in names
    steps = [json.loads(x)["step"] for x in (two_checkpoints / "metrics.jsonl").open()]
    assert steps == [1, 2, 3]
    # a later --resume latest finds nothing of the old run: it starts over
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        PackedTrainer(tiny(tmp_path, max_steps=3, resume="latest"))


def test_resume_latest_in_an_empty_dir_starts_fresh(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = PackedTrainer(tiny(tmp_path, max_steps=1, resume="latest"))
    assert trainer.state.step == 0 and "starting fresh" in caplog.text


def test_overwrite_and_resume_latest_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--overwrite-output-dir.*--resume latest"):
        tiny(tmp_path, resume="latest", overwrite_output_dir=True).validate()


# --------------------------------------------------------------------------------------------- #
# Data


def _load(path: Path, **cfg):
    from hf_varlen.training.data import load_records

    return load_records(str(path), TrainConfig(**cfg))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": f"t{i}"}) for i in range(40)]
    lines[29] = lines[29][:-3]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl.*line 30.*--skip-bad-records"):
        _load(path)
    assert len(_load(path, skip_bad_records=True)) == 39


def test_malformed_json_document_names_its_line(tmp_path):
    path = tmp_path / "d.json"
    text = json.dumps([{"text": f"t{i}"} for i in range(10)], indent=1)
    lines = text.splitlines()
    assert lines[11] == '  "text": "t3"'
    lines[11] = lines[11].replace('"', "", 1)
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"d.json.*line 12 column 3"):
        _load(path)


@pytest.mark.parametrize(
    "record, fmt, pattern",
    [
        ({"instruction": None, "output": "x"}, "alpaca", r"'instruction' is null"),
        ({"instruction": "a", "output": 3}, "alpaca", r"'output' is int"),
        ({"prompt": "a", "completion": None}, "alpaca", r"'completion' is null"),
        ({"text": None}, "text", r"'text' is null"),
        ({"messages": "hi"}, "chat", r"'messages' is str"),
        ({"messages": [{"role": "user", "content": None}]}, "chat", r"content.*is null"),
    ],
)
def test_null_or_non_string_fields_name_the_record(tmp_path, record, fmt, pattern):
    from hf_varlen.training.data import detect_format, load_records

    good = {
        "alpaca": {"instruction": "a", "output": "b"},
        "text": {"text": "t"},
        "chat": {"messages": [{"role": "user", "content": "c"}]},
    }[fmt]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, good, record, good)) + "\n")
    cfg = TrainConfig(format=fmt)
    records = load_records(str(path), cfg)
    with pytest.raises(ValueError, match=rf"record 2 \(d.jsonl line 3\).*{pattern}"):
        detect_format(records, cfg, str(path))
    cfg = TrainConfig(format=fmt, skip_bad_records=True)
    records = load_records(str(path), cfg)
    assert detect_format(records, cfg, str(path)) == fmt
    assert len(records) == 3 and records.skipped == 1


def test_skipped_records_are_counted_in_the_summary(tmp_path):
    path = tmp_path / "d.jsonl"
    recs = [{"text": "the quick brown fox " * (i % 7 + 1)} for i in range(30)]
    lines = [json.dumps(r) for r in recs] + ['{"text": null}', "not json"]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 32"):
        PackedTrainer(tiny(tmp_path, dataset=str(path), max_steps=1))
    cfg = tiny(tmp_path, dataset=str(path), max_steps=1, skip_bad_records=True)
    summary = PackedTrainer(cfg).run()
    assert summary["skipped_records"] == 2


# --------------------------------------------------------------------------------------------- #
# Process-wide state


def test_building_and_running_a_trainer_keeps_the_default_backend(tmp_path):
    before = hf_varlen.default_backend()
    trainer = PackedTrainer(tiny(tmp_path, attn_backend="reference", max_steps=1))
    assert hf_varlen.default_backend() == before
    assert hf_varlen.model_backend(trainer.acc.unwrap_model(trainer.model)) == "reference"
    trainer.run()
    assert hf_varlen.default_backend() == before
