"""Token-budget packing (pack_by_tokens) and TokenBudgetBatchSampler: invariants, determinism,
overflow, multi-rank splitting, and efficiency on real alpaca lengths (Qwen2 tokenizer)."""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from hf_varlen.collator import PackingCollator
from hf_varlen.packing import (
    ExampleCountBatchSampler,
    PackingStats,
    TokenBudgetBatchSampler,
    pack_by_tokens,
)

STRATEGIES = ["bfd", "ffd", "sequential"]

# Packing tests draw lengths past the budget on purpose; the overflow warning has its own tests.
pytestmark = pytest.mark.filterwarnings("ignore:.*longer than max_tokens:UserWarning")


def _lengths(seed, n=2000, high=3000, empty_frac=0.0):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(5.0, 1.0, size=n).astype(np.int64).clip(1, high)
    lengths[rng.random(n) < empty_frac] = 0
    return lengths


def _check_invariants(result, lengths, max_tokens):
    """Every non-empty example in exactly one batch; budgets, per-batch tokens and stats agree."""
    eff = np.minimum(np.asarray(lengths), max_tokens)
    placed = [i for batch in result.batches for i in batch]
    assert sorted(placed) == np.flatnonzero(eff > 0).tolist()
    assert all(batch == sorted(batch) and batch for batch in result.batches)
    assert result.batch_tokens == [int(eff[b].sum()) for b in result.batches]
    assert max(result.batch_tokens, default=0) <= max_tokens
    s = result.stats
    assert s.num_batches == len(result.batches)
    assert s.real_tokens == eff.sum()
    assert s.num_skipped_empty == int((eff == 0).sum())
    assert s.padded_tokens == sum(len(b) * int(eff[b].max()) for b in result.batches)
    if s.num_batches:
        assert 0 < s.packing_efficiency <= 1 and 0 < s.padded_efficiency <= 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("max_tokens", [512, 4096, 16384])
@pytest.mark.parametrize("seed", [0, 1])
def test_pack_invariants(strategy, max_tokens, seed):
    lengths = _lengths(seed, empty_frac=0.02)
    _check_invariants(pack_by_tokens(lengths, max_tokens, strategy=strategy), lengths, max_tokens)


def test_small_cases_by_hand():
    # 8 -> bin0 (room 2); 6 -> bin1 (room 4); 3 -> bin1 (room 1); the 1 fits both bins:
    # best fit takes the fuller bin1, first fit the first bin0.
    lengths = [8, 6, 3, 1]
    assert pack_by_tokens(lengths, 10, "bfd", seed=None).batches == [[0], [1, 2, 3]]
    assert pack_by_tokens(lengths, 10, "ffd", seed=None).batches == [[0, 3], [1, 2]]
    assert pack_by_tokens(lengths, 10, "sequential", seed=None).batches == [[0], [1, 2, 3]]
    assert pack_by_tokens([3, 8, 2, 5], 10, "sequential", seed=None).batches == [[0], [1, 2], [3]]
    # Equal lengths: ties are broken by index.
    assert pack_by_tokens([4, 4, 4, 4, 4], 8, "bfd", seed=None).batches == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("strategy", ["bfd", "ffd"])
def test_decreasing_strategies_are_near_optimal(strategy):
    lengths = _lengths(3, n=5000)
    stats = pack_by_tokens(lengths, 8192, strategy=strategy).stats
    assert stats.num_batches <= -(-stats.real_tokens // 8192) + 1
    seq = pack_by_tokens(lengths, 8192, strategy="sequential").stats
    assert stats.packing_efficiency > seq.packing_efficiency


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_shuffles_batch_order_only(strategy):
    lengths = _lengths(0)
    a = pack_by_tokens(lengths, 2048, strategy=strategy, seed=5)
    b = pack_by_tokens(lengths, 2048, strategy=strategy, seed=5)
    c = pack_by_tokens(lengths, 2048, strategy=strategy, seed=6)
    unshuffled = pack_by_tokens(lengths, 2048, strategy=strategy, seed=None)
    assert a == b
    assert a.batches != c.batches
    assert sorted(a.batches) == sorted(c.batches) == sorted(unshuffled.batches)
    assert a.stats == c.stats == unshuffled.stats


def test_unshuffled_bfd_starts_with_the_longest_example():
    lengths = _lengths(0)
    first = pack_by_tokens(lengths, 4096, seed=None).batches[0]
    assert int(np.argmax(lengths)) in first


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_length_input_types(kind):
    lengths = _lengths(0, n=300)
    conv = {
        "list": lambda x: x.tolist(),
        "numpy": lambda x: x.astype(np.int32),
        "torch": torch.tensor,
    }
    assert pack_by_tokens(conv[kind](lengths), 1024) == pack_by_tokens(lengths, 1024)


def test_overflow_truncate_is_counted():
    lengths = [5, 20, 3, 0, 12]
    result = pack_by_tokens(lengths, 10, on_overflow="truncate")
    _check_invariants(result, lengths, 10)
    s = result.stats
    assert (s.num_truncated, s.truncated_tokens, s.num_skipped_empty) == (2, 10 + 2, 1)
    assert s.num_examples == 5 and s.real_tokens == 5 + 10 + 3 + 10
    # Truncated examples fill a whole batch on their own.
    assert sorted(result.batches) == [[0, 2], [1], [4]]


def test_overflow_raise_names_the_example():
    with pytest.raises(ValueError, match=r"example 1 has 20 tokens, more than max_tokens=10"):
        pack_by_tokens([5, 20, 3, 12], 10, on_overflow="raise")
    # At the budget exactly is fine.
    assert pack_by_tokens([10, 3], 10, on_overflow="raise").stats.num_truncated == 0


def test_degenerate_inputs():
    assert pack_by_tokens([], 10).batches == []
    stats = pack_by_tokens([0, 0], 10).stats
    assert (stats.num_batches, stats.num_skipped_empty) == (0, 2)
    assert stats.packing_efficiency == stats.padded_efficiency == 0.0
    assert pack_by_tokens([1], 1).batches == [[0]]


def test_stats_str_and_type():
    stats = pack_by_tokens([3, 4, 0, 9], 8).stats
    assert isinstance(stats, PackingStats)
    text = str(stats)
    assert "4 examples -> " in text and "packing efficiency" in text and "1 truncated" in text


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([1, -2], 8), {}, ValueError, r"lengths\[1\] = -2"),
        (([1.5, 2], 8), {}, TypeError, "lengths: expected integer lengths"),
        (([[1, 2]], 8), {}, ValueError, r"lengths: expected a 1-D sequence"),
        (([1, 2], 0), {}, ValueError, "max_tokens must be >= 1, got 0"),
        (([1, 2], 8.0), {}, TypeError, "max_tokens must be an int"),
        (([1, 2], 8), {"strategy": "wrapped"}, ValueError, "strategy: expected one of"),
        (([1, 2], 8), {"on_overflow": "drop"}, ValueError, "on_overflow: expected one of"),
    ],
)
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        pack_by_tokens(*args, **kwargs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scales_to_many_examples(strategy):
    # A complexity guard, not a benchmark: an O(n^2) packer takes minutes here.
    lengths = _lengths(0, n=60_000, high=8192)
    start = time.perf_counter()
    result = pack_by_tokens(lengths, 8192, strategy=strategy)
    assert time.perf_counter() - start < 30
    assert sum(map(len, result.batches)) == 60_000


# --------------------------------------------------------------------------- batch sampler


def _epoch(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_covers_everything_each_epoch():
    lengths = _lengths(1, empty_frac=0.01)
    sampler = TokenBudgetBatchSampler(lengths, 4096, seed=3)
    assert isinstance(sampler, torch.utils.data.Sampler)
    for epoch in range(3):
        batches = _epoch(sampler, epoch)
        assert len(batches) == len(sampler) == sampler.stats.num_batches
        assert sorted(i for b in batches for i in b) == np.flatnonzero(lengths).tolist()
        assert all(np.minimum(lengths[b], 4096).sum() <= 4096 for b in batches)


def test_sampler_epochs_differ_but_are_deterministic():
    lengths = _lengths(1)
    a = TokenBudgetBatchSampler(lengths, 2048, seed=3)
    b = TokenBudgetBatchSampler(lengths, 2048, seed=3)
    e0, e1 = _epoch(a, 0), _epoch(a, 1)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert _epoch(b, 1) == e1 and _epoch(b, 0) == e0
    assert _epoch(a, 0) == e0  # going back reproduces the epoch
    assert _epoch(TokenBudgetBatchSampler(lengths, 2048, seed=4), 0) != e0


def test_sampler_without_shuffle_is_heaviest_first():
    lengths = _lengths(1)
    sampler = TokenBudgetBatchSampler(lengths, 2048, shuffle=False)
    tokens = [int(np.minimum(lengths[b], 2048).sum()) for b in _epoch(sampler, 0)]
    assert tokens == sorted(tokens, reverse=True)
    assert _epoch(sampler, 1) == _epoch(sampler, 0)


@pytest.mark.parametrize("num_replicas", [2, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_multi_replica_split(num_replicas, shuffle):
    lengths = _lengths(2, n=3000, empty_frac=0.01)
    budget = 4096

    def ranks(epoch):
        out = []
        for rank in range(num_replicas):
            s = TokenBudgetBatchSampler(
                lengths, budget, shuffle=shuffle, seed=7, num_replicas=num_replicas, rank=rank
            )
            out.append(_epoch(s, epoch))
        return out

    per_rank = ranks(0)
    steps = len(per_rank[0])
    assert all(len(r) == steps for r in per_rank)
    # Every example exactly once across ranks; empty slots only in one (the lightest) group.
    counts = Counter(i for r in per_rank for b in r for i in b)
    assert sorted(counts) == np.flatnonzero(lengths).tolist() and set(counts.values()) == {1}
    total_batches = pack_by_tokens(lengths, budget).stats.num_batches
    assert steps == -(-total_batches // num_replicas)
    assert sum(b == [] for r in per_rank for b in r) == steps * num_replicas - total_batches
    # Balanced: BFD leaves only the last few batches part-full, and those are dealt together, so
    # at most one step (the lightest group, with any empty slots) spreads more than 1% of budget.
    spreads = []
    for step in range(steps):
        tokens = [int(lengths[per_rank[r][step]].sum()) for r in range(num_replicas)]
        spreads.append(max(tokens) - min(tokens))
    assert sum(s > 0.01 * budget for s in spreads) <= 1, spreads
    # Epochs reorder the steps; the same epoch is the same on a second construction.
    assert ranks(0) == per_rank
    if shuffle:
        assert ranks(1) != per_rank


def test_sampler_bad_input():
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < num_replicas=2, got 2"):
        TokenBudgetBatchSampler([1, 2], 8, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        TokenBudgetBatchSampler([1, 2], 8, num_replicas=0)
    with pytest.raises(ValueError, match="example 0 has 9 tokens"):
        TokenBudgetBatchSampler([9, 2], 8, on_overflow="raise")
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        TokenBudgetBatchSampler([1, 2], 8).set_epoch(-1)


@pytest.mark.parametrize("num_replicas", [1, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_example_count_sampler(num_replicas, shuffle):
    lengths = _lengths(3, n=1001, empty_frac=0.01)
    batch_size = 16

    def ranks(epoch, seed=7):
        return [
            _epoch(
                ExampleCountBatchSampler(
                    lengths, batch_size, shuffle=shuffle, seed=seed, num_replicas=num_replicas,
                    rank=rank,
                ),
                epoch,
            )
            for rank in range(num_replicas)
        ]  # fmt: skip

    per_rank = ranks(0)
    batches = [b for r in per_rank for b in r if b]
    kept = np.flatnonzero(lengths)
    # Every non-empty example exactly once; all batches full but the last one.
    counts = Counter(i for b in batches for i in b)
    assert sorted(counts) == kept.tolist() and set(counts.values()) == {1}
    sizes = sorted(len(b) for b in batches)
    assert sizes[1:] == [batch_size] * (len(batches) - 1) and 1 <= sizes[0] <= batch_size
    assert len(batches) == -(-kept.size // batch_size)
    # Without shuffle the batches are runs of consecutive examples.
    if not shuffle:
        assert sorted(batches)[0] == kept[:batch_size].tolist()
    # Deterministic; epochs reorder steps, not batch contents; the seed changes the contents.
    assert ranks(0) == per_rank
    if shuffle:
        assert ranks(1) != per_rank
        assert sorted(map(tuple, (b for r in ranks(1) for b in r if b))) == sorted(
            map(tuple, batches)
        )
        assert sorted(map(tuple, (b for r in ranks(0, seed=8) for b in r if b))) != sorted(
            map(tuple, batches)
        )
    s = ExampleCountBatchSampler(lengths, batch_size)
    assert s.stats.real_tokens == int(lengths.sum())
    assert s.stats.max_tokens == batch_size * int(lengths.max())
    padded = sum(len(b) * int(lengths[b].max()) for b in s.batches)
    assert s.stats.padded_efficiency == pytest.approx(int(lengths.sum()) / padded)


def test_example_count_sampler_bad_input():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ExampleCountBatchSampler([1, 2], 0)
    with pytest.raises(TypeError, match=r"batch_size must be an int, got 2.0 \(float\)"):
        ExampleCountBatchSampler([1, 2], 2.0)
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < num_replicas=2, got 2"):
        ExampleCountBatchSampler([1, 2], 1, num_replicas=2, rank=2)


def test_sampler_with_dataloader_and_collator():
    rng = np.random.default_rng(0)
    lengths = np.append(rng.integers(1, 300, size=200), [0, 700])
    data = [{"input_ids": rng.integers(0, 1000, size=n).tolist()} for n in lengths]
    budget = 512
    sampler = TokenBudgetBatchSampler(
        lengths, budget, seed=1, num_replicas=3, rank=2, on_overflow="truncate"
    )
    collator = PackingCollator(max_length=budget, pad_to_multiple_of=64)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collator)
    steps = 0
    for batch in loader:
        steps += 1
        assert 0 < batch["input_ids"].shape[1] <= budget  # budget is a multiple of 64
        assert batch["cu_seq_lens_q"][-1] == batch["input_ids"].shape[1]
    assert steps == len(sampler)


def _overflow_warnings(record):
    return [w for w in record if "longer than max_tokens" in str(w.message)]


def test_overflow_default_warns_once_naming_the_collator_fix():
    # pack_by_tokens counts a 2500-token example as 256; a collator without max_length would emit
    # it whole, so the default says so once, with the fix.
    lengths = [2500, 100, 3000, 50]
    with pytest.warns(UserWarning) as record:
        result = pack_by_tokens(lengths, 256)
    (warning,) = _overflow_warnings(record)
    text = str(warning.message)
    assert "2 of 4 examples are longer than max_tokens=256 (longest 3000)" in text
    assert "PackingCollator(max_length=256)" in text and "on_overflow='truncate'" in text
    assert warning.filename == __file__  # points at the caller, not at hf_varlen
    # The packing itself is the explicit 'truncate' one.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pack_by_tokens(lengths, 256, on_overflow="truncate") == result
        assert pack_by_tokens([10, 256], 256).stats.num_truncated == 0  # at the budget: no warning


def test_sampler_with_collator_without_max_length_warns():
    """The issue's case: a 256-token budget, a PackingCollator() without max_length, and rows of
    2500 tokens. The sampler warns once at construction; with the collator it names, rows fit."""
    rng = np.random.default_rng(0)
    lengths = np.append(rng.integers(1, 200, size=40), [2500])
    data = [{"input_ids": rng.integers(0, 1000, size=n).tolist()} for n in lengths]
    with pytest.warns(UserWarning) as record:
        sampler = TokenBudgetBatchSampler(lengths, 256, seed=0)
    (warning,) = _overflow_warnings(record)
    assert "1 of 41 examples" in str(warning.message)
    assert "PackingCollator(max_length=256)" in str(warning.message)
    assert warning.filename == __file__

    def widths(collator):
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collator)
        return [batch["input_ids"].shape[1] for batch in loader]

    assert max(widths(PackingCollator())) == 2500  # what the warning is about
    assert max(widths(PackingCollator(max_length=256))) <= 256  # the fix it names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TokenBudgetBatchSampler(lengths, 256, on_overflow="truncate")
    with pytest.raises(ValueError, match="example 40 has 2500 tokens"):
        TokenBudgetBatchSampler(lengths, 256, on_overflow="raise")


def test_empty_sampler_batch_and_collator():
    """A rank's filler batch [] collates to an all-padding row with padding, else a clear error."""
    sampler = TokenBudgetBatchSampler([5, 5, 5], 5, shuffle=False, num_replicas=2, rank=1)
    assert list(sampler)[-1] == []
    data = [{"input_ids": [1] * 5}] * 3
    padded = PackingCollator(pad_to_multiple_of=8)
    assert [b["input_ids"].shape[1] for b in _loader(data, sampler, padded)] == [8, 8]
    with pytest.raises(ValueError, match="no token to pack"):
        list(_loader(data, sampler, PackingCollator()))


def _loader(data, sampler, collator):
    return torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collator)


# --------------------------------------------------------------------------- real data


def _alpaca_lengths(shared_data):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(shared_data("tokenizers", "qwen2", "tokenizer.json")))
    with open(shared_data("alpaca", "alpaca_5000.json"), encoding="utf-8") as f:
        rows = json.load(f)

    def fmt(r):  # the shared data README's Alpaca format
        inp = f"### Input:\n{r['input']}\n\n" if r["input"] else ""
        return f"### Instruction:\n{r['instruction']}\n\n{inp}### Response:\n{r['output']}"

    enc = tok.encode_batch([fmt(r) for r in rows], add_special_tokens=False)
    return np.array([len(e.ids) for e in enc])


def test_alpaca_packing_efficiency(shared_data):
    lengths = _alpaca_lengths(shared_data)
    assert lengths.sum() == 408_762  # the shared data README's total for this format
    result = pack_by_tokens(lengths, 16384)
    _check_invariants(result, lengths, 16384)
    stats = result.stats
    print(stats)
    assert stats.packing_efficiency > 0.9
    assert stats.num_truncated == stats.num_skipped_empty == 0
    # Four ranks: every example once, all ranks the same number of steps.
    per_rank = [
        list(TokenBudgetBatchSampler(lengths, 16384, num_replicas=4, rank=r)) for r in range(4)
    ]
    assert len({len(r) for r in per_rank}) == 1
    assert sorted(i for r in per_rank for b in r for i in b) == list(range(len(lengths)))


def test_rank_tokens_and_imbalance():
    """rank_tokens: every rank's batch tokens per slot in the epoch's order (0 for an empty slot),
    the same table on every rank; rank_imbalance: max / mean of one step's per-rank tokens."""
    from hf_varlen.packing import rank_imbalance

    lengths = [500, 450, 400, 300, 250, 90, 80, 40]
    samplers = [
        TokenBudgetBatchSampler(lengths, 512, shuffle=True, seed=3, num_replicas=2, rank=r)
        for r in range(2)
    ]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        table = samplers[0].rank_tokens()
        assert table.shape == (len(samplers[0]), 2)
        assert (table == samplers[1].rank_tokens()).all()
        for r, s in enumerate(samplers):
            assert table[:, r].tolist() == [sum(lengths[i] for i in b) for b in s]
    assert (table == 0).sum() == 1  # 5 batches on 2 ranks: one empty slot
    assert rank_imbalance([300, 100]) == 1.5
    assert rank_imbalance([7]) == 1.0 and rank_imbalance([0, 0]) == 1.0
