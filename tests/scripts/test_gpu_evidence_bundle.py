"""gpu_evidence.sh's ``bundle`` stage: one archive that still comes back from the GPU machine.

The machine returns no file past a size limit, so a bundle that swallowed a saved model (a 1B model
is ~2.4 GB) lost every result of its call. The stage leaves such files out and names them.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_evidence" / "gpu_evidence.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar"
)


def test_bundle_leaves_out_files_over_the_limit_and_names_them(tmp_path):
    out = tmp_path / "out"
    (out / "compile" / "cache" / "models").mkdir(parents=True)
    (out / "compile" / "e2e_tables.md").write_text("| table |\n")
    (out / "compile" / "cache" / "models" / "model.safetensors").write_bytes(b"\0" * (2 << 20))
    # run from a folder without .gpu-wheels: the stage installs nothing
    cwd = tmp_path / "tree"
    cwd.mkdir()
    res = subprocess.run(
        ["bash", str(SCRIPT), "bundle", str(out)],
        cwd=cwd, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HF_VARLEN_BUNDLE_MAX_MB": "1",
             "HF_VARLEN_SHARED_DATA": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "left out of the bundle" in res.stdout and "model.safetensors" in res.stdout
    assert sorted(p.name for p in out.iterdir()) == ["bundle.tgz"]
    with tarfile.open(out / "bundle.tgz") as tar:
        names = tar.getnames()
    assert "./compile/e2e_tables.md" in names
    assert not [n for n in names if n.endswith("model.safetensors")]


def test_bundle_keeps_everything_under_the_limit(tmp_path):
    out = tmp_path / "out"
    (out / "trl").mkdir(parents=True)
    (out / "trl" / "results.json").write_text("{}")
    (out / "step.log").write_text("ok\n")
    cwd = tmp_path / "tree"
    cwd.mkdir()
    res = subprocess.run(
        ["bash", str(SCRIPT), "bundle", str(out)],
        cwd=cwd, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HF_VARLEN_SHARED_DATA": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "left out" not in res.stdout
    with tarfile.open(out / "bundle.tgz") as tar:
        assert {"./trl/results.json", "./step.log"} <= set(tar.getnames())
