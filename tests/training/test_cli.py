"""The `hf-varlen` command line as a first-time user meets it (issue 15 items 1, 2 and 4).

Errors are one `hf-varlen: error: ...` line (exit 2 for usage / configuration, 1 for failures
while training), tracebacks only with --debug or HF_VARLEN_DEBUG=1; --help reads cleanly and parses
without loading the training loop; local paths are paths (a typo is "no such file or folder" with
the closest name), Hub ids fail fast and once when the Hub cannot be reached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_varlen import cli
from hf_varlen.training import sources

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--builtin-examples", "48", "--max-length", "256", "--tokens-per-batch", "512"]
TINY += ["--no-progress", "--no-save-final"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------- #
# 1. Errors and exit codes


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
        (["--max-length", "512", "--tokens-per-batch", "256"], "--tokens-per-batch: expected >="),
        (["--attn-backend", "nope"], "--attn-backend 'nope'"),
        (["--resume", "no/such/checkpoint-3"], "--resume: expected a checkpoint folder"),
        (["--fused-lora"], "--fused-lora applies to LoRA training: add --lora"),
        (["--lora", "--load-in-4bit", "--precision", "fp32"], "--load-in-4bit computes in bf16"),
    ],
)
def test_configuration_error_is_one_line_and_exit_2(tmp_path, capsys, flags, message):
    code, _, err = run_cli(capsys, "train", "--output-dir", str(tmp_path), *TINY, *flags)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("hf-varlen: error")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_missing_optional_package_is_a_usage_error(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    code, _, err = run_cli(capsys, "train", "--output-dir", str(tmp_path), *TINY, "--plot")
    assert code == 2 and "hf-varlen: error: --plot needs `matplotlib`" in err
    assert "Traceback" not in err


def test_bad_flag_value_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--max-steps", "many"])
    assert exit_info.value.code == 2
    # every CLI error is one `hf-varlen: error:` line (issue 44), argparse's too
    assert "hf-varlen: error: argument --max-steps" in capsys.readouterr().err


def test_unknown_command_exit_2(capsys):
    code, out, err = run_cli(capsys, "trian")
    assert code == 2 and "hf-varlen: error: unknown command 'trian'" in err
    assert "train" in out


def test_runtime_failure_exits_1(tmp_path, capsys, monkeypatch):
    from hf_varlen.training.metrics import RunLogger

    out = tmp_path / "run"
    # A file in the way of final/ at the start is refused before training (exit 2); one that
    # appears while the run trains fails the export at the end.
    close = RunLogger.close

    def close_then_block_final(self):
        close(self)
        (out / "final").write_text("not a folder")

    monkeypatch.setattr(RunLogger, "close", close_then_block_final)
    code, _, err = run_cli(
        capsys, "train", "--output-dir", str(out), *TINY[:-1], "--max-steps", "1"
    )
    assert code == 1
    assert "hf-varlen: error: cannot save the final model to" in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch, how):
    argv = ["train", "--output-dir", str(tmp_path), *TINY, "--max-steps", "0"]
    if how == "flag":
        argv.append("--debug")
    else:
        monkeypatch.setenv("HF_VARLEN_DEBUG", "1")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert "Traceback (most recent call last)" in err and "hf-varlen: error: --max-steps" in err


def test_errors_from_other_libraries_keep_their_type():
    with pytest.raises(ValueError) as json_error:
        json.loads("{")
    assert cli._message(json_error.value).startswith("JSONDecodeError: ")
    from hf_varlen.training import TrainConfig

    with pytest.raises(ValueError) as config_error:
        TrainConfig(epochs=0).validate()
    assert cli._message(config_error.value) == "--epochs: expected > 0, got 0"


def test_help_is_clean_and_parsing_loads_no_training_loop():
    code = (
        "import sys, time; t = time.perf_counter(); from hf_varlen import cli; "
        "cli._train_parser().parse_args(['--max-steps', '3']); "
        "print(sorted(m for m in ('hf_varlen.training.loop', 'hf_varlen.training.data', "
        "'hf_varlen.training.model', 'datasets', 'peft', 'torch', 'transformers', 'accelerate') "
        "if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
    text = cli._train_parser().format_help()
    assert "(default: None)" not in text and "GPUs only) (default" not in text
    assert "--on-nonfinite {stop,skip}" in text and "--overwrite-output-dir" in text
    assert "--debug" in text


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["plot", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    """The console script imports the hf_varlen package first: it must stay cheap (was ~6 s)."""
    code = (
        "import sys; from hf_varlen.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'accelerate', 'triton') "
        "if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stdout, proc.stdout[-500:]
    assert "usage:" in proc.stdout


@pytest.mark.parametrize(
    "imports",
    [
        "import hf_varlen, transformers",
        "import transformers, hf_varlen",
        # TRL (and accelerate) probe with find_spec('transformers') before importing it: the
        # probe must not use up the registration hook
        "import hf_varlen, importlib.util; importlib.util.find_spec('transformers'); import transformers",
        "import hf_varlen, trl",
    ],
)
def test_import_hf_varlen_still_registers_varlen_packed(imports):
    """`import hf_varlen` registers the attention and mask functions, whatever comes first."""
    code = (
        f"{imports}\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "import hf_varlen\n"
        "print(hf_varlen.ATTN_IMPLEMENTATION in AttentionInterface._global_mapping,\n"
        "      hf_varlen.ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping,\n"
        "      callable(hf_varlen.kernelize), hf_varlen.ops.__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True", "True", "hf_varlen.ops"], proc.stdout


# --------------------------------------------------------------------------------------------- #
# 2. Paths and Hub ids


@pytest.mark.parametrize(
    "text, data, path",
    [
        ("Qwen/Qwen2.5-0.5B", False, False),
        ("gpt2", False, False),
        ("tatsu-lab/alpaca", True, False),
        ("./my-model", False, True),
        ("../shared/data/alpaca/alpaca_500.json", True, True),
        ("runs/x/final", False, True),
        ("/abs/model", False, True),
        ("~/model", False, True),
        ("data.jsonl", True, True),
        ("my data", True, True),  # not a valid repo id
    ],
)
def test_what_looks_like_a_path(text, data, path):
    assert sources.looks_like_path(text, data=data) is path


def test_missing_local_path_names_the_closest(tmp_path, capsys, monkeypatch):
    (tmp_path / "alpaca").mkdir()
    (tmp_path / "alpaca" / "alpaca_5000.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no such file or folder; did you mean "):
        sources.local_or_hub("--dataset", "alpaca/alpaca_500.json", data=True)
    guess = sources.closest_existing("alpaka/alpaca_5000.json")
    assert guess == os.path.join("alpaca", "alpaca_5000.json")
    code, _, err = run_cli(
        capsys, "train", "--dataset", "alpaca/alpaca_500.json", "--output-dir", "run", *TINY
    )
    assert code == 2
    assert "--dataset 'alpaca/alpaca_500.json': no such file or folder; did you mean" in err
    assert "alpaca_5000.json" in err and "Traceback" not in err


def test_missing_tokenizer_folder_is_not_a_hub_id(tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "train", "--tokenizer", str(tmp_path / "tok"), "--output-dir", str(tmp_path), *TINY
    )
    assert code == 2 and "--tokenizer" in err and "no such file or folder" in err
    assert "Repo id" not in err


def test_unreachable_hub_fails_fast_once(tmp_path, capsys, monkeypatch):
    sources.hub_reachable.cache_clear()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    t0 = time.perf_counter()
    code, _, err = run_cli(
        capsys, "train", "--model", "no-such-org/no-such-model", "--output-dir", str(tmp_path)
    )
    sources.hub_reachable.cache_clear()
    # no network is a usage error (exit 2, like a missing local path), not a training failure
    assert code == 2 and time.perf_counter() - t0 < 60
    lines = [ln for ln in err.splitlines() if "hf-varlen: error" in ln]
    assert len(lines) == 1 and "cannot be reached" in lines[0] and "local folder" in lines[0]


def test_offline_mode_names_the_missing_cache_entry(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match=r"HF_HUB_OFFLINE=1 and it is not in the local cache"):
        sources.hub_access("--model", "no-such-org/no-such-model")


# --------------------------------------------------------------------------------------------- #
# 4. Summary and log wording


def test_summary_wording(tmp_path, capsys):
    code, out, _ = run_cli(
        capsys, "train", "--output-dir", str(tmp_path), *TINY, "--max-steps", "2"
    )
    assert code == 0
    assert "built-in synthetic instructions" in out and "builtin (alpaca)" not in out
    assert "threads)" not in out
    assert "real (packing efficiency)" in out and "padded to their longest example" in out


def test_kernel_report_names_reasons_not_python_objects():
    from types import SimpleNamespace

    from hf_varlen.training.model_kernels import _kernels_text

    why = "the Triton kernels cannot run on device type 'cpu'; pass device='cuda' when ..."
    report = SimpleNamespace(
        path="kernels",
        counts={"rmsnorm": 0, "cross_entropy": 1},
        left_alone={f"model.layers.{i}.mlp": why for i in range(3)},
    )
    text = _kernels_text(report)
    assert text == (
        "hf_varlen.kernelize [kernels]: replaced cross_entropy x1; left 3 modules alone: "
        "the Triton kernels cannot run on device type 'cpu'"
    )


def test_one_definition_of_padding_for_packed_and_padded(tmp_path):
    from hf_varlen.training import PackedTrainer, TrainConfig

    common = dict(builtin_examples=48, max_length=256, batch_size=6, max_steps=3)
    common.update(progress=False, save_final=False)
    packed = PackedTrainer(TrainConfig(output_dir=str(tmp_path / "a"), **common)).run()
    padded = PackedTrainer(TrainConfig(output_dir=str(tmp_path / "b"), padded=True, **common)).run()
    assert packed["packing_efficiency"] == 1.0
    # what the packed run says padding would cost is what the padded run computed
    assert packed["padded_efficiency"] == pytest.approx(padded["packing_efficiency"])
    assert padded["padded_efficiency"] == pytest.approx(padded["packing_efficiency"])
    assert packed["padded_efficiency"] < 1.0


# --------------------------------------------------------------------------------------------- #
# 5. Issue 44: help, version, typos, Hub errors, advice that works, demo data


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def test_help_lists_common_options_first_then_headed_groups():
    from hf_varlen.training.config import COMMON, HELP_GROUPS

    text = cli._train_parser().format_help()
    titles = ["common options", *(t.split(" (")[0] for t in HELP_GROUPS)]
    where = [text.index(f"\n{title}") for title in titles]
    assert where == sorted(where), titles
    common = text[where[0] : where[1]]
    for name in COMMON:
        assert f"--{name.replace('_', '-')} " in common, name
    assert "--config FILE.yaml" in common
    # on/off defaults are shown, in the group of their topic
    compile_group = text[text.index("\ncompile and CUDA graphs") :]
    assert "--compile, --no-compile" in compile_group
    compile_help = compile_group[: compile_group.index("--compile-backend")]
    assert "(default: off)" in " ".join(compile_help.split())
    assert "(default: on)" in " ".join(text[text.index("--shuffle, --no-shuffle") :].split()[:30])
    assert "--max-steps N" in common and "(default: 1024)" in common  # --max-length
    assert "--debug" in text[text.index("\nlogging and metrics") :]
    assert len(text.splitlines()) < 230


def test_every_option_is_in_one_help_group():
    import dataclasses

    from hf_varlen.training.config import COMMON, HELP_GROUPS, TrainConfig

    grouped = [*COMMON, *(n for names in HELP_GROUPS.values() for n in names)]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(TrainConfig))


def test_version(capsys):
    from hf_varlen import __version__

    code, out, err = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"hf-varlen {__version__}" and not err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-varlen {__version__}"


@pytest.mark.parametrize(
    "argv, wrong, right",
    [
        (["--max-stpes", "5"], "--max-stpes", "--max-steps"),
        (["--max-step", "5"], "--max-step", "--max-steps"),  # an abbreviation is refused
        (["--lr-sched=cosine"], "--lr-sched", "--lr-schedule"),
        (["--max-steps", "3", "--no-progess"], "--no-progess", "--no-progress"),
    ],
)
def test_misspelled_flag_is_one_line_with_the_closest(capsys, argv, wrong, right):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", *argv])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and not out
    assert _error_lines(err) == [
        f"hf-varlen: error: unrecognized argument {wrong} (did you mean {right}?)"
    ]


def test_abbreviations_are_refused_by_the_python_parser_too():
    from hf_varlen.training.config import parse_args

    assert parse_args(["--max-steps", "4"]).max_steps == 4
    with pytest.raises(SystemExit):
        parse_args(["--max-step", "4"])


def test_unknown_command_suggests_the_closest(capsys):
    code, _, err = run_cli(capsys, "trian")
    assert code == 2
    assert _error_lines(err) == [
        "hf-varlen: error: unknown command 'trian' (did you mean 'train'?)"
    ]


@pytest.mark.parametrize(
    "flag, typo, right",
    [("--model", "tiny-lama", "tiny-llama"), ("--model", "Tiny-Qwen3", "tiny-qwen3"),
     ("--dataset", "biultin", "builtin")],
)  # fmt: skip
def test_preset_typo_says_did_you_mean_without_the_hub(
    tmp_path, capsys, monkeypatch, flag, typo, right
):
    def no_hub(*args, **kwargs):
        raise AssertionError("a preset typo must not go to the Hub")

    from hf_varlen.training import data, model

    for module, name in ((model, "hub_access"), (data, "dataset_access")):
        monkeypatch.setattr(module, name, no_hub)  # the names the loaders call
    monkeypatch.setattr(sources, "hub_reachable", no_hub)
    code, _, err = run_cli(capsys, "train", flag, typo, "--output-dir", str(tmp_path / "run"))
    assert code == 2
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"hf-varlen: error: {flag} {typo!r}"), err
    assert lines[0].endswith(f"did you mean {right!r}?")
    assert not (tmp_path / "run").exists()


def test_a_local_folder_near_a_preset_name_is_a_path(tmp_path, monkeypatch):
    from hf_varlen.training import TrainConfig

    (tmp_path / "tiny-lama").mkdir()
    monkeypatch.chdir(tmp_path)
    TrainConfig(model="tiny-lama").validate()  # a folder: no typo error (loading decides)
    with pytest.raises(ValueError, match="did you mean 'tiny-llama'"):
        TrainConfig(model="tiny-lamma").validate()


@pytest.mark.parametrize(
    "flag, value, fix",
    [
        ("--model", "no-such-org/no-such-model", "download it first"),
        ("--tokenizer", "no-such-org/no-such-tokenizer", "download it first"),
        ("--dataset", "no-such-org/no-such-dataset", "pass a local .json/.jsonl/.parquet file"),
    ],
)
def test_missing_hub_id_offline_is_exit_2_naming_the_option(
    tmp_path, capsys, monkeypatch, flag, value, fix
):
    argv = ["train", flag, value, "--output-dir", str(tmp_path), *TINY]
    if flag == "--dataset":
        # `datasets` reads HF_HUB_OFFLINE when first imported: a fresh process, as a user runs it
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "hf_varlen.cli", *argv],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        code, err = proc.returncode, proc.stderr
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if "hf-varlen: error" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"hf-varlen: error: {flag} {value!r}"), err
    assert "HF_HUB_OFFLINE=1" in lines[0] and fix in lines[0] and "Traceback" not in err


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = run_cli(capsys, "plot", str(tmp_path))
    assert code == 2 and not out
    assert _error_lines(err) == [
        "hf-varlen: error: hf-varlen plot needs matplotlib: pip install 'hf_varlen[plot]'"
    ]


def _interrupt_at(monkeypatch, step: int) -> None:
    """Ctrl-C while training optimizer step ``step`` (1-based)."""
    from hf_varlen.training.loop import PackedTrainer

    # the run launches each step once (launch_step, then finish_step reads it back)
    real, calls = PackedTrainer.launch_step, []

    def launch_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PackedTrainer, "launch_step", launch_step)


def test_ctrl_c_says_how_to_resume_and_that_command_resumes(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    argv = ["train", "--output-dir", out, *TINY, "--max-steps", "4", "--save-every", "1"]
    _interrupt_at(monkeypatch, 3)
    code, _, err = run_cli(capsys, *argv)
    monkeypatch.undo()
    assert code == 130
    lines = [ln for ln in err.splitlines() if ln.startswith("hf-varlen:")]
    assert len(lines) == 1 and lines[0].startswith("hf-varlen: interrupted; "), err
    assert os.path.join(out, "checkpoint-2") in lines[0]
    command = lines[0].split("to continue from it: ", 1)[1]
    assert command.startswith("hf-varlen train ") and command.endswith(" --resume latest")
    # the "already holds a run" advice: this run has checkpoints, so --resume latest is offered
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "Pass --resume latest to continue it" in err
    # and the printed command resumes it to the end
    import shlex

    code, stdout, err = run_cli(capsys, *shlex.split(command)[1:])
    assert code == 0, err
    saved = [ln for ln in stdout.splitlines() if ln.startswith("saved ")]
    assert saved[0] == f"saved {os.path.join(out, 'checkpoint-3')}", stdout  # went on from step 2
    assert os.path.isdir(os.path.join(out, "checkpoint-4"))


def test_ctrl_c_without_checkpoint_says_so_and_advice_skips_resume(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    argv = ["train", "--output-dir", out, *TINY, "--max-steps", "3"]
    _interrupt_at(monkeypatch, 2)
    code, _, err = run_cli(capsys, *argv)
    monkeypatch.undo()
    assert code == 130
    assert "hf-varlen: interrupted; no checkpoint was saved in" in err and "--save-every" in err
    code, _, err = run_cli(capsys, *argv)
    line = _error_lines(err)[-1]
    assert code == 2 and "already holds a run" in line, err
    # --resume latest would fail here (no checkpoint): not offered
    assert "--resume latest" not in line and "--overwrite-output-dir" in line
    assert "another --output-dir" in line


def test_save_total_limit_keeps_the_newest_and_one_line_each(tmp_path, capsys, caplog, monkeypatch):
    import logging

    from hf_varlen.training import checkpoint

    monkeypatch.setattr(checkpoint._SharedTensorNote, "said", False)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "checkpoint-best").mkdir()  # not a checkpoint-<step> folder: never deleted
    caplog.set_level(logging.INFO)
    code, stdout, err = run_cli(
        capsys, "train", "--output-dir", str(out), *TINY[:-1], "--max-steps", "4",
        "--save-every", "1", "--save-total-limit", "2",
    )  # fmt: skip
    assert code == 0, err
    assert sorted(os.listdir(out)) == sorted(
        ["notes.txt", "checkpoint-best", "checkpoint-3", "checkpoint-4", "final", "config.yaml",
         "metrics.jsonl", "summary.json"]
    )  # fmt: skip
    saved = [ln for ln in stdout.splitlines() if ln.startswith("saved ")]
    assert saved[0] == f"saved {out / 'checkpoint-1'}" and len(saved) == 4
    assert saved[-1].endswith("(removed checkpoint-2: --save-total-limit keeps the newest)")
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "Removed shared tensor" in m or "Saving" in m]
    assert not [r for r in caplog.records if r.name.startswith("accelerate.checkpointing")]
    assert len([m for m in messages if "tied weights once" in m]) == 1
    assert "save_total_limit: 2" in (out / "config.yaml").read_text()


def test_save_total_limit_config_key_and_checks(tmp_path):
    from hf_varlen.training import TrainConfig
    from hf_varlen.training.config import load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("save_every: 5\nsave_total_limit: 3\n")
    assert load_config_file(str(path)) == {"save_every": 5, "save_total_limit": 3}
    TrainConfig(save_every=5, save_total_limit=3).validate()
    with pytest.raises(ValueError, match=r"--save-total-limit 3 .* pass --save-every N too"):
        TrainConfig(save_total_limit=3).validate()
    with pytest.raises(ValueError, match="--save-total-limit must be >= 1"):
        TrainConfig(save_every=5, save_total_limit=0).validate()


def test_builtin_data_is_long_tailed_and_deterministic():
    import numpy as np

    from hf_varlen.training.builtin import builtin_records
    from hf_varlen.training.run_summary import padded_alternative

    records = builtin_records(2000)
    assert records == builtin_records(2000) and records != builtin_records(2000, seed=1)
    lengths = np.array(
        [sum(len(str(v).encode()) for v in r.values()) + 40 for r in records]  # + the template
    )
    median, p90, p99 = np.percentile(lengths, [50, 90, 99])
    assert median < 250 and p90 > 2 * median and p99 > 4 * median, (median, p90, p99)
    # a padded trainer's shuffled batches of 16 would be mostly padding, as with Alpaca
    assert padded_alternative(np.minimum(lengths, 1024), len(lengths) // 16, 0)["efficiency"] < 0.5


def test_main_job_summary_shows_the_padding_it_avoids(tmp_path, capsys):
    """The main job's data (default --max-length), cut to one step of half the token budget."""
    import re

    code, out, err = run_cli(
        capsys, "train", "--output-dir", str(tmp_path), "--builtin-examples", "96",
        "--tokens-per-batch", "2048", "--max-steps", "1", "--no-progress", "--no-save-final",
    )  # fmt: skip
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("  vs padded"))
    real = float(re.search(r"would be ([\d.]+)% real", line).group(1))
    avoided = float(re.search(r"avoids computing ([\d.]+)% padding", line).group(1))
    assert real < 50 and avoided == pytest.approx(100 - real, abs=0.11), line
    tokens = out.splitlines().index(
        next(ln for ln in out.splitlines() if ln.startswith("  tokens"))
    )
    assert out.splitlines()[tokens + 1] == line  # right under the tokens line


@pytest.mark.parametrize(
    "flags, package, extra",
    [(["--lora"], "peft", "peft"), (["--plot"], "matplotlib", "plot"),
     (["--report-to", "tensorboard"], "tensorboard", "tensorboard")],
)  # fmt: skip
def test_missing_optional_package_names_its_extra(tmp_path, monkeypatch, flags, package, extra):
    import accelerate.tracking  # noqa: F401  (lists trackers at import: not under the patch)

    from hf_varlen.training.config import parse_args

    real = importlib.util.find_spec
    hidden = {package, "tensorboardX"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in hidden else real(n, *a)
    )
    cfg = parse_args(["--output-dir", str(tmp_path), *flags])
    with pytest.raises(ImportError, match=rf"pip install 'hf_varlen\[{extra}\]'"):
        cfg.validate()


@pytest.mark.parametrize("gated", [False, True])
def test_hub_without_such_model_is_exit_2_naming_the_option(tmp_path, capsys, monkeypatch, gated):
    """Online, the Hub answers 404 (or gated); transformers re-raises it as a bare OSError."""
    import httpx2
    import transformers
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from hf_varlen.training import model

    url = "https://huggingface.co/api/models/no-such-org/no-such-model"
    answer = httpx2.Response(404, request=httpx2.Request("GET", url))
    error = (GatedRepoError if gated else RepositoryNotFoundError)("404", response=answer)

    def from_pretrained(*args, **kwargs):
        try:
            raise error
        except RepositoryNotFoundError as exc:
            raise OSError("no-such-org/no-such-model is not a local folder and ...") from exc

    monkeypatch.setattr(model, "hub_access", lambda *a, **k: {})  # as if the Hub were reachable
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    argv = ["train", "--model", "no-such-org/no-such-model", "--output-dir", str(tmp_path)]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    lines = _error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("hf-varlen: error: --model 'no-such-org/no-such-model': ")
    assert ("hf auth login" in lines[0]) and (("gated" in lines[0]) is gated)
