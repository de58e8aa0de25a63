"""scripts/bench_attention.py on CPU: the issue-16 cases exist and the target lines judge rows right
(the timings themselves need a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import attention_targets  # noqa: E402
import bench_attention  # noqa: E402
from attention_cases import cases  # noqa: E402


def _row(case, provider, fb_ms, heads="32/8/128", floor_fb_ms=1.0):
    return dict(case=case, heads=heads, provider=provider, fb_ms=fb_ms, floor_fb_ms=floor_fb_ms)


def test_cases_cover_issue_16():
    c = cases()
    assert c["128k"] == [131072] and c["8x8k"] == [8192] * 8
    assert c["32k+alpaca32k"][0] == 32768 and sum(c["32k+alpaca32k"][1:]) <= 32768
    for name in ("alpaca16k", "alpaca64k", "lima64k"):
        assert name in c and max(c[name]) < sum(c[name])  # real packs of many documents
    assert set(attention_targets.FA4_TARGETS) <= set(c)
    assert bench_attention.HEADS["16/8/256"] == (16, 8, 256)


def test_targets_say_met_missed_and_na():
    rows = [
        _row("32k+alpaca32k", "triton", 50.0),
        _row("32k+alpaca32k", "fa4", 53.0),  # 1.06x: met
        _row("alpaca64k", "triton", 2.0, floor_fb_ms=0.5),  # 25% of the floor: missed
        _row("alpaca64k", "fa4", 4.0),  # 2.0x < 3x: missed
        _row("alpaca64k", "torch", 1.5),  # torch faster than triton here
        _row("lima64k", "triton", 1.0),
        _row("lima64k", "torch", 3.0),
        _row("lima64k", "fa4", 9.0, heads="16/16/64"),  # other heads: not a target row
        dict(case="128k", heads="32/8/128", provider="fa4", error="OOM"),
    ]
    lines = attention_targets.targets(rows)
    assert lines[0] == "32/8/128 32k+alpaca32k: triton 1.06x FA4 (target >= 1.0x): met"
    assert "128k: triton >= 0.9x FA4: n/a" in lines[1]
    assert "lima64k: triton >= 1.3x FA4: n/a" in lines[2]
    assert lines[3].endswith("triton 2.00x FA4 (target >= 3.0x): MISSED")
    assert lines[4].endswith("alpaca64k: triton at 25% of its HBM floor (target >= 40%): MISSED")
    assert lines[5].endswith(
        "slower than torch varlen_attn: alpaca64k (0.75x) (of 2 cases with both)"
    )


def test_case_names_expand_groups_inside_a_list():
    issue, cross = ["alpaca64k", "128k"], ["64k_of_256", "4k+alpaca"]
    assert bench_attention.case_names("crossover,128k", issue, cross) == [*cross, "128k"]
    assert bench_attention.case_names("all", issue, cross) == issue
    assert bench_attention.case_names("128k,all", issue, cross) == ["128k", "alpaca64k"]
    for bad in ("crossover,nope", ""):
        with pytest.raises(SystemExit, match="--cases"):
            bench_attention.case_names(bad, issue, cross)
