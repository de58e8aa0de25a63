"""The README's promises, checked: its quick starts run as written, its links resolve, and its
set-up commands are the ones CI runs.

Python blocks run in order in one scratch folder (the later ones load the ``tiny-llama`` folder the
first one saves), each in a fresh namespace, on the CPU. A block whose first line is the comment
``# needs: network`` is a Hub example: it is skipped here by that marker, never run. The offline
lines of the bash quick start (the ``my.jsonl`` heredoc and the line marked ``offline``) run with
this tree's CLI.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NETWORK_MARKER = "# needs: network"

# Pages other branches add; until they land a link to one of them fails the link check below,
# which names it (the list is here so that the failure message says which branch brings it).
PAGES_FROM_OTHER_BRANCHES = {
    "rules.md",
    "attention-numerics.md",
    "lora.md",
    "models.md",
    "trainers-captured.md",
    "benchmarks-peers.md",
}

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def fenced_blocks(text: str, lang: str) -> list[str]:
    return [body for tag, body in _FENCE.findall(text) if tag == lang]


def test_readme_python_quick_starts_run_offline(tmp_path, monkeypatch):
    blocks = fenced_blocks(README.read_text(encoding="utf-8"), "python")
    offline = [b for b in blocks if not b.startswith(NETWORK_MARKER)]
    assert len(offline) >= 3, "the own-loop, Trainer and SFTTrainer quick starts"
    monkeypatch.chdir(tmp_path)
    for i, block in enumerate(offline):
        code = compile(block, f"README.md python block {i + 1}", "exec")
        exec(code, {"__name__": f"readme_block_{i + 1}"})
    assert (tmp_path / "tiny-llama" / "config.json").exists()
    assert (tmp_path / "runs" / "trainer").is_dir()
    assert (tmp_path / "runs" / "sft").is_dir()


def test_readme_own_data_quick_start_runs_offline(tmp_path):
    """The heredoc that writes my.jsonl and the offline `hf-varlen train` line, as written (the
    console script is called through this interpreter so that this tree's hf_varlen runs)."""
    bash = "\n".join(fenced_blocks(README.read_text(encoding="utf-8"), "bash"))
    heredoc = re.search(r"^cat > my\.jsonl <<'EOF'\n.*?^EOF\n", bash, re.S | re.M)
    assert heredoc, "README: the my.jsonl heredoc"
    lines = [ln for ln in bash.splitlines() if ln.startswith("hf-varlen train --dataset my.jsonl")]
    offline = [ln for ln in lines if ln.rstrip().endswith("offline")]
    assert len(offline) == 1, lines
    command = offline[0].replace("hf-varlen", f"{sys.executable} -m hf_varlen.cli", 1)
    script = heredoc.group(0) + command + " --no-progress\n"
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # Its own --output-dir, so that it does not collide with the main job's runs/hf-varlen.
    assert [p.parent.name for p in (tmp_path / "runs").glob("*/summary.json")] == ["mine"]


def _relative_links(md: Path) -> list[str]:
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))  # links inside code are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize(
    "md",
    [README, *sorted((ROOT / "docs").glob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_point_to_existing_files(md):
    missing = []
    for target in _relative_links(md):
        path = (md.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            note = " (a page another branch adds)" if path.name in PAGES_FROM_OTHER_BRANCHES else ""
            missing.append(f"{target}{note}")
    assert not missing, f"{md.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    setup = [
        b.strip()
        for b in fenced_blocks(README.read_text(encoding="utf-8"), "bash")
        if b.startswith("python3 -m venv")
    ]
    assert len(setup) == 2, setup
    main_job, tests = setup
    assert "\n" not in main_job and "\n" not in tests, "each set-up command is one line"
    assert main_job.endswith("hf-varlen train")
    assert tests.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    # .ci/run makes its own venv, then runs the README's command from after the venv activation.
    venv_part = "python3 -m venv .venv && . .venv/bin/activate && "
    assert tests.startswith(venv_part)
    assert ci[-1] == tests[len(venv_part) :], (ci[-1], tests)
