"""examples/*.py run as their docstrings say: offline by default, on the CPU, in a few steps.

Each example runs in a fresh interpreter with the Hub switched off (``HF_HUB_OFFLINE=1``, an
endpoint nothing listens on) and an empty Hugging Face cache, so a default that needs a download
fails here. Each docstring says what the example needs ("Needs: ..."), and a missing optional
package is one line naming the extra to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
# The fewest steps and smallest shapes that still train (two steps: a loss before and after).
FAST_FLAGS = {
    "quickstart.py": ["--steps", "2", "--tokens-per-batch", "512"],
    "hf_trainer.py": [
        "--max-steps",
        "2",
        "--examples",
        "16",
        "--batch-size",
        "4",
        "--max-length",
        "256",
    ],
    "trl_sft.py": ["--max-steps", "2", "--examples", "16"],
}


def _offline_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HOME=str(tmp_path / "hf-home"),  # an empty cache: nothing downloaded earlier helps
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_ENDPOINT="http://127.0.0.1:9",  # and nothing listens there, were it asked anyway
        CUDA_VISIBLE_DEVICES="",
    )
    return env


def _run(tmp_path: Path, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=_offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_example_has_fast_flags_and_says_what_it_needs():
    assert sorted(FAST_FLAGS) == EXAMPLES
    for name in EXAMPLES:
        doc = (ROOT / "examples" / name).read_text().split('"""')[1]
        assert "Needs: " in doc, name
        assert "../shared/data" not in doc, name  # the project's data is not the user's


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_offline_on_the_cpu(tmp_path, name):
    script = str(ROOT / "examples" / name)
    flags = list(FAST_FLAGS[name])
    if "--max-steps" in flags:
        flags += ["--output-dir", str(tmp_path / "out")]
    proc = _run(tmp_path, [script, *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "loss" in last and "->" in last, proc.stdout[-2000:]


def test_trl_example_without_trl_names_the_extra(tmp_path):
    code = (
        "import runpy, sys; sys.modules['trl'] = None; "  # `import trl` -> ImportError
        f"sys.argv = [{str(ROOT / 'examples' / 'trl_sft.py')!r}]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = _run(tmp_path, ["-c", code])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "examples/trl_sft.py needs TRL and datasets (trl is missing): pip install 'hf_varlen[trl]'"
    ]
