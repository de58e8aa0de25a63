"""Shape-fitted small tiles for short documents (attention_schedule.SmallPath / split_small): the
exact row partition between the small, short and long launches, and the kernels with the small
tier forced on against the reference (CPU: TRITON_INTERPRET=1; no small tier ships on CUDA yet)."""

from __future__ import annotations

import json

import pytest
import torch
from attn_cases import cu_from_lengths, record_calls
from test_triton_attention import check

from hf_varlen.ops import attention, attention_schedule
from hf_varlen.ops.attention_schedule import (
    KernelConfig,
    SmallPath,
    launch_passes,
    row_bounds,
    split_orders,
    split_small,
)

# differs from the interpreter's short config (16-row blocks) in every kernel's launch
SMALL = KernelConfig(32, 16, 1, 1, 8, 32, 16, 1, 1, 8, 32, 16, 1, 1, 4)


def _covered(order, n, tile, rows, counts):
    for t in order[:n]:
        for r in range(t * tile, min((t + 1) * tile, rows)):
            counts[r] += 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("long", [None, (16, 40)])
@pytest.mark.parametrize("max_span", [8, 24])
def test_split_small_partitions_the_rows(seed, long, max_span):
    """Every row is computed by exactly one launched tile; the long launch takes the same rows as
    without a small tier."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 30, (1,), generator=g))
    lengths = torch.randint(0, 70, (n,), generator=g).tolist()
    total = sum(lengths)
    if total == 0:
        lengths, total = [3], 3
    cu = cu_from_lengths(lengths)
    lo, hi, _, _ = row_bounds(cu, cu, total, total, -1, 0)
    order_m, n_small, order_s, order_l, n_long = split_small(lo, hi, 4, 8, max_span, long)
    counts = [0] * total
    _covered(order_m.tolist(), int(n_small), 4, total, counts)
    n_s = order_s.numel() - 1
    _covered([t for t in order_s.tolist() if t != n_s], n_s, 8, total, counts)
    if long is not None:
        _covered(order_l.tolist(), int(n_long), 16, total, counts)
        _, ref_l, ref_n = split_orders(lo, hi, 8, 16, long[1])
        assert int(n_long) == int(ref_n) and order_l.tolist() == ref_l.tolist()
    else:
        assert order_l is None and n_long is None
    assert counts == [1] * total
    # small tiles span at most max_span keys
    spans = attention_schedule.tile_spans(lo, hi, 4)
    assert all(int(spans[t]) <= max_span for t in order_m.tolist()[: int(n_small)])


def test_launch_passes_give_the_small_tier_its_own_launch_only_where_it_differs():
    lengths = [5, 30, 40, 3, 102, 2, 18]
    cu = cu_from_lengths(lengths)
    plan = attention_schedule.get_plan(cu, cu, 200, 200, -1, 0)
    cfg = attention_schedule._INTERPRETER_CONFIG
    small = SmallPath(SMALL, 24)
    long = attention_schedule._INTERPRETER_LONG
    dev = torch.device("cpu")
    passes = launch_passes(plan, "fwd", cfg, long, 2, dev, small)
    assert [p[1] for p in passes] == [SMALL, cfg, long.cfg]
    assert passes[0][3][1] == 0  # one program per small tile, past n_small they exit
    same = SmallPath(cfg, 24)
    assert len(launch_passes(plan, "dq", cfg, long, 2, dev, same)) == 2
    assert len(launch_passes(plan, "kv", cfg, None, 2, dev, small)) == 2


SMALL_CASES = {
    "mixed": ([5, 30, 40, 3, 102, 2, 18], 4, 2, {}),
    "tiny": ([1, 2, 1, 3, 2, 1, 4, 2, 1, 1, 3] * 6, 2, 1, {}),
    "window": ([20, 31, 7, 45, 12], 4, 2, {"window_size": (5, -1)}),
    "softcap_non_causal": ([20, 31, 7, 45, 12], 4, 1, {"softcap": 5.0, "causal": False}),
}


@pytest.mark.parametrize("with_long", [True, False])
@pytest.mark.parametrize("case", SMALL_CASES)
def test_small_tier_matches_reference(case, with_long, monkeypatch):
    lengths, h_q, h_kv, kw = SMALL_CASES[case]
    monkeypatch.setattr(attention, "pick_small_path", lambda *a: SmallPath(SMALL, 24))
    if not with_long:
        monkeypatch.setattr(attention, "pick_long_path", lambda *a: None)
    launched = record_calls(
        monkeypatch, attention, "attention_forward", lambda *a, **k: k["block_m"]
    )
    check(lengths, h_q, h_kv, 16, torch.float32, **kw)
    assert launched[0] == SMALL.fwd_block_m and len(launched) == 2 + with_long


def test_small_tier_fp16(monkeypatch):
    monkeypatch.setattr(attention, "pick_small_path", lambda *a: SmallPath(SMALL, 24))
    check([5, 30, 40, 3, 102, 2, 18], 4, 2, 16, torch.float16)


def test_small_override(tmp_path, monkeypatch):
    cfg = [64, 16, 4, 3, 16, 64, 32, 4, 1, 16, 64, 32, 4, 3, 8]
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"small128": cfg, "small_max_span": 384}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    cuda = torch.device("cuda")
    small = attention_schedule.pick_small_path(128, torch.bfloat16, cuda)
    assert small.max_span == 384 and small.cfg.fwd_block_n == 16 and small.cfg.dq_stages == 1
    assert attention_schedule.pick_small_path(64, torch.bfloat16, cuda) is None
    assert attention_schedule.pick_small_path(128, torch.float32, cuda) is None
    assert attention_schedule.pick_small_path(128, torch.bfloat16, torch.device("cpu")) is None
    path2 = tmp_path / "bad.json"
    path2.write_text(json.dumps({"small128": cfg, "small_max_span": 0}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path2))
    with pytest.raises(ValueError, match="bad.json: small_max_span.*int >= 1"):
        attention_schedule.pick_small_path(128, torch.bfloat16, cuda)


@pytest.mark.gpu
def test_gpu_small_tier_matches_reference(tmp_path, monkeypatch):
    """The sweep's small tiles (run N) forced on through the tuning override, on alpaca-like
    lengths with one long document (all three launches), against the reference in bf16 / fp16."""
    tiles = [64, 16, 4, 3, 16, 64, 32, 4, 1, 16, 64, 32, 4, 3, 8]
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"small128": tiles, "small64": tiles, "small_max_span": 384}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (80,), generator=g).tolist() + [3000]
    check(lengths, 32, 8, 128, torch.bfloat16)
    check(lengths, 40, 8, 128, torch.bfloat16)
    check(lengths, 16, 16, 64, torch.float16, softcap=20.0)
