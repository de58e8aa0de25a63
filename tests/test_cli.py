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

ROOT = Path(__file__).resolve().parents[1]
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
    assert "hf-varlen train: error: argument --max-steps" in capsys.readouterr().err


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
    try:
        json.loads("{")
    except ValueError as exc:
        assert cli._message(exc).startswith("JSONDecodeError: ")
    from hf_varlen.training import TrainConfig

    try:
        TrainConfig(epochs=0).validate()
    except ValueError as exc:
        assert cli._message(exc) == "--epochs: expected > 0, got 0"


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
    assert code == 1 and time.perf_counter() - t0 < 60
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

    from hf_varlen.training.model import _kernels_text

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
