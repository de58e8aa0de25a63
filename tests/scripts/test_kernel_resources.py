"""scripts/gpu_evidence/kernel_resources.py: the attention kernels compiled offline for sm_90
(triton's ptxas, no GPU), pointer loads vs tensor descriptors. Run in a subprocess: the test
session's TRITON_INTERPRET=1 turns every kernel into an interpreted one, which cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_evidence" / "kernel_resources.py"


def test_forward_compiles_for_sm90_with_and_without_descriptors(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--heads", "16/16/64", "--kernels", "fwd", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["path"], r["kernel"]) for r in rows] == [("short", "fwd"), ("long", "fwd")]
    for r in rows:
        ptr, tma = r["pointers"], r["tma"]
        assert ptr["tma_copies"] == 0 and tma["tma_copies"] > 0, r
        assert 0 < ptr["registers"] <= 255 and 0 < tma["registers"] <= 255, r
        assert ptr["shared_bytes"] > 0, r
    assert "| 16/16/64 | short | fwd | (128, 32, 4, 3) f1 |" in done.stdout


def test_bad_arguments_are_refused():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for args in (["--kernels", "fwd,bwd"], ["--heads", "32/5/128"]):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 2 and args[0] in done.stderr, done.stderr[-2000:]
