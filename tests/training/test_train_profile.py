"""``hf-varlen train --profile-step N`` (hf_varlen/training/profiling.py): the interval arithmetic
of the compute / communication split, and a profiled step of a CPU run (its files, its summary
line, the throughput that leaves it out, the option's checks)."""

from __future__ import annotations

import gzip
import json

import pytest
from tiny_runs import tiny_train_config

from hf_varlen.training import PackedTrainer
from hf_varlen.training.config import parse_args
from hf_varlen.training.metrics import summarize
from hf_varlen.training.profiling import minus_ms, split_events, union_ms


def test_interval_unions():
    assert union_ms([]) == 0.0
    assert union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)
    assert union_ms([(0, 4000), (1000, 2000)]) == pytest.approx(4.0)  # nested counts once
    # not covered: [0, 1) and [3, 4) of [0, 4) outside [1, 3)
    assert minus_ms([(0, 4000)], [(1000, 3000)]) == pytest.approx(2.0)
    assert minus_ms([(1000, 2000)], [(0, 4000)]) == pytest.approx(0.0)
    assert minus_ms([(0, 1000)], []) == pytest.approx(1.0)


def test_split_events_tells_collectives_from_compute():
    events = [
        ("sm90_xmma_gemm_bf16", 0, 4000),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 3000, 6000),  # 1 ms under the gemm
        ("_attn_fwd_kernel", 6000, 7000),
        ("ncclDevKernel_AllReduce_Sum_f64_RING_LL", 7500, 8000),
    ]
    got = split_events(events)
    assert got["compute_ms"] == pytest.approx(5.0)
    assert got["comm_ms"] == pytest.approx(3.5)
    assert got["comm_exposed_ms"] == pytest.approx(2.5)
    assert got["busy_ms"] == pytest.approx(7.5)
    assert got["top_comm"][0] == [pytest.approx(3.0), "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]
    assert [n for _, n in got["top_compute"]] == ["sm90_xmma_gemm_bf16", "_attn_fwd_kernel"]


def test_a_profiled_cpu_step(tmp_path, capsys):
    cfg = tiny_train_config(tmp_path, "run", max_steps=4, profile_step=3)
    summary = PackedTrainer(cfg).run()
    prof = json.loads((tmp_path / "run" / "profile" / "step3_rank0.json").read_text())
    assert prof["step"] == 3 and prof["rank"] == 0 and prof["clock"] == "CPU ops"
    assert prof["step_ms"] > 0 and prof["compute_ms"] > 0 and prof["comm_ms"] == 0.0
    assert prof["comm_exposed_ms"] is None and prof["idle_ms"] is None
    with gzip.open(tmp_path / "run" / "profile" / "step3_rank0.trace.json.gz") as fh:
        assert "traceEvents" in json.load(fh)
    assert summary["profile"]["step"] == 3
    assert "profile     step 3 of rank 0:" in capsys.readouterr().out
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("profiled", False) for r in records] == [False, False, True, False]
    # the summary's throughput: steps 2 and 4 (step 1 warms up, step 3 carries the profiler)
    steady = [records[1], records[3]]
    want = sum(r["real_tokens"] for r in steady) / sum(r["step_time"] for r in steady)
    assert summary["tokens_per_s"] == pytest.approx(want)


def test_throughput_keeps_a_profiled_step_when_it_is_all_there_is():
    record = dict(
        step=2, real_tokens=10, step_time=1.0, tensor_tokens=10, budget_tokens=10, loss=1.0,
        elapsed=2.0, peak_mem_gib=0.0, tflops_per_s=0.0, profiled=True,
    )  # fmt: skip
    first = {**record, "step": 1, "profiled": False, "step_time": 5.0}
    assert summarize([first, record], [])["tokens_per_s"] == pytest.approx(10.0)


def test_profile_step_is_checked(tmp_path):
    with pytest.raises(ValueError, match="--profile-step must be >= 1, got 0"):
        parse_args(["--profile-step", "0"]).validate()
    with pytest.raises(ValueError, match="--profile-step 9: the run has 5 steps"):
        PackedTrainer(tiny_train_config(tmp_path, "a", profile_step=9))


def test_a_resumed_run_refuses_a_profile_step_it_will_not_run(tmp_path):
    PackedTrainer(tiny_train_config(tmp_path, "run", max_steps=3, save_every=3)).run()
    cfg = tiny_train_config(tmp_path, "run", max_steps=5, resume="latest", profile_step=2)
    with pytest.raises(ValueError, match="--profile-step 2: the run resumes after step 3"):
        PackedTrainer(cfg)


def test_overwrite_removes_an_old_profile(tmp_path):
    PackedTrainer(tiny_train_config(tmp_path, "run", max_steps=2, profile_step=2)).run()
    with pytest.raises(ValueError, match="profile/"):
        PackedTrainer(tiny_train_config(tmp_path, "run", max_steps=2))
    PackedTrainer(tiny_train_config(tmp_path, "run", max_steps=2, overwrite_output_dir=True)).run()
    assert not (tmp_path / "run" / "profile").exists()
