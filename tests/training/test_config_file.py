"""`hf-varlen train --config run.yaml` (issue 15 item 7): every option as a YAML key (the flag names
with underscores), flags override the file, unknown keys name the closest valid one, and the
resolved options saved as OUTPUT_DIR/config.yaml re-run the same training.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from hf_varlen import cli
from hf_varlen.training import TrainConfig, parse_args
from hf_varlen.training.config import load_config_file

TINY = dict(builtin_examples=48, max_length=256, tokens_per_batch=512, progress=False)
TINY.update(save_final=False)


def write(path, data) -> str:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def test_file_sets_options_and_flags_override_it(tmp_path):
    path = write(tmp_path / "run.yaml", {**TINY, "max_steps": 2, "lr": 0.002, "format": "alpaca"})
    cfg = parse_args(["--config", path, "--max-steps", "3", "--no-shuffle"])
    assert cfg.max_steps == 3 and cfg.shuffle is False  # flags win
    assert cfg.lr == 0.002 and cfg.format == "alpaca" and cfg.builtin_examples == 48  # file
    assert cfg.seed == 0  # neither: the default


def test_every_option_round_trips_through_a_file(tmp_path):
    changed = TrainConfig(
        model="tiny-qwen3",
        tokenizer=None,
        lr=3e-4,
        epochs=2,  # an int in YAML for a float option
        warmup_steps=0,
        completion_only=False,
        report_to="none",
        fused_loss="off",
        peak_tflops=None,
    )
    changed.save_yaml(str(tmp_path / "config.yaml"))
    values = load_config_file(str(tmp_path / "config.yaml"))
    assert set(values) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert TrainConfig(**values) == changed and isinstance(values["epochs"], float)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"max_step": 3}, "unknown key 'max_step'; did you mean 'max_steps'?"),
        ({"max-steps": 3}, "unknown key 'max-steps'; did you mean 'max_steps'?"),
        ({"tokenz_per_batch": 3}, "did you mean 'tokens_per_batch'?"),
        ({"max_steps": "ten"}, "max_steps: expected an integer or null, got 'ten'"),
        ({"shuffle": "yes please"}, "shuffle: expected true or false, got 'yes please'"),
        ({"lr": "fast"}, "lr: expected a number or null, got 'fast'"),
        ("- max_steps\n- 3\n", "expected a mapping of options"),
        ("max_steps: [1\n", "not valid YAML"),
    ],
)
def test_bad_file_is_one_usage_error_naming_the_key(tmp_path, capsys, data, message):
    path = write(tmp_path / "run.yaml", data)
    with pytest.raises(ValueError, match="--config "):
        load_config_file(path)
    code = cli.main(["train", "--config", path, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("hf-varlen: error")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_missing_file_names_the_closest(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("max_steps: 1\n")
    code = cli.main(["train", "--config", "runs.yaml"])
    err = capsys.readouterr().err
    assert code == 2 and "--config 'runs.yaml': no such file; did you mean 'run.yaml'?" in err


def test_choices_in_the_file_are_checked(tmp_path, capsys):
    path = write(tmp_path / "run.yaml", {**TINY, "format": "markdown"})
    code = cli.main(["train", "--config", path, "--output-dir", str(tmp_path / "out")])
    assert code == 2 and "--format: expected one of" in capsys.readouterr().err


def test_help_lists_config():
    assert "--config FILE.yaml" in cli._train_parser().format_help()


def test_saved_config_reruns_the_same_training(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    path = write(tmp_path / "run.yaml", {**TINY, "max_steps": 2, "output_dir": str(first)})
    assert cli.main(["train", "--config", path, "--seed", "3"]) == 0
    saved = yaml.safe_load((first / "config.yaml").read_text())
    assert saved["seed"] == 3 and saved["max_steps"] == 2 and saved["output_dir"] == str(first)
    # the same folder holds a run now: re-launching there is refused, elsewhere it repeats it
    assert cli.main(["train", "--config", str(first / "config.yaml")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    again = ["train", "--config", str(first / "config.yaml"), "--output-dir", str(second)]
    assert cli.main(again) == 0
    losses = [
        [json.loads(ln)["loss"] for ln in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (first, second)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert yaml.safe_load((second / "config.yaml").read_text()) == {
        **saved,
        "output_dir": str(second),
    }
