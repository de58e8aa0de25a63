"""PackingCollator: parity with DataCollatorWithFlattening, padding, truncation, bad input."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_varlen.collator import PackingCollator

# The fixture of transformers' TestDataCollatorWithFlattening: lengths 3, 6, 7.
FEATURES = [
    {"input_ids": [10, 11, 12]},
    {"input_ids": [20, 21, 22, 23, 24, 25]},
    {"input_ids": [30, 31, 32, 33, 34, 35, 36]},
]


def _with_labels(features):
    return [{**f, "labels": [t + 1000 for t in f["input_ids"]]} for f in features]


def _convert(features, kind):
    conv = {"list": list, "numpy": np.asarray, "torch": torch.tensor}[kind]
    return [{k: conv(v) for k, v in f.items()} for f in features]


def _random_features(seed, n=12, max_len=40, labels=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    feats = [{"input_ids": torch.randint(0, 1000, (n_,), generator=g).tolist()} for n_ in lengths]
    return _with_labels(feats) if labels else feats


def assert_batches_equal(ours, ref):
    assert ours.keys() == ref.keys()
    for key, want in ref.items():
        got = ours[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
            assert got.shape == want.shape, (key, got.shape, want.shape)
            assert torch.equal(got, want), key
        elif isinstance(want, np.ndarray):
            assert isinstance(got, np.ndarray), key
            assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=key)
        else:
            assert type(got) is type(want) and got == want, (key, got, want)


def _hf(**kw):
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True, **kw)


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
@pytest.mark.parametrize("labels", [False, True])
def test_parity_with_data_collator_with_flattening(kind, labels):
    base = _with_labels(FEATURES) if labels else FEATURES
    ours = PackingCollator(return_seq_idx=True)(_convert(base, kind))
    assert_batches_equal(ours, _hf()(_convert(base, kind)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("labels", [False, True])
def test_parity_random_features(seed, labels):
    feats = _random_features(seed, labels=labels)
    assert_batches_equal(PackingCollator(return_seq_idx=True)(feats), _hf()(feats))


@pytest.mark.parametrize(
    "options",
    [
        {"position_ids_start": 2},
        {"separator_id": -1},
        {"return_position_ids": False},
        {"return_seq_idx": False},
        {"return_flash_attn_kwargs": False},
    ],
)
def test_parity_options(options):
    ours = PackingCollator(**{"return_seq_idx": True, **options})
    ref = DataCollatorWithFlattening(
        **{"return_flash_attn_kwargs": True, "return_seq_idx": True, **options}
    )
    assert_batches_equal(ours(FEATURES), ref(FEATURES))


def test_parity_numpy_output():
    feats = _with_labels(FEATURES)
    ours = PackingCollator(return_seq_idx=True, return_tensors="np")(feats)
    assert_batches_equal(ours, _hf(return_tensors="np")(feats))
    # Per-call override, as in transformers.
    assert_batches_equal(PackingCollator(return_seq_idx=True)(feats, return_tensors="np"), ours)


def test_expected_values_and_dtypes():
    out = PackingCollator(return_seq_idx=True)(FEATURES)
    assert out["input_ids"].dtype == out["labels"].dtype == out["position_ids"].dtype == torch.int64
    assert out["seq_idx"].dtype == out["cu_seq_lens_q"].dtype == torch.int32
    assert out["cu_seq_lens_q"].tolist() == out["cu_seq_lens_k"].tolist() == [0, 3, 9, 16]
    assert out["cu_seq_lens_q"].data_ptr() != out["cu_seq_lens_k"].data_ptr()
    assert out["max_length_q"] == out["max_length_k"] == 7
    assert type(out["max_length_q"]) is int
    assert out["position_ids"][0].tolist() == [0, 1, 2] + list(range(6)) + list(range(7))
    assert out["labels"][0, [0, 3, 9]].tolist() == [-100, -100, -100]
    assert out["seq_idx"][0].tolist() == [0] * 3 + [1] * 6 + [2] * 7
    assert "attention_mask" not in out


def test_inputs_not_mutated():
    feats = _convert(_with_labels(FEATURES), "numpy") + _convert(_with_labels(FEATURES), "torch")
    before = copy.deepcopy(feats)
    out = PackingCollator(pad_to_multiple_of=8)(feats)
    out["input_ids"].zero_()
    out["labels"].zero_()
    for a, b in zip(feats, before):
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


@pytest.mark.parametrize("multiple", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("labels", [False, True])
def test_pad_to_multiple_of(multiple, labels):
    feats = _with_labels(FEATURES) if labels else FEATURES
    plain = PackingCollator(return_seq_idx=True)(feats)
    out = PackingCollator(return_seq_idx=True, pad_to_multiple_of=multiple, pad_token_id=7)(feats)
    real, total = 16, out["input_ids"].shape[1]
    pad = total - real
    assert total % multiple == 0 and 0 <= pad < multiple
    # The real tokens are exactly the unpadded batch.
    for key in ("input_ids", "labels", "position_ids", "seq_idx"):
        assert torch.equal(out[key][:, :real], plain[key]), key
    # The pad is one trailing segment: own cu_seq_lens entry, positions restart, all labels ignored.
    want_cu = [0, 3, 9, 16] + ([total] if pad else [])
    assert out["cu_seq_lens_q"].tolist() == out["cu_seq_lens_k"].tolist() == want_cu
    assert out["input_ids"][0, real:].tolist() == [7] * pad
    assert out["labels"][0, real:].tolist() == [-100] * pad
    assert out["position_ids"][0, real:].tolist() == list(range(pad))
    assert out["seq_idx"][0, real:].tolist() == [3] * pad
    assert out["max_length_q"] == out["max_length_k"] == max(7, pad)
    # The loss sees the same targets: shifted labels (what causal-LM losses count) are unchanged.
    assert out["labels"][0, 1:].ne(-100).sum() == plain["labels"][0, 1:].ne(-100).sum()


def test_pad_position_ids_start():
    out = PackingCollator(pad_to_multiple_of=10, position_ids_start=2)(FEATURES)
    assert out["position_ids"][0, 16:].tolist() == [2, 3, 4, 5]


def test_pad_segment_can_be_the_longest():
    out = PackingCollator(pad_to_multiple_of=32)([{"input_ids": [1, 2]}])
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 32]
    assert out["max_length_q"] == 30


@pytest.mark.parametrize("features", [[], [{"input_ids": []}, {"input_ids": np.array([])}]])
def test_empty_batch(features):
    out = PackingCollator(return_seq_idx=True)(features)
    assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape == (1, 0)
    assert out["seq_idx"].shape == (1, 0)
    assert out["cu_seq_lens_q"].tolist() == [0] and out["max_length_q"] == 0
    # With padding an empty batch becomes one all-pad segment: a runnable zero-label step.
    out = PackingCollator(pad_to_multiple_of=8)(features)
    assert out["input_ids"].shape == (1, 8)
    assert out["labels"].eq(-100).all()
    assert out["cu_seq_lens_q"].tolist() == [0, 8] and out["max_length_q"] == 8


@pytest.mark.parametrize("labels", [False, True])
def test_empty_examples_skipped_and_counted(labels):
    feats = _with_labels(FEATURES) if labels else FEATURES
    with_empty = [{"input_ids": [], **({"labels": []} if labels else {})}]
    mixed = with_empty + feats[:2] + with_empty + with_empty + feats[2:]
    collator = PackingCollator(return_seq_idx=True)
    out = collator(mixed)
    assert_batches_equal(out, _hf()(feats))
    assert collator.num_skipped_empty == 3
    collator(mixed)
    assert collator.num_skipped_empty == 6  # cumulative over calls


@pytest.mark.parametrize("labels", [False, True])
def test_max_length_truncation(labels):
    feats = _with_labels(FEATURES) if labels else FEATURES
    collator = PackingCollator(return_seq_idx=True, max_length=5)
    out = collator(feats)
    cut = [{k: v[:5] for k, v in f.items()} for f in feats]
    assert_batches_equal(out, _hf()(cut))
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 8, 13]
    assert out["max_length_q"] == 5
    assert (collator.num_truncated, collator.num_truncated_tokens) == (2, 1 + 2)


def test_truncation_then_padding():
    out = PackingCollator(max_length=4, pad_to_multiple_of=8)(FEATURES)
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 7, 11, 16]
    assert out["input_ids"].shape == (1, 16)


def test_other_keys_ignored_and_none_labels_means_absent():
    feats = [{**f, "attention_mask": [1] * len(f["input_ids"]), "labels": None} for f in FEATURES]
    assert_batches_equal(PackingCollator(return_seq_idx=True)(feats), _hf()(FEATURES))


def test_dataloader_integration():
    data = _random_features(0, n=10)
    collator = PackingCollator(pad_to_multiple_of=16)
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collator)
    for i, batch in enumerate(loader):
        chunk = data[4 * i : 4 * i + 4]
        real = sum(len(f["input_ids"]) for f in chunk)
        cu = batch["cu_seq_lens_q"].tolist()
        assert batch["input_ids"].shape[1] == cu[-1] == -(-real // 16) * 16
        assert (
            cu[: len(chunk) + 1] == np.cumsum([0] + [len(f["input_ids"]) for f in chunk]).tolist()
        )
    assert i == 2


@pytest.mark.parametrize(
    ("features", "error", "match"),
    [
        ({"input_ids": [1]}, TypeError, "features: expected a list"),
        ([{"ids": [1]}], TypeError, r"features\[0\]: expected a mapping with 'input_ids'"),
        ([[1, 2]], TypeError, r"features\[0\]"),
        ([{"input_ids": [1.0, 2.0]}], TypeError, r"features\[0\]\['input_ids'\].*float"),
        ([{"input_ids": torch.ones(3)}], TypeError, r"features\[0\]\['input_ids'\].*float"),
        ([{"input_ids": [[1, 2]]}], ValueError, r"expected a 1-D sequence, got shape \(1, 2\)"),
        (
            [{"input_ids": [1, 2], "labels": [1]}],
            ValueError,
            r"features\[0\]\['labels'\]: expected length 2",
        ),
        (
            [{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}],
            ValueError,
            r"features\[1\]: 'labels' is missing",
        ),
    ],
)
def test_bad_features(features, error, match):
    with pytest.raises(error, match=match):
        PackingCollator()(features)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of: expected an int >= 1, got 0"),
        ({"max_length": 0}, ValueError, "max_length: expected an int >= 1"),
        ({"max_length": 2.5}, TypeError, "max_length: expected an int"),
        ({"position_ids_start": -1}, ValueError, "position_ids_start"),
        ({"return_tensors": "tf"}, ValueError, "return_tensors: expected 'pt' or 'np', got 'tf'"),
        ({"separator_id": True}, TypeError, "separator_id"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        PackingCollator(**kwargs)
