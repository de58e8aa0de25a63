"""The long-document path of the triton attention (attention_schedule.LongPath): tiles whose span
reaches ``min_span`` run in a second, persistent launch with bigger blocks.

CPU (TRITON_INTERPRET=1): the interpreter's long path (32-row tiles from a span of 64, 3
persistent programs, or one program per long tile) beside its 16-row short tiles: the row split
is an exact partition, and mixed packs match the reference forward and backward, split and fused. GPU (marked): a long
config given through the tuning override, bf16, long and short documents in one call.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from attn_cases import check_backend_against_reference, cu_from_lengths
from test_triton_attention import DEVICE, check

from hf_varlen.ops.attention import launch as attention
from hf_varlen.ops.attention import schedule as attention_schedule
from hf_varlen.ops.attention.schedule import get_plan, row_bounds, split_orders, tile_spans


def _rows(order, n_launched, tile, n):
    rows = []
    for t in order[:n_launched].tolist():
        rows += [r for r in range(t * tile, (t + 1) * tile) if r < n]
    return rows


@pytest.mark.parametrize("tile_s,tile_l", [(16, 32), (16, 48), (32, 32), (64, 16), (20, 32)])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (40, 0)])
def test_split_is_an_exact_partition(tile_s, tile_l, window):
    lengths = [300, 20, 7, 150, 3, 1, 90, 64]
    n = sum(lengths)
    cu = cu_from_lengths(lengths)
    lo_q, hi_q, qlo_k, qhi_k = row_bounds(cu, cu, n, n, *window)
    for lo, hi in ((lo_q, hi_q), (qlo_k, qhi_k)):
        order_s, order_l, n_long = split_orders(lo, hi, tile_s, tile_l, min_span=64)
        n_s = order_s.numel() - 1
        assert order_l.numel() == -(-n // tile_l) + 1 and order_s.numel() == -(-n // tile_s) + 1
        short_rows = _rows(order_s, n_s, tile_s, n)
        long_rows = _rows(order_l, int(n_long), tile_l, n)
        assert sorted(short_rows + long_rows) == list(range(n))  # every row exactly once
        if window == (-1, 0) and math.lcm(tile_s, tile_l) <= 32:
            assert long_rows and short_rows  # this pack has both kinds at these tiles
        spans = tile_spans(lo, hi, tile_l)[order_l[: int(n_long)].long()]
        assert (spans[:-1] >= spans[1:]).all()  # heaviest first


def test_no_long_tiles_leaves_the_short_order_alone():
    lengths = [20, 7, 30, 3]
    n = sum(lengths)
    cu = cu_from_lengths(lengths)
    lo, hi, _, _ = row_bounds(cu, cu, n, n, -1, 0)
    order_s, _, n_long = split_orders(lo, hi, 16, 32, min_span=64)
    assert int(n_long) == 0
    assert torch.equal(order_s, attention_schedule.heaviest_first(lo, hi, 16))


def test_short_documents_stay_short_when_the_tiles_share_a_large_block():
    """Tiles of 25 and 256 rows (a fold of 5 query heads) align only every lcm = 6400 rows; that
    block spans far more than min_span over short documents, yet none of its tiles is long."""
    lengths = [79] * 200  # alpaca-like: 15800 rows, every tile's span < 512
    n = sum(lengths)
    cu = cu_from_lengths(lengths)
    lo, hi, _, _ = row_bounds(cu, cu, n, n, -1, 0)
    order_s, _, n_long = split_orders(lo, hi, 25, 256, min_span=1024)
    assert int(n_long) == 0
    assert torch.equal(order_s, attention_schedule.heaviest_first(lo, hi, 25))
    # one long document among them: only its blocks go long
    lengths = [79] * 100 + [3000] + [79] * 100
    n = sum(lengths)
    lo, hi, _, _ = row_bounds(cu_from_lengths(lengths), cu_from_lengths(lengths), n, n, -1, 0)
    order_s, order_l, n_long = split_orders(lo, hi, 25, 256, min_span=1024)
    long_rows = _rows(order_l, int(n_long), 256, n)
    assert 0 < len(long_rows) <= 2 * 6400 and sorted(
        long_rows + _rows(order_s, order_s.numel() - 1, 25, n)
    ) == list(range(n))


@pytest.mark.parametrize(
    "lengths,h_q,h_kv,kw",
    [
        ([300, 20, 7, 150, 3], 4, 2, {}),
        ([5, 260, 1, 99], 4, 1, dict(causal=False)),
        ([200, 33, 130], 2, 2, dict(window_size=(48, 0))),
        ([180, 9], 4, 4, dict(softcap=5.0)),
    ],
)
def test_mixed_pack_matches_reference(lengths, h_q, h_kv, kw):
    cu = cu_from_lengths(lengths, DEVICE)
    plan = get_plan(cu, cu, sum(lengths), sum(lengths), -1, 0)
    assert int(plan.split("q", 16, 32, 64)[2]) > 0  # the long launch has work here
    check(lengths, h_q, h_kv, 16, torch.float32, **kw)


def test_mixed_pack_fused_backward(fused_backward):
    check([300, 20, 7, 150, 3], 4, 2, 16, torch.float32)


@pytest.mark.parametrize("programs", [(0, 0, 0), (0, 1, 0)])
def test_mixed_pack_one_program_per_long_tile(programs, monkeypatch):
    """programs_per_sm 0: the long launch's grid is one program per tile of the long tiling and
    the programs past the long tiles exit at once (head dim 64's shipped mode), mixed with
    persistent kernels in one call."""
    long = dataclasses.replace(attention_schedule._INTERPRETER_LONG, programs_per_sm=programs)
    monkeypatch.setattr(attention, "pick_long_path", lambda *a: long)
    check([300, 20, 7, 150, 3], 4, 2, 16, torch.float32)
    check([5, 260, 1, 99], 4, 1, 16, torch.float32, causal=False)


def test_mixed_pack_fused_backward_one_program_per_long_tile(fused_backward, monkeypatch):
    long = dataclasses.replace(attention_schedule._INTERPRETER_LONG, programs_per_sm=(0, 0, 0))
    monkeypatch.setattr(attention, "pick_long_path", lambda *a: long)
    check([300, 20, 7, 150, 3], 4, 2, 16, torch.float32)


def test_launch_grid_is_fixed_by_the_order_not_the_long_tile_count():
    from hf_varlen.ops.attention.fwd import launch_grid

    order, n_long = torch.arange(9, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert launch_grid(order, 4, None) == (order, (32,))  # 8 tiles (the last entry: never run)
    assert launch_grid(order, 4, (n_long, 0)) == (n_long, (32,))  # one program per tile
    assert launch_grid(order, 4, (n_long, 396)) == (n_long, (396,))  # persistent


def test_long_path_off_matches_too(monkeypatch):
    monkeypatch.setattr(attention, "pick_long_path", lambda *a: None)
    check([300, 20, 7, 150, 3], 4, 2, 16, torch.float32)


def test_override_file_sets_the_long_path(tmp_path, monkeypatch):
    cfg = [128, 64, 8, 3, 16, 128, 64, 8, 2, 32, 128, 64, 8, 2, 8]
    path = tmp_path / "long.json"
    path.write_text(
        json.dumps({"long128": cfg, "long_min_span": 512, "long_programs_per_sm": [0, 2, 1]})
    )
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    long = attention_schedule.pick_long_path(128, torch.bfloat16, torch.device("cuda"))
    assert long.min_span == 512 and long.cfg.fwd_block_n == 64 and long.cfg.kv_block_n == 128
    assert [long.programs(k) for k in ("fwd", "dq", "kv")] == [0, 2, 1]
    assert attention_schedule.pick_long_path(256, torch.bfloat16, torch.device("cuda")) is None
    assert attention_schedule.pick_long_path(128, torch.float32, torch.device("cuda")) is None


@pytest.mark.parametrize("programs", [[1, 1], [1, -1, 1], [1, 1.5, 1]])
def test_override_file_rejects_bad_programs_per_sm(programs, tmp_path, monkeypatch):
    cfg = [128, 64, 8, 3, 16, 128, 64, 8, 2, 32, 128, 64, 8, 2, 8]
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"long128": cfg, "long_programs_per_sm": programs}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    with pytest.raises(ValueError, match="long_programs_per_sm.*3 ints >= 0"):
        attention_schedule.pick_long_path(128, torch.bfloat16, torch.device("cuda"))


@pytest.mark.parametrize("key", ["small128", "long", "128x", "long_span"])
def test_override_file_rejects_unknown_keys(key, tmp_path, monkeypatch):
    # "small128" set the small-tile tier, removed after the H200 measured it slower (run R)
    cfg = [128, 64, 8, 3, 16, 128, 64, 8, 2, 32, 128, 64, 8, 2, 8]
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({key: cfg}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    with pytest.raises(ValueError, match=f"unknown key '{key}'"):
        attention_schedule.pick_config(128, torch.bfloat16, torch.device("cuda"))


def test_shipped_long_path_on_cuda():
    long = attention_schedule.pick_long_path(128, torch.bfloat16, torch.device("cuda"))
    assert long is not None and long.min_span == 1024 and long.cfg.fwd_warps == 8
    long64 = attention_schedule.pick_long_path(64, torch.float16, torch.device("cuda"))
    assert long64 is not None and long64.cfg.fwd_block_n == 64
    # 32/8 heads (a KV group of 4) fold 2 / 2 / 4 heads per tile (H200 run L); 16/16 heads fold none
    tiling = {k: attention_schedule.kernel_tiling(long64.cfg, k, 4) for k in ("fwd", "dq", "kv")}
    assert tiling == {"fwd": (2, 64), "dq": (2, 64), "kv": (4, 64)}
    assert attention_schedule.kernel_tiling(long64.cfg, "fwd", 1) == (1, 128)
    # head dim 64: one program per long tile (run M); 128: persistent, one program per SM
    assert long64.programs_per_sm == (0, 0, 0) and long.programs_per_sm == (1, 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[4096, 100, 37, 2000, 1], [8192], [300] * 7 + [5]])
@pytest.mark.parametrize("h_q,h_kv", [(16, 16), (8, 2)])
def test_gpu_long_path_head_dim_64_bf16_matches_reference(lengths, h_q, h_kv):
    """The shipped head-dim-64 long path, long and short documents in one call."""
    assert attention_schedule.pick_long_path(64, torch.bfloat16, torch.device("cuda")) is not None
    check_backend_against_reference("triton", lengths, h_q, h_kv, 64, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[4096, 100, 37, 2000, 1], [8192], [300] * 7 + [5]])
@pytest.mark.parametrize("h_q,h_kv", [(32, 8), (16, 16)])
def test_gpu_long_path_bf16_matches_reference(lengths, h_q, h_kv, tmp_path, monkeypatch):
    """A long config through the tuning override (the shipped one, where there is one, is what
    ``pick_long_path`` returns without it; this pins the path on whatever ships)."""
    long = attention_schedule.pick_long_path(128, torch.bfloat16, torch.device("cuda"))
    cfg = (
        list(dataclasses.astuple(long.cfg))[:15]
        if long
        else [128, 64, 8, 3, 16, 128, 64, 8, 2, 32, 128, 64, 8, 2, 8]
    )
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"long128": cfg, "long_min_span": 1024}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    from test_triton_attention import test_gpu_bf16_matches_reference as bf16_case

    bf16_case(lengths, h_q, h_kv)
