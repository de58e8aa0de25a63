"""scripts/bench_multigpu.py on the CPU: one process with accumulation 2 vs two gloo processes
(the DDP run with scripts/accelerate/cpu_2proc.yaml), a tiny Llama on the built-in data, fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_multigpu  # noqa: E402

pytestmark = pytest.mark.slow


def test_two_cpu_processes_scale_and_match(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = bench_multigpu.main(
        [
            "--runs",
            "single,ddp",
            "--ddp-config",
            str(ROOT / "scripts" / "accelerate" / "cpu_2proc.yaml"),
            "--tokens-per-batch",
            "256",
            "--max-length",
            "256",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    single, ddp = results["single"], results["ddp"]
    assert single["status"] == ddp["status"] == "ok", (single["status"], ddp["status"])
    assert single["processes"] == 1 and ddp["processes"] == 2
    assert ddp["same_tokens"] and len(ddp["losses"]) == 3
    assert ddp["max_rel_loss_gap"] < 1e-5  # the same packs each step, fp32
    assert ddp["scaling_efficiency"] > 0
    assert len(ddp["ranks"]["peak_mem_gib"]) == 2 and ddp["ranks"]["imbalance_worst"] >= 1.0
    text = (tmp_path / "multigpu.md").read_text()
    assert single["distribution"] == "one process" and ddp["distribution"] == "DDP over gloo"
    assert "| ddp | 2 | DDP over gloo |" in text and "(vs single)" in text and "Header:" in text
    # the middle step profiled on every rank (two gloo processes: their teardown once hung under
    # the profiler, until PackedTrainer.close() freed the DDP wrapper before the group)
    assert [p["rank"] for p in ddp["profile"]] == [0, 1] and len(single["profile"]) == 1
    assert all(p["step"] == 2 and p["comm_ms"] > 0 for p in ddp["profile"]), ddp["profile"]
    assert "| ddp | 1 | CPU ops |" in text


def test_one_cpu_process_profiled(tmp_path, monkeypatch):
    """The middle step profiled (its time left out of the throughput) and its per-rank table."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = bench_multigpu.main(
        ["--runs", "single", "--tokens-per-batch", "256", "--max-length", "256", "--steps", "3",
         "--out", str(tmp_path)]
    )  # fmt: skip
    (p,) = results["single"]["profile"]
    assert p["step"] == 2 and p["rank"] == 0 and p["step_ms"] > 0 and p["comm_ms"] == 0.0
    assert "| single | 0 | CPU ops |" in (tmp_path / "multigpu.md").read_text()


def test_two_cpu_processes_resume_identically(tmp_path, monkeypatch):
    """ddp-resume: the second launch, resumed from the first's step-2 checkpoint, repeats its
    steps 3-4 bit for bit (fp32, gloo)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = bench_multigpu.main(
        [
            "--runs", "ddp-resume",
            "--ddp-config", str(ROOT / "scripts" / "accelerate" / "cpu_2proc.yaml"),
            "--tokens-per-batch", "256", "--max-length", "256", "--steps", "4",
            "--profile-step", "0", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    r = results["ddp-resume"]
    assert r["status"] == "ok", r["status"]
    assert r["resume_step"] == 2 and r["resumed_steps"] == 2 and r["resume_identical"], r
    assert r["resume_max_rel_gap"] == 0.0 and r["processes"] == 2
    assert (tmp_path / "ddp-resume" / "straight" / "checkpoint-2").is_dir()
    assert (tmp_path / "ddp-resume_resumed.log").exists()
    text = (tmp_path / "multigpu.md").read_text()
    assert "saved at step 2, a second launch resumed from it ran steps 3-4" in text
    assert "identical to the first launch's: **yes**" in text


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_multigpu.parse_args(["--runs", "single,tp"])
    with pytest.raises(SystemExit):
        bench_multigpu.parse_args(["--processes", "1"])
    with pytest.raises(SystemExit):
        bench_multigpu.parse_args(["--steps", "3", "--profile-step", "4"])
    assert bench_multigpu.parse_args(["--steps", "30"]).profile_step == 15
    assert bench_multigpu.parse_args(["--profile-step", "0"]).profile_step == 0
    graphs = bench_multigpu.parse_args(["--runs", "single-graphs"])
    cmd = bench_multigpu.command("single-graphs", graphs, Path("run"))
    assert cmd[cmd.index("--cuda-graphs") + 1] == "on" and "--static-shapes" in cmd
    assert "single-graphs" not in bench_multigpu.parse_args([]).runs  # only when asked for
    assert bench_multigpu.parse_args(["--steps", "30"]).resume_step == 15
    with pytest.raises(SystemExit):
        bench_multigpu.parse_args(["--steps", "4", "--resume-step", "4"])
