"""scripts/e2e_workers.py: bench_e2e's per-(model, mode) worker processes. A worker serves its
mode's cells one after another with the results a fresh process per cell gives; a cell that fails
or runs past its timeout ends its worker, and the next cell of that mode gets a new one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_e2e  # noqa: E402
from e2e_workers import WorkerPool  # noqa: E402

COMMON = ["--models", "tiny-llama", "--data", "builtin", "--tokenizer", "bytes"]
COMMON += ["--max-lengths", "256", "--steps", "3", "--warmup", "1"]


def _run(tmp_path, mode, batch_size, **extra):
    run = dict(
        model="tiny-llama", data="builtin", max_length=256, batch_size=batch_size, mode=mode,
        tokenizer="bytes", dataset="builtin", layers=None, steps=3, warmup=1, lr=1e-4, seed=0,
        precision="fp32", peak_tflops=None, compile_backend="inductor",
        run_dir=str(tmp_path / f"{mode}_B{batch_size}"),
    )  # fmt: skip
    return {**run, **extra}


@pytest.mark.slow
def test_workers_serve_each_mode_in_one_process_with_unchanged_results(tmp_path):
    """The default driver: two modes x two batch sizes, each mode's cells in one worker (cell
    0, then 1), the cells sent in grid order, and the same losses as in-process runs."""
    modes = "packed_sdpa,hf_varlen"
    args = ["--batch-sizes", "2,4", "--modes", modes]
    pooled = bench_e2e.main(COMMON + args + ["--out", str(tmp_path / "pooled")])
    inproc = bench_e2e.main(COMMON + args + ["--out", str(tmp_path / "inproc"), "--no-isolate"])
    order = [(r["run"]["batch_size"], r["run"]["mode"]) for r in pooled]
    assert order == [(2, "packed_sdpa"), (2, "hf_varlen"), (4, "packed_sdpa"), (4, "hf_varlen")]
    assert [r["status"] for r in pooled] == ["ok"] * 4, [r["status"] for r in pooled]
    assert [r["worker_cell"] for r in pooled] == [0, 0, 1, 1]
    for a, b in zip(pooled, inproc, strict=True):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
    logs = sorted(p.name for p in (tmp_path / "pooled" / "workers").iterdir())
    assert logs == ["tiny-llama_hf_varlen.log", "tiny-llama_packed_sdpa.log"]


@pytest.mark.slow
def test_a_failed_cell_ends_its_worker_and_the_next_cell_starts_a_new_one(tmp_path):
    pool = WorkerPool(ROOT / "scripts" / "bench_e2e.py", tmp_path / "workers")
    try:
        missing = str(tmp_path / "no_such_data.json")
        bad = pool.run(_run(tmp_path, "packed_sdpa", 2, dataset=missing), timeout=300)
        assert bad["status"].startswith("error: ") and "no_such_data" in bad["status"], bad
        assert not pool.workers  # stopped
        good = pool.run(_run(tmp_path, "packed_sdpa", 4), timeout=300)
        assert good["status"] == "ok" and good["worker_cell"] == 0  # a new process
        again = pool.run(_run(tmp_path, "packed_sdpa", 2), timeout=300)
        assert again["status"] == "ok" and again["worker_cell"] == 1
    finally:
        pool.close()
    assert not pool.workers


def test_a_cell_past_its_timeout_is_reported_and_its_worker_killed(tmp_path):
    pool = WorkerPool(ROOT / "scripts" / "bench_e2e.py", tmp_path / "workers")
    try:
        result = pool.run(_run(tmp_path, "packed_sdpa", 2), timeout=0.5)  # imports alone: > 0.5 s
        assert result["status"].startswith("timeout after"), result
        assert not pool.workers
    finally:
        pool.close()


def test_a_worker_that_dies_is_reported_with_its_log(tmp_path):
    """A worker that exits without a result (a crash, a kill): the cell's status quotes the end
    of its log instead of waiting for the timeout."""
    pool = WorkerPool(Path(sys.executable).parent / "no_such_script.py", tmp_path / "workers")
    result = pool.run(_run(tmp_path, "packed_sdpa", 2), timeout=60)
    assert result["status"].startswith("error: ") and "no_such_script" in result["status"]
    assert not pool.workers
