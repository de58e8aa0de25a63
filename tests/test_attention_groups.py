"""The backward's whole-document groups (hf_varlen/ops/attention_groups.py): the device-built group
tables, the split kernels' plan without the owned rows, and the grouped backward against the
reference (CPU: TRITON_INTERPRET=1, group capacity 32; GPU: the shipped or overridden capacity)."""

from __future__ import annotations

import json

import pytest
import torch
from attn_cases import cu_from_lengths, make_qkv
from test_triton_attention import DEVICE, _run, check

from hf_varlen.ops import attention, attention_schedule
from hf_varlen.ops.attention import triton_varlen_attention
from hf_varlen.ops.attention_groups import document_groups
from hf_varlen.ops.attention_schedule import EMPTY_LO, GroupPath, Plan, get_plan


def _groups(lengths, capacity, lengths_k=None):
    cu_q = cu_from_lengths(lengths)
    cu_k = cu_from_lengths(lengths_k or lengths)
    t_q, t_k = sum(lengths), sum(lengths_k or lengths)
    return document_groups(cu_q, cu_k, t_q, t_k, capacity)


def test_document_groups_of_a_small_pack():
    # capacity 32: window 8, pairable <= 24 tokens; 40 and 102 are too long, 30 goes alone
    groups, n, owned_q, owned_k = _groups([5, 30, 40, 3, 102, 2, 18], 32)
    assert n.tolist() == [4]
    assert groups[:, :4].tolist() == [[0, 5, 75, 180], [5, 35, 78, 200]] * 2
    assert groups[:, 4:].abs().sum() == 0  # slots past the group count are empty ranges
    expect = [True] * 35 + [False] * 40 + [True] * 3 + [False] * 102 + [True] * 20
    assert owned_q.tolist() == expect and owned_k.tolist() == expect


@pytest.mark.parametrize("seed", range(4))
def test_document_groups_partition_the_eligible_documents(seed):
    """Random packs (empty documents included, different query and key lengths): groups are
    disjoint, ordered, within capacity rows on both sides, and cover exactly the owned rows
    (the documents of <= capacity tokens on both sides)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g))
    lq = torch.randint(0, 50, (n,), generator=g).tolist()
    lk = [x + int(d) for x, d in zip(lq, torch.randint(-2, 3, (n,), generator=g))]
    lk = [max(0, x) for x in lk]
    capacity = 32
    groups, n_groups, owned_q, owned_k = _groups(lq, capacity, lk)
    n_groups = int(n_groups)
    qs, qe, ks, ke = (groups[i, :n_groups].tolist() for i in range(4))
    for lo, hi, owned, lengths in ((qs, qe, owned_q, lq), (ks, ke, owned_k, lk)):
        assert all(0 <= e - s <= capacity for s, e in zip(lo, hi))
        assert all(hi[i] <= lo[i + 1] for i in range(n_groups - 1))
        covered = torch.zeros(sum(lengths), dtype=torch.bool)
        for s, e in zip(lo, hi):
            covered[s:e] = True
        assert covered.tolist() == owned.tolist()
    starts = [0]
    for a in lq:
        starts.append(starts[-1] + a)
    eligible = [a <= capacity and b <= capacity for a, b in zip(lq, lk)]
    for d, (a, ok) in enumerate(zip(lq, eligible)):
        assert owned_q[starts[d] : starts[d] + a].tolist() == [ok] * a


def test_split_plan_drops_fully_owned_tiles():
    """A tile whose rows are all owned becomes the empty tile in every order; a partly owned tile
    stays, with empty bounds on its owned rows."""
    lengths = [5, 3, 100, 8]  # tiles of 8: 0 (rows 0-7) owned, 13 (104-111) partly, 14 owned
    cu = cu_from_lengths(lengths)
    plan = get_plan(cu, cu, 116, 116, -1, 0)
    split, _, _ = plan.grouped(32)
    assert split.owned_q[:8].all() and not split.owned_q[8:108].any()
    assert (split.lo_q[:8] == EMPTY_LO).all() and (split.hi_q[:8] == -1).all()
    n_tiles = -(-116 // 8)
    order = split.order_q(8).tolist()
    assert order.count(n_tiles) == 3  # tiles 0 and 14, and the extra entry
    assert 0 not in order and 14 not in order and 13 in order
    order_s, _, _ = split.split("k", 8, 16, 64)
    assert 0 not in order_s.tolist()
    assert Plan._drop_owned(torch.arange(4, dtype=torch.int32), None, 8).tolist() == [0, 1, 2, 3]


CASES = {
    "mixed": ([5, 30, 40, 3, 102, 2, 18], 4, 2, {}),
    "tiny": ([1, 2, 1, 3, 2, 1, 4, 2, 1, 1, 3] * 6, 2, 1, {}),
    "gqa8": ([17, 9, 60, 4, 31], 8, 2, {}),
    "mqa": ([12, 25, 3, 40], 4, 1, {}),
    "window": ([20, 31, 7, 45, 12], 4, 2, {"window_size": (5, -1)}),
    "softcap": ([20, 31, 7, 45, 12], 4, 2, {"softcap": 5.0}),
    "non_causal": ([20, 31, 7, 45, 12], 4, 2, {"causal": False}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_backward_matches_reference(case, dtype):
    lengths, h_q, h_kv, kw = CASES[case]
    check(lengths, h_q, h_kv, 16, dtype, **kw)


def test_grouped_backward_with_different_query_and_key_lengths():
    check([3, 9, 40, 6], 4, 2, 16, torch.float32, lengths_k=[5, 12, 40, 2], causal=False)


def test_grouped_backward_matches_the_split_one(monkeypatch):
    """Same numbers (to fp32 rounding) with the group path off: every row is written once."""
    lengths = [5, 30, 40, 3, 102, 2, 18]
    q, k, v = make_qkv(lengths, 4, 2, 16, torch.float32, DEVICE)
    cu = cu_from_lengths(lengths, DEVICE)
    g = torch.randn_like(q)
    fn = lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu)  # noqa: E731
    grouped = _run(fn, q, k, v, g)
    monkeypatch.setattr(attention, "pick_group_path", lambda *a: None)
    split = _run(fn, q, k, v, g)
    for a, b in zip(grouped, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_backward_is_bitwise_repeatable():
    lengths = [5, 30, 40, 3, 102, 2, 18]
    q, k, v = make_qkv(lengths, 4, 2, 16, torch.float16, DEVICE)
    cu = cu_from_lengths(lengths, DEVICE)
    g = torch.randn_like(q)
    fn = lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu)  # noqa: E731
    first, second = _run(fn, q, k, v, g), _run(fn, q, k, v, g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_group_override(tmp_path, monkeypatch):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"group128": [64, 32, 8, 1], "group64": []}))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    cuda = torch.device("cuda")
    assert attention_schedule.pick_group_path(128, torch.bfloat16, cuda) == GroupPath(64, 32, 8, 1)
    assert attention_schedule.pick_group_path(64, torch.bfloat16, cuda) is None
    assert attention_schedule.pick_group_path(128, torch.float32, cuda) is None
    path.write_text(json.dumps({"group128": [48, 32, 8, 1]}))
    attention_schedule._load_overrides.cache_clear()
    with pytest.raises(ValueError, match="group128.*power of two"):
        attention_schedule.pick_group_path(128, torch.bfloat16, cuda)
    attention_schedule._load_overrides.cache_clear()


@pytest.mark.gpu
def test_gpu_grouped_backward_bf16_matches_reference(monkeypatch, tmp_path):
    """bf16 on the GPU with the group path forced on at capacity 128 (and 64): real alpaca-like
    lengths, 32/8 heads x 128, against the reference under the numerics rule."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (60,), generator=g).tolist()
    for capacity, block_q in ((128, 32), (64, 64)):
        path = tmp_path / f"g{capacity}.json"
        path.write_text(json.dumps({"group128": [capacity, block_q, 8, 1]}))
        monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
        check(lengths, 32, 8, 128, torch.bfloat16)
        check(lengths, 8, 8, 128, torch.float16, softcap=20.0)
