"""scripts/bench_beyond_sft.py on CPU: every task x mode runs on tiny models, the agreement column
is computed against padded_sdpa, and a diverging mode is caught by it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_beyond_sft", ROOT / "scripts" / "bench_beyond_sft.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_every_task_and_mode(tmp_path):
    bench = _bench()
    records = bench.main(
        ["--tiny", "--steps", "1", "--warmup", "0", "--batch-sizes", "2", "--out", str(tmp_path)]
    )
    assert {(r["task"], r["mode"]) for r in records} == {
        (t, m) for t in bench.TASKS for m in bench.MODES
    }
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert all(r["max_rel_gap"] == 0 for r in records if r["mode"] == "padded_sdpa")
    assert (tmp_path / "results.json").exists()


def test_agreement_flags_a_diverging_mode():
    bench = _bench()
    records = [
        dict(task="dpo", mode="padded_sdpa", batch=2, logp_sums=[-10.0, -9.0]),
        dict(task="dpo", mode="packed", batch=2, logp_sums=[-10.0, -12.0]),
    ]
    bench.agreement(records)
    assert records[1]["max_rel_gap"] == pytest.approx(3.0 / 9.0)


def test_unknown_task_refused():
    with pytest.raises(SystemExit):
        _bench().parse_args(["--tiny", "--tasks", "ppo"])
