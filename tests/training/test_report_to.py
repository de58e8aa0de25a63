"""`hf-varlen train --report-to` (issue 15 item 7): accelerate's trackers get loss, tokens/s,
packing efficiency, peak memory, lr and gradient norm every logged step; a tracker whose package is
missing is one usage error naming the pip package. Tested with tensorboard's event files on CPU.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from hf_varlen import cli
from hf_varlen.training import PackedTrainer, TrainConfig
from hf_varlen.training.loop import TRACKED

TINY = ["--builtin-examples", "48", "--max-length", "256", "--tokens-per-batch", "512"]
TINY += ["--no-progress", "--no-save-final"]


@pytest.mark.parametrize("tracker, package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_tracker_package_is_a_usage_error(tmp_path, capsys, monkeypatch, tracker, package):
    # accelerate lists the installed trackers when accelerate.tracking is first imported: that
    # must not happen under the patch below (it would hide tensorboard from later tests).
    import accelerate.tracking  # noqa: F401

    real = importlib.util.find_spec
    hidden = {"tensorboard", "tensorboardX", "wandb"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in hidden else real(n, *a)
    )
    out = tmp_path / "run"
    code = cli.main(["train", "--output-dir", str(out), *TINY, "--report-to", tracker])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"hf-varlen: error: --report-to {tracker} needs the `{package}` package" in err
    assert f"pip install {package}" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written


def test_unknown_tracker_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--report-to", "tensorbored"])
    assert exit_info.value.code == 2 and "--report-to" in capsys.readouterr().err


def test_a_tracker_accelerate_drops_is_an_error_not_a_warning(tmp_path, monkeypatch, capsys):
    """The package is importable but accelerate did not list it: refused, not silently untracked."""
    pytest.importorskip("tensorboard")
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "_available_trackers", [])
    code = cli.main(
        ["train", "--output-dir", str(tmp_path / "run"), *TINY, "--report-to", "tensorboard"]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--report-to tensorboard: accelerate found no such tracker installed" in err


def test_tensorboard_gets_every_logged_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    cfg = TrainConfig(
        output_dir=str(out),
        builtin_examples=48,
        max_length=256,
        tokens_per_batch=512,
        progress=False,
        save_final=False,
        max_steps=3,
        eval_split=0.2,
        report_to="tensorboard",
        run_name="tb-test",
    )
    PackedTrainer(cfg).run()
    (events,) = list((out / "tensorboard" / "tb-test").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"train/{k}" for k in TRACKED} <= tags and "eval/loss" in tags
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    for key in TRACKED:
        scalars = acc.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [1, 2, 3], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in steps], rel=1e-6)
    assert [s.value for s in acc.Scalars("eval/loss")] == pytest.approx(
        [r["eval_loss"] for r in records if "eval_loss" in r], rel=1e-6
    )
    assert 0 < acc.Scalars("train/packing_efficiency")[0].value <= 1
    assert acc.Scalars("train/peak_mem_gib")[0].value > 0
    # the event files belong to the run: --overwrite-output-dir removes them with it
    cfg.overwrite_output_dir, cfg.max_steps = True, 1
    PackedTrainer(cfg).run()
    (events,) = list((out / "tensorboard" / "tb-test").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == [1]
