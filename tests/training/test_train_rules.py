"""`hf-varlen train`, round two of "nothing lost, nothing silently wrong" (issue 45, training side).

A saved config.yaml never deletes the run it describes; output-path problems, bad data and bad
options are refused before the first step naming the file, line or option (exit 2); --resume
checks that the checkpoint is one of this model and config; trackers and metrics.jsonl keep one
history. Tiny models on CPU: seconds each.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import warnings

import numpy as np
import pytest
import torch
import yaml
from tiny_runs import epoch_train_config

from hf_varlen import PackingCollator, TokenBudgetBatchSampler, cli
from hf_varlen.training import PackedTrainer
from hf_varlen.training.checkpoint import CheckpointError

tiny = epoch_train_config


def _cli_args(cfg) -> list[str]:
    return [
        "train",
        "--output-dir", cfg.output_dir,
        "--builtin-examples", str(cfg.builtin_examples),
        "--max-length", str(cfg.max_length),
        "--tokens-per-batch", str(cfg.tokens_per_batch),
        "--no-progress",
        "--no-save-final",
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------- #
# Nothing lost


def test_rerunning_a_saved_config_never_deletes_its_run(tmp_path, capsys):
    cfg = tiny(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run there
    args = _cli_args(cfg) + ["--max-steps", "3", "--save-every", "3", "--overwrite-output-dir"]
    assert cli.main(args) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["overwrite_output_dir"] is True  # the record of what that command line asked
    before = sorted(os.listdir(run))
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    # Re-running the saved file with no --output-dir (and no --overwrite-output-dir) is refused.
    assert cli.main(["train", "--config", str(run / "config.yaml"), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite-output-dir" in err
    assert sorted(os.listdir(run)) == before
    assert (run / "metrics.jsonl").read_text() == metrics
    assert (run / "checkpoint-3").is_dir()
    # Only this command line's own flag deletes it.
    again = ["train", "--config", str(run / "config.yaml"), "--max-steps", "1"]
    assert cli.main([*again, "--overwrite-output-dir"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("what", ["final", "output_dir", "below_file"])
def test_output_path_problems_are_refused_before_training(tmp_path, capsys, what):
    cfg = tiny(tmp_path, max_steps=2)
    out = tmp_path / "run"
    if what == "final":
        out.mkdir()
        (out / "final").write_text("mine")
    elif what == "output_dir":
        out.write_text("mine")
    else:
        out.write_text("mine")
        cfg.output_dir = str(out / "sub" / "dir")
    args = _cli_args(cfg)
    args[args.index("--no-save-final")] = "--save-final"
    assert cli.main([*args, "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "--output-dir" in err, err
    assert "final" in err if what == "final" else "is a file, not a folder" in err
    # Nothing trained: no metrics were written anywhere.
    assert not list(tmp_path.rglob("metrics.jsonl"))
    target = out / "final" if what == "final" else out
    assert target.read_text() == "mine"


def test_read_only_output_dir_is_a_usage_error(tmp_path, capsys, monkeypatch):
    real = tempfile.mkstemp
    out = tmp_path / "run"

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir).startswith(str(out)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert cli.main([*_cli_args(tiny(tmp_path)), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--output-dir" in err and "Read-only file system" in err, err


# --------------------------------------------------------------------------------------------- #
# Resume checks the model, the config and the data


@pytest.fixture(scope="module")
def _saved_llama_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    PackedTrainer(tiny(root, max_steps=2, save_every=2)).run()
    return root / "run" / "checkpoint-2"


@pytest.fixture
def llama_checkpoint(_saved_llama_run, tmp_path):
    """A tiny-llama checkpoint at step 2 (trained once per module), a copy of its own per test."""
    copy = tmp_path / "saved" / "checkpoint-2"
    shutil.copytree(_saved_llama_run, copy)
    return copy


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(model="tiny-mistral"), r"model_type: checkpoint 'llama' vs now 'mistral'"),
        (dict(config_overrides="rms_norm_eps=0.5"), r"rms_norm_eps: checkpoint 1e-0\d vs now 0.5"),
        (dict(max_length=160), r"other data .*digest"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_model_or_data(
    tmp_path, llama_checkpoint, capsys, change, named
):
    cfg = tiny(tmp_path, max_steps=3, resume=str(llama_checkpoint), **change)
    with pytest.raises(CheckpointError, match=named):
        PackedTrainer(cfg)
    args = [*_cli_args(cfg), "--max-steps", "3", "--resume", str(llama_checkpoint)]
    for key, value in change.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert cli.main(args) == 2
    assert "--resume" in capsys.readouterr().err


def test_resume_of_a_checkpoint_without_fingerprints_warns_once(tmp_path, llama_checkpoint, caplog):
    state_path = llama_checkpoint / "trainer_state.json"
    original = state_path.read_text()
    state = json.loads(original)
    for key in ("model_config", "data"):
        del state["fingerprint"][key]
    state_path.write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING):
        trainer = PackedTrainer(tiny(tmp_path, max_steps=3, resume=str(llama_checkpoint)))
    assert trainer.state.step == 2
    warnings = [r for r in caplog.records if "predates" in r.getMessage()]
    assert len(warnings) == 1 and "model_config and data" in warnings[0].getMessage()
    # with its fingerprints, the same model and data resume without a word
    state_path.write_text(original)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert PackedTrainer(tiny(tmp_path, max_steps=3, resume=str(llama_checkpoint))).state.step
    assert not [r for r in caplog.records if "predates" in r.getMessage()]


# --------------------------------------------------------------------------------------------- #
# Packing: ids that do not fit int64, rows over the sampler's budget


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_uint64_token_id_above_int64_is_refused_not_wrapped(kind):
    ids = np.array([5, 2**63 + 7, 9], dtype=np.uint64)
    if kind == "torch":  # the same bits (torch builds no uint64 tensor from such a numpy array)
        ids = torch.from_numpy(ids.view(np.int64).copy()).view(torch.uint64)
    with pytest.raises(
        ValueError, match=r"features\[0\]\['input_ids'\]: token id 9223372036854775815"
    ):
        PackingCollator()([{"input_ids": ids}])
    with pytest.raises(ValueError, match=r"lengths\[1\] = 9223372036854775815 does not fit"):
        TokenBudgetBatchSampler(np.array([3, 2**63 + 7], dtype=np.uint64), 8)
    # ids that fit are packed as they are
    fine = PackingCollator()([{"input_ids": np.array([5, 2**62], dtype=np.uint64)}])
    assert fine["input_ids"].tolist() == [[5, 2**62]]


def test_sampler_budget_overflow_warns_once_and_max_length_respects_the_budget():
    lengths = [40, 300, 120, 500, 60]
    with pytest.warns(UserWarning, match=r"2 of 5 examples are longer than max_tokens=256") as rec:
        sampler = TokenBudgetBatchSampler(lengths, 256, shuffle=False)
    assert len(rec) == 1
    feats = [{"input_ids": np.arange(n) % 50} for n in lengths]
    rows = [PackingCollator(max_length=256)([feats[i] for i in b]) for b in sampler]
    assert max(r["input_ids"].shape[1] for r in rows) == 256


# --------------------------------------------------------------------------------------------- #
# Data the user must fix: named file and line, exit 2; --skip-bad-records skips it


def _alpaca(i: int) -> dict:
    return {"instruction": f"Add {i} and {i}.", "input": "", "output": f"{2 * i}"}


def _records(path, **cfg):
    from hf_varlen.training import TrainConfig
    from hf_varlen.training.data import detect_format, load_records

    config = TrainConfig(**cfg)
    records = load_records(str(path), config)
    return records, detect_format(records, config, str(path))


def test_one_stray_record_does_not_decide_the_format(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": "a stray text record"})] + [
        json.dumps(_alpaca(i)) for i in range(60)
    ]
    path.write_text("\n".join(lines) + "\n")
    records, fmt = _records(path, skip_bad_records=True)
    assert fmt == "alpaca" and len(records) == 60 and records.skipped == 1
    with pytest.raises(
        ValueError,
        match=r"several formats \(60 alpaca, 1 text\); record 0 \(d.jsonl line 1\) is text",
    ):
        _records(path)
    run = tiny(tmp_path, max_steps=1, dataset=str(path))
    assert cli.main([*_cli_args(run), "--max-steps", "1", "--dataset", str(path)]) == 2
    assert "d.jsonl line 1" in capsys.readouterr().err


def test_utf8_bom_is_accepted(tmp_path):
    for name in ("d.jsonl", "d.json"):
        path = tmp_path / name
        body = "\n".join(json.dumps(_alpaca(i)) for i in range(3))
        if name == "d.json":
            body = json.dumps([_alpaca(i) for i in range(3)])
        path.write_bytes(b"\xef\xbb\xbf" + body.encode())
        records, fmt = _records(path)
        assert fmt == "alpaca" and len(records) == 3 and records.skipped == 0


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_latin1_byte_names_the_file_and_line(tmp_path, name, capsys):
    path = tmp_path / name
    lines = [json.dumps(_alpaca(i)).encode() for i in range(5)]
    lines[3] = '{"instruction": "caf\u00e9", "output": "x"}'.encode("latin-1")
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(
        ValueError, match=rf"{name}.*line 4 is not UTF-8 \(byte 0xe9 at column 21\)"
    ):
        _records(path)
    records, _ = _records(path, skip_bad_records=True)
    assert len(records) == 4 and records.skipped == 1
    run = tiny(tmp_path, max_steps=1)
    assert cli.main([*_cli_args(run), "--max-steps", "1", "--dataset", str(path)]) == 2
    assert "line 4 is not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["alpaca", "chat"])
def test_lone_surrogate_names_the_record(tmp_path, fmt):
    path = tmp_path / "d.jsonl"
    if fmt == "alpaca":
        good = [json.dumps(_alpaca(i)) for i in range(3)]
        bad = '{"instruction": "x\\ud800y", "output": "z"}'
    else:
        good = [
            json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) for i in range(3)
        ]
        bad = '{"messages": [{"role": "user", "content": "x\\udc00"}]}'
    path.write_text("\n".join([good[0], bad, *good[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl line 2.*lone surrogate \(U\+D[8C]00"):
        _records(path)
    records, _ = _records(path, skip_bad_records=True)
    assert len(records) == 3 and records.skipped == 1


# --------------------------------------------------------------------------------------------- #
# Options and files the user must fix: exit 2 naming them


@pytest.mark.parametrize(
    ("yaml_text", "named"),
    [
        ("epochs: .inf", "--epochs: expected a finite number > 0, got inf"),
        ("epochs: .nan", "--epochs: expected a finite number > 0, got nan"),
        ("peak_tflops: -5", "--peak-tflops: expected .* > 0, got -5.0"),
        ("peak_tflops: 0", "--peak-tflops: expected .* > 0, got 0.0"),
        ("lr: .inf", "--lr: expected a finite value >= 0, got inf"),
        ("run_name: ../outside", "--run-name: expected one folder name .* got '../outside'"),
        ("run_name: a/b", "--run-name: expected one folder name"),
        ("run_name: /abs/path", "--run-name: expected one folder name"),
    ],
)
def test_bad_numbers_and_run_names_are_usage_errors(tmp_path, capsys, yaml_text, named):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text + "\n")
    out = tmp_path / "out"
    assert cli.main(["train", "--config", str(path), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(named, err), err
    assert not out.exists()  # refused before anything was written


def test_garbage_weights_on_resume_name_the_checkpoint_file(tmp_path, llama_checkpoint, capsys):
    weights = llama_checkpoint / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(b"\xff" * size)  # same size: the manifest alone does not catch it
    cfg = tiny(tmp_path, max_steps=3)
    assert cli.main([*_cli_args(cfg), "--max-steps", "3", "--resume", str(llama_checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is damaged" in err and "header length" in err, err


def test_full_disk_while_appending_metrics_names_the_file(tmp_path, monkeypatch):
    from hf_varlen.training import metrics

    init = metrics.RunLogger.__init__

    def full_disk(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.path = "/dev/full"  # every write fails with ENOSPC

    monkeypatch.setattr(metrics.RunLogger, "__init__", full_disk)
    with pytest.raises(metrics.MetricsWriteError, match=r"step 1 to /dev/full failed: No space"):
        PackedTrainer(tiny(tmp_path, max_steps=1)).run()


# --------------------------------------------------------------------------------------------- #
# Metrics and trackers keep one history


def test_skipped_step_writes_null_not_bare_nan(tmp_path):
    from test_train_failures import nan_at_steps

    cfg = tiny(tmp_path, max_steps=2, on_nonfinite="skip", fused_loss="off")
    PackedTrainer(cfg, model_hook=nan_at_steps(2)).run()
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    records = [json.loads(line, parse_constant=_refuse) for line in text.splitlines()]
    assert records[1]["step"] == 2 and records[1]["loss"] is None and records[1]["skipped"]
    json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=_refuse)


def _refuse(name):
    raise ValueError(f"not JSON: {name}")


def test_resume_of_an_earlier_checkpoint_purges_tensorboards_dead_branch(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny(tmp_path, max_steps=3, save_every=2, report_to="tensorboard", run_name="tb")
    PackedTrainer(cfg).run()
    # resume from step 2 with another learning rate: step 3 is a new branch
    again = tiny(tmp_path, max_steps=3, report_to="tensorboard", run_name="tb", lr=5e-3)
    again.resume = str(tmp_path / "run" / "checkpoint-2")
    PackedTrainer(again).run()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "tb"))
    acc.Reload()
    for key in ("lr", "loss"):
        scalars = acc.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [1, 2, 3], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in records], rel=1e-6)


def test_every_sampler_over_its_budget_warns_under_the_default_filter():
    """Python's default filter shows a warning text once per code location: a second sampler
    built at the same line (a loop, a rebuilt loader) would build rows over its budget silently."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            TokenBudgetBatchSampler([40, 300, 120], 256)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert all("1 of 3 examples are longer than max_tokens=256" in m for m in messages)
    assert all(w.filename == __file__ for w in caught)  # points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the user's filters still apply
        with pytest.raises(UserWarning, match="PackingCollator\\(max_length=256\\)"):
            TokenBudgetBatchSampler([300], 256)
