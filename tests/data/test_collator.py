"""PackingCollator: a drop-in for DataCollatorWithFlattening (arguments, transformers' own
collator behaviour, parity), the inputs users pass (BatchEncoding, columns, tensors), padding,
truncation, empty batches, bad input."""

from __future__ import annotations

import copy
import dataclasses
import doctest
import inspect
import pickle

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening, DefaultDataCollator

import hf_varlen.collator
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
    # pad positions restart and wrap at the longest document (7): never past the real ones
    assert out["position_ids"][0, real:].tolist() == [i % 7 for i in range(pad)]
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


@pytest.mark.parametrize(
    "features",
    [
        [],
        [{"input_ids": []}, {"input_ids": np.array([])}],
        {"input_ids": [[], []]},
        {"input_ids": [[1, 2], [3]], "attention_mask": [[0, 0], [0]]},
    ],
)
def test_empty_batch(features):
    # No token at all: a clear error here, not cu=[0], T=0 and a crash deep inside the model.
    with pytest.raises(ValueError, match=r"no token to pack.*set pad_to_multiple_of"):
        PackingCollator(return_seq_idx=True)(features)
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
        ({"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be >= 1, got 0"),
        ({"max_length": 0}, ValueError, "max_length must be >= 1"),
        ({"max_length": 2.5}, TypeError, "max_length must be an int or None, got 2.5"),
        ({"pad_token_id": -1}, ValueError, "pad_token_id must be >= 0"),
        ({"position_ids_start": -1}, ValueError, "position_ids_start"),
        ({"return_tensors": "tf"}, ValueError, "return_tensors: expected 'pt' or 'np', got 'tf'"),
        ({"separator_id": True}, TypeError, "separator_id"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        PackingCollator(**kwargs)


# --------------------------------------------------------------------------- drop-in for transformers


def _hf_init_arguments():
    """Every argument DataCollatorWithFlattening accepts, with its default: its own keywords plus
    the fields of its base DefaultDataCollator (reached through *args / **kwargs)."""
    params = inspect.signature(DataCollatorWithFlattening.__init__).parameters.values()
    own = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    base = {f.name: f.default for f in dataclasses.fields(DefaultDataCollator)}
    return {**base, **own}


def test_accepts_every_data_collator_with_flattening_argument():
    hf_args = _hf_init_arguments()
    assert {"return_tensors", "return_position_ids", "separator_id", "return_seq_idx"} <= set(
        hf_args
    )
    fields = {f.name: f.default for f in dataclasses.fields(PackingCollator) if f.init}
    # Same names; same defaults except the one the class docstring lists.
    assert set(hf_args) <= set(fields)
    differ = {k for k in hf_args if fields[k] != hf_args[k]}
    assert differ == {"return_flash_attn_kwargs"} and hf_args["return_flash_attn_kwargs"] is False
    assert "return_flash_attn_kwargs" in PackingCollator.__doc__
    # transformers' defaults, passed explicitly, give transformers' output exactly.
    for kind in ("list", "numpy", "torch"):
        feats = _convert(_with_labels(FEATURES), kind)
        assert_batches_equal(PackingCollator(**hf_args)(feats), DataCollatorWithFlattening()(feats))


def test_positional_return_tensors_as_in_transformers():
    hf, ours = (
        DataCollatorWithFlattening("np"),
        PackingCollator("np", return_flash_attn_kwargs=False),
    )
    assert ours.return_tensors == "np"
    assert_batches_equal(ours(FEATURES), hf(FEATURES))
    # Only return_tensors is positional there; the same call with two positionals fails in both.
    with pytest.raises(TypeError):
        DataCollatorWithFlattening("np", True)
    with pytest.raises(TypeError):
        PackingCollator("np", True)


def test_call_signature_as_in_transformers():
    names = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert names(PackingCollator.__call__) == names(DataCollatorWithFlattening.__call__)


def test_is_a_default_data_collator_dataclass():
    collator = PackingCollator(max_length=8, pad_to_multiple_of=4)
    assert isinstance(collator, DefaultDataCollator) and dataclasses.is_dataclass(collator)
    assert collator == PackingCollator(max_length=8, pad_to_multiple_of=4)
    assert collator != PackingCollator(max_length=9, pad_to_multiple_of=4)
    text = repr(collator)
    assert "max_length=8" in text and "pad_to_multiple_of=4" in text and "num_" not in text
    # Counters are state, not options: not compared, not copied by replace().
    collator([{"input_ids": []}, {"input_ids": [1] * 10}])
    assert (collator.num_skipped_empty, collator.num_truncated) == (1, 1)
    assert collator == PackingCollator(max_length=8, pad_to_multiple_of=4)
    fresh = dataclasses.replace(collator, max_length=16)
    assert (fresh.max_length, fresh.pad_to_multiple_of, fresh.num_skipped_empty) == (16, 4, 0)
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        dataclasses.replace(collator, max_length=0)
    # DataLoader workers get a pickled copy.
    assert pickle.loads(pickle.dumps(collator)) == collator


def test_docstring_examples_hold():
    result = doctest.testmod(hf_varlen.collator, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0


@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_transformers_flattening_behaviour(return_tensors):
    """transformers' own DataCollatorWithFlattening tests, as behaviour (with its defaults)."""
    array = (lambda t: t.numpy()) if return_tensors == "pt" else np.asarray
    collator = PackingCollator(return_tensors=return_tensors, return_flash_attn_kwargs=False)
    batch = collator(FEATURES)
    assert batch["input_ids"].shape == (1, 16)
    assert batch["input_ids"][0].tolist() == [10, 11, 12, *range(20, 26), *range(30, 37)]
    assert "attention_mask" not in batch and "cu_seq_lens_q" not in batch
    assert batch["position_ids"].shape == (1, 16)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, *range(6), *range(7)]
    assert array(batch["input_ids"]).dtype == np.int64

    # Flash-attention kwargs: int32 offsets, Python-int max lengths.
    batch = PackingCollator(return_tensors=return_tensors)(FEATURES)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert array(batch[key]).dtype == np.int32 and batch[key].tolist() == [0, 3, 9, 16]
    assert batch["max_length_q"] == batch["max_length_k"] == 7

    # seq_idx: the document index of each token, int32.
    batch = collator(FEATURES, return_tensors=return_tensors)
    assert "seq_idx" not in batch
    batch = PackingCollator(return_tensors=return_tensors, return_seq_idx=True)(FEATURES)
    assert array(batch["seq_idx"]).dtype == np.int32
    assert batch["seq_idx"][0].tolist() == [0] * 3 + [1] * 6 + [2] * 7

    # Labels given as tensors (a transformers regression): the separator replaces the first label.
    feats = [{"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([10, 11, 12, 13])},
             {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([14, 15, 16])}]  # fmt: skip
    batch = collator(feats)
    assert batch["labels"][0].tolist() == [-100, 11, 12, 13, -100, 15, 16]
    assert batch["labels"][0].tolist() == DataCollatorWithFlattening()(feats)["labels"][0].tolist()

    # A per-call separator_id, and position_ids_start.
    batch = PackingCollator(return_tensors=return_tensors, position_ids_start=2)(
        FEATURES, separator_id=-1
    )
    assert batch["labels"][0, [0, 3, 9]].tolist() == [-1, -1, -1]
    assert batch["position_ids"][0, :4].tolist() == [2, 3, 4, 2]


# --------------------------------------------------------------------------- inputs users pass


@pytest.fixture
def tokenizer(shared_data):
    from transformers import PreTrainedTokenizerFast

    path = shared_data("tokenizers", "qwen2", "tokenizer.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
    tok.pad_token = "<|endoftext|>"
    return tok


TEXTS = ["The capital of France is Paris.", "Packing", "A longer sentence, with more tokens in it."]


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("tensors", [None, "pt", "np"])
def test_batch_encoding_from_a_tokenizer(tokenizer, tensors, padding_side):
    tokenizer.padding_side = padding_side
    rows = [{"input_ids": tokenizer(t)["input_ids"]} for t in TEXTS]
    want = PackingCollator(return_seq_idx=True)(rows)
    assert len({len(r["input_ids"]) for r in rows}) == 3  # padding matters below
    collator = PackingCollator(return_seq_idx=True)
    padding = tensors is not None  # tensors need equal lengths: padded, with the attention mask
    encoding = tokenizer(TEXTS, padding=padding, return_tensors=tensors)
    before = copy.deepcopy(dict(encoding))
    assert_batches_equal(collator(encoding), want)
    # The padding was dropped through the attention mask, not packed; the input is untouched.
    for key, value in before.items():
        now = encoding[key]
        same = torch.equal(now, value) if torch.is_tensor(value) else np.array_equal(now, value)
        assert same if tensors else now == value, key


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_mapping_of_columns_equals_list_of_mappings(kind):
    rows = _with_labels(FEATURES)
    conv = {"list": list, "numpy": np.asarray, "torch": torch.tensor}[kind]
    columns = {
        "input_ids": [conv(r["input_ids"]) for r in rows],
        "labels": [conv(r["labels"]) for r in rows],
        "token_type_ids": [[0] * len(r["input_ids"]) for r in rows],  # not used, as in transformers
    }
    assert_batches_equal(PackingCollator()(columns), PackingCollator()(rows))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_two_dimensional_inputs(kind):
    conv = {"numpy": np.asarray, "torch": torch.tensor}[kind]
    ids = [[1, 2, 3], [4, 5, 6]]
    want = PackingCollator()([{"input_ids": r} for r in ids])
    assert_batches_equal(PackingCollator()(conv(ids)), want)
    assert_batches_equal(PackingCollator()({"input_ids": conv(ids)}), want)
    # Padded 2-D columns with labels and a (bool or int) mask: pad positions are dropped.
    padded = {
        "input_ids": conv([[1, 2, 3], [0, 4, 5]]),
        "labels": conv([[7, 8, 9], [-100, 10, 11]]),
        "attention_mask": conv([[True, True, True], [False, True, True]]),
    }
    want = PackingCollator()([{"input_ids": [1, 2, 3], "labels": [7, 8, 9]},
                              {"input_ids": [4, 5], "labels": [10, 11]}])  # fmt: skip
    assert_batches_equal(PackingCollator()(padded), want)


def test_attention_mask_in_a_list_of_mappings():
    feats = [
        {"input_ids": [0, 0, 1, 2], "labels": [-100, -100, 1, 2], "attention_mask": [0, 0, 1, 1]},
        {"input_ids": [3, 4, 0], "labels": [3, 4, -100], "attention_mask": [1, 1, 0]},
    ]
    out = PackingCollator()(feats)
    assert out["input_ids"][0].tolist() == [1, 2, 3, 4]
    assert out["labels"][0].tolist() == [-100, 2, -100, 4]
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 4]


@pytest.mark.parametrize(
    ("features", "error", "match"),
    [
        ({"labels": [[1]]}, TypeError, r"mapping of columns needs 'input_ids', got keys \['labels'\]"),
        ({"input_ids": [1, 2, 3]}, TypeError, r"flat sequence of shape \(3,\).*\[example\]"),
        ({"input_ids": torch.tensor([1, 2])}, TypeError, r"features\['input_ids'\]"),
        (torch.ones(2, 2, 2, dtype=torch.long), TypeError, r"array of shape \(2, 2, 2\)"),
        (np.array([1, 2]), TypeError, "single example"),
        ({"input_ids": [[1], [2]], "labels": [[1]]}, ValueError, r"features\['labels'\]: expected 2 rows"),
        ({"input_ids": "abc"}, TypeError, r"features\['input_ids'\]: expected one row per example"),
        ({"input_ids": [[1, 2]], "labels": [[1]]}, ValueError, r"features\['labels'\]\[0\]: expected length 2"),
        ({"input_ids": [[1.5]]}, TypeError, r"features\['input_ids'\]\[0\]: expected integer"),
        ({"input_ids": [[1, 2]], "attention_mask": [[1]]}, ValueError, r"'attention_mask'\]\[0\]: expected length 2"),
        ({"input_ids": [[1, 2]], "attention_mask": [[1, 2]]}, ValueError, "expected 0/1 values"),
        ([{"input_ids": [1], "attention_mask": [0.5]}], TypeError, r"features\[0\]\['attention_mask'\]"),
        ([torch.tensor([1, 2])], TypeError, r"features\[0\].*pass \{'input_ids': rows\}"),
        ("text", TypeError, "features: expected a list of mappings, a mapping of columns or a 2-D"),
    ],
)  # fmt: skip
def test_bad_inputs_name_what_is_wrong(features, error, match):
    with pytest.raises(error, match=match):
        PackingCollator()(features)
