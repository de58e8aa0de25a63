"""The long-document path of the triton attention (attention_schedule.LongPath): documents whose
rows span ``min_span`` or more run in a second, persistent launch with bigger blocks.

CPU (TRITON_INTERPRET=1): the interpreter's long path (32-row tiles from a span of 64, 3
persistent programs) beside its 16-row short tiles: the row split is an exact partition, and
mixed packs match the reference forward and backward, split and fused. GPU (marked): the shipped
long configs (head dims 64 and 128), bf16, long and short documents in one call.
"""

from __future__ import annotations

import json

import pytest
import torch
from attn_cases import check_backend_against_reference, cu_from_lengths
from test_triton_attention import DEVICE, check

from hf_varlen.ops import attention, attention_schedule
from hf_varlen.ops.attention_schedule import (
    get_plan,
    row_bounds,
    segment_bounds,
    split_tiles,
    tile_list,
    tile_spans,
)


def _rows(tiles, n_launched):
    return [r for start, end in tiles[:n_launched].tolist() for r in range(start, end)]


def _doc_of(cu, rows):
    return [int(torch.searchsorted(cu, torch.tensor(r, dtype=cu.dtype), right=True)) for r in rows]


@pytest.mark.parametrize("tile_s,tile_l", [(16, 32), (16, 48), (32, 32), (64, 16)])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (40, 0)])
def test_split_is_an_exact_partition_by_document(tile_s, tile_l, window):
    lengths = [300, 20, 7, 150, 3, 1, 90, 64]
    n = sum(lengths)
    cu = cu_from_lengths(lengths)
    lo_q, hi_q, qlo_k, qhi_k = row_bounds(cu, cu, n, n, *window)
    seg = segment_bounds(cu, n)
    for lo, hi, end_aligned in ((lo_q, hi_q, True), (qlo_k, qhi_k, False)):
        tiles_s, tiles_l, n_long = split_tiles(lo, hi, seg, tile_s, tile_l, 64, end_aligned)
        assert tiles_s.shape[0] == -(-n // tile_s) + len(lengths) + 2
        assert tiles_l.shape[0] == -(-n // tile_l) + len(lengths) + 2
        short_rows = _rows(tiles_s, tiles_s.shape[0] - 1)
        long_rows = _rows(tiles_l, int(n_long))
        long_tiles = [tuple(t) for t in tiles_l[: int(n_long)].tolist()]
        assert sorted(short_rows + long_rows) == list(range(n))  # every row exactly once
        assert not set(_doc_of(cu, short_rows)) & set(_doc_of(cu, long_rows))  # whole documents
        if window == (-1, 0):
            assert long_rows and short_rows  # this pack has both kinds
        spans = [int((hi[s:e].max() - lo[s:e].min() + 1).clamp_min(0)) for s, e in long_tiles]
        assert spans == sorted(spans, reverse=True)  # heaviest first
        if not long_tiles:  # a window of 40 keeps every span below 64
            continue
        by_start = sorted(long_tiles)  # tile_spans takes tiles in row order
        start, end = (torch.tensor(c, dtype=torch.int64) for c in zip(*by_start))
        assert tile_spans(lo, hi, start, end).tolist() == [
            spans[long_tiles.index(t)] for t in by_start
        ]


def test_no_long_documents_leaves_the_short_tiles_alone():
    lengths = [20, 7, 30, 3]
    n = sum(lengths)
    cu = cu_from_lengths(lengths)
    lo, hi, _, _ = row_bounds(cu, cu, n, n, -1, 0)
    seg = segment_bounds(cu, n)
    tiles_s, _, n_long = split_tiles(lo, hi, seg, 16, 32, 64, True)
    assert int(n_long) == 0
    assert torch.equal(tiles_s, tile_list(lo, hi, seg, 16, True)[0])


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


def test_long_path_off_matches_too(monkeypatch):
    monkeypatch.setattr(attention, "pick_long_path", lambda *a: None)
    check([300, 20, 7, 150, 3], 4, 2, 16, torch.float32)


def test_override_file_sets_the_long_path(tmp_path, monkeypatch):
    cfg = [128, 64, 8, 3, 16, 128, 64, 8, 2, 32, 128, 64, 8, 2, 8]
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"long128": cfg, "long_min_span": 512}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    long = attention_schedule.pick_long_path(128, torch.bfloat16, torch.device("cuda"))
    assert long.min_span == 512 and long.cfg.fwd_block_n == 64 and long.cfg.kv_block_n == 128
    assert attention_schedule.pick_long_path(256, torch.bfloat16, torch.device("cuda")) is None
    assert attention_schedule.pick_long_path(128, torch.float32, torch.device("cuda")) is None


def test_shipped_long_path_on_cuda():
    long = attention_schedule.pick_long_path(128, torch.bfloat16, torch.device("cuda"))
    assert long is not None and long.min_span == 1024 and long.cfg.fwd_warps == 8
    long64 = attention_schedule.pick_long_path(64, torch.float16, torch.device("cuda"))
    assert long64 is not None and long64.cfg.fwd_block_n == 64 and long64.cfg.fwd_min_tokens == 128


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[4096, 100, 37, 2000, 1], [8192], [300] * 7 + [5]])
@pytest.mark.parametrize("h_q,h_kv,d", [(32, 8, 128), (16, 16, 128), (16, 16, 64), (8, 2, 64)])
def test_gpu_long_path_bf16_matches_reference(lengths, h_q, h_kv, d):
    """The shipped long path (head dims 64 and 128), long and short documents in one call."""
    assert attention_schedule.pick_long_path(d, torch.bfloat16, torch.device("cuda")) is not None
    check_backend_against_reference("triton", lengths, h_q, h_kv, d, torch.bfloat16, "cuda")
