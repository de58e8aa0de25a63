"""Static-shape packs (issue 14 item 1): token buckets and a fixed-length ``cu_seq_lens``.

``PackingCollator(pad_to_buckets=..., max_documents=...)`` rounds the packed length up to a bucket
of a ladder (``bucket_ladder``) and pads ``cu_seq_lens`` with zero-length documents to a fixed
length. The padding is its own trailing segment (labels -100, positions from 0 that wrap at the
longest real document), so a bucketed
batch gives the loss, the real-token logits and the gradients of the unbucketed one (CPU, fp32,
numerics rule against the unbucketed fp32 / fp64 runs), on every CPU backend.
"""

from __future__ import annotations

import copy
import doctest
import math
import pickle

import numpy as np
import pytest
import torch
from tiny_packed import tiny_config
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import hf_varlen
import hf_varlen.packing
from hf_varlen import (
    ExampleCountBatchSampler,
    PackingCollator,
    TokenBudgetBatchSampler,
    bucket_ladder,
    pack_by_tokens,
)
from hf_varlen.backends.registry import get_spec
from hf_varlen.ops.common import IGNORE_INDEX
from hf_varlen.testing import assert_numerics

# --------------------------------------------------------------------------- the ladder


def test_bucket_ladder_default_is_geometric_in_multiples_of_64():
    ladder = bucket_ladder(16384)
    assert isinstance(ladder, tuple) and all(type(b) is int for b in ladder)
    assert ladder[0] == 64 and ladder[-1] == 16384
    assert list(ladder) == sorted(set(ladder))
    assert all(b % 64 == 0 for b in ladder)
    # Each step is at most 2**(1/8) plus one rounding to 64, so the padding of a pack of n tokens
    # is below n * (2**(1/8) - 1) + 64.
    for lo, hi in zip(ladder, ladder[1:]):
        assert hi <= math.ceil(lo * 2 ** (1 / 8) / 64) * 64 + 64
    # 8 rungs per doubling from 64 to 16384 (fewer where rounding to 64 merges the small ones).
    assert 40 <= len(ladder) <= 8 * 8 + 1


def test_packing_docstring_examples_hold():
    result = doctest.testmod(hf_varlen.packing, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 1 and result.failed == 0


def test_bucket_ladder_options():
    assert bucket_ladder(1000, multiple=256, steps_per_doubling=None) == (256, 512, 768, 1000)
    assert bucket_ladder(1024, multiple=256, steps_per_doubling=None) == (256, 512, 768, 1024)
    assert bucket_ladder(1024, multiple=128, steps_per_doubling=1) == (128, 256, 512, 1024)
    assert bucket_ladder(1024, multiple=128, steps_per_doubling=2) == (
        128, 256, 384, 512, 768, 1024,
    )  # fmt: skip
    assert bucket_ladder(50) == (50,)  # below one multiple: the budget itself
    assert bucket_ladder(64) == (64,)
    # Budget not a multiple: it is the top rung (a full pack must fit).
    assert bucket_ladder(1000, multiple=128, steps_per_doubling=1) == (128, 256, 512, 1000)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be an int"),
        ({"max_tokens": 64, "multiple": 0}, ValueError, "multiple must be >= 1"),
        ({"max_tokens": 64, "steps_per_doubling": 0}, ValueError, "steps_per_doubling must be"),
    ],
)
def test_bucket_ladder_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        bucket_ladder(**kwargs)


# --------------------------------------------------------------------------- the collator

DOCS = [
    {"input_ids": [11, 12, 13, 14, 15, 16, 17], "labels": [11, 12, 13, -100, 15, 16, 17]},
    {"input_ids": [21, 22, 23]},
    {"input_ids": [31, 32, 33, 34, 35]},
]


def _docs(labels=True):
    out = []
    for d in DOCS:
        d = dict(d)
        if labels:
            d.setdefault("labels", list(d["input_ids"]))
        else:
            d.pop("labels", None)
        out.append(d)
    return out


@pytest.mark.parametrize("labels", [False, True])
def test_bucketed_batch_layout(labels):
    docs = _docs(labels)
    plain = PackingCollator(return_seq_idx=True)(docs)
    col = PackingCollator(
        return_seq_idx=True, pad_to_buckets=(8, 24, 32), max_documents=5, pad_token_id=7
    )
    b = col(docs)
    real, total = 15, 24
    assert b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == (1, total)
    assert torch.equal(b["input_ids"][:, :real], plain["input_ids"])
    assert torch.equal(b["labels"][:, :real], plain["labels"])
    assert torch.equal(b["position_ids"][:, :real], plain["position_ids"])
    assert torch.equal(b["seq_idx"][:, :real], plain["seq_idx"])
    # The padding segment: its own document at the end.
    assert (b["input_ids"][0, real:] == 7).all()
    assert (b["labels"][0, real:] == IGNORE_INDEX).all()
    # positions restart and wrap at the longest real document (7): never past the real ones
    assert b["position_ids"][0, real:].tolist() == [i % 7 for i in range(total - real)]
    assert (b["seq_idx"][0, real:] == 3).all()
    # max_documents real documents + the padding segment; unused slots repeat the last offset.
    cu = [0, 7, 10, 15, 24, 24, 24]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert b[key].dtype == torch.int32 and b[key].tolist() == cu
    assert b["cu_seq_lens_q"] is not b["cu_seq_lens_k"]
    assert b["max_length_q"] == b["max_length_k"] == 9  # the padding segment is the longest
    assert "real_tokens" not in b  # opt-in: a model would receive it as a kwarg


def test_max_length_is_the_longest_real_document_when_padding_is_shorter():
    b = PackingCollator(pad_to_buckets=(16,), max_documents=3)(_docs())
    assert b["cu_seq_lens_q"].tolist() == [0, 7, 10, 15, 16]
    assert b["max_length_q"] == b["max_length_k"] == 7


def test_exact_bucket_gives_a_zero_length_padding_segment():
    b = PackingCollator(pad_to_buckets=(15, 32), max_documents=4)(_docs())
    assert b["input_ids"].shape == (1, 15)
    assert b["cu_seq_lens_q"].tolist() == [0, 7, 10, 15, 15, 15]
    assert b["max_length_q"] == 7
    # Without max_documents the offsets are those of the unbucketed batch.
    b = PackingCollator(pad_to_buckets=(15, 32))(_docs())
    assert b["cu_seq_lens_q"].tolist() == [0, 7, 10, 15]


def test_max_documents_without_padding():
    b = PackingCollator(max_documents=5)(_docs())
    assert b["input_ids"].shape == (1, 15)
    assert b["cu_seq_lens_q"].tolist() == [0, 7, 10, 15, 15, 15]
    b = PackingCollator(max_documents=4, pad_to_multiple_of=8)(_docs())
    assert b["cu_seq_lens_q"].tolist() == [0, 7, 10, 15, 16, 16]


def test_int_pad_to_buckets_is_the_default_ladder():
    col = PackingCollator(pad_to_buckets=1024)
    assert col.pad_to_buckets == bucket_ladder(1024)
    assert col(_docs())["input_ids"].shape == (1, 64)
    assert PackingCollator(pad_to_buckets=[24, 8]).pad_to_buckets == (8, 24)


def test_fixed_cu_length_across_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 120, size=300)
    data = [{"input_ids": rng.integers(0, 1000, size=n).tolist()} for n in lengths]
    sampler = TokenBudgetBatchSampler(lengths, 1024, seed=0)
    assert sampler.max_documents == max(len(b) for b in sampler.batches)
    col = PackingCollator(pad_to_buckets=bucket_ladder(1024), max_documents=sampler.max_documents)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=col)
    shapes, cu_lens = set(), set()
    for batch in loader:
        total = batch["input_ids"].shape[1]
        assert total in col.pad_to_buckets
        shapes.add(total)
        cu = batch["cu_seq_lens_q"]
        cu_lens.add(cu.numel())
        assert cu[-1] == total and (cu.diff() >= 0).all()
        assert batch["max_length_q"] == int(cu.diff().max())
    assert cu_lens == {sampler.max_documents + 2}
    assert len(shapes) <= 4


def test_real_tokens_is_opt_in():
    col = PackingCollator(pad_to_buckets=(32,), max_documents=4, return_real_tokens=True)
    b = col(_docs())
    assert b["real_tokens"] == 15 and type(b["real_tokens"]) is int
    assert PackingCollator(return_real_tokens=True)(_docs())["real_tokens"] == 15
    empty = PackingCollator(pad_to_buckets=(8, 16), max_documents=2, return_real_tokens=True)
    assert empty([])["real_tokens"] == 0


def test_empty_batch_is_the_smallest_bucket_of_padding():
    b = PackingCollator(pad_to_buckets=(8, 16), max_documents=2)([{"input_ids": []}])
    assert b["input_ids"].shape == (1, 8)
    assert (b["labels"] == IGNORE_INDEX).all()
    assert b["cu_seq_lens_q"].tolist() == [0, 8, 8, 8]
    assert b["max_length_q"] == 8


def test_too_many_documents_is_refused_naming_max_documents():
    col = PackingCollator(pad_to_buckets=(64,), max_documents=2)
    with pytest.raises(ValueError, match=r"3 documents.*max_documents=2") as info:
        col(_docs())
    assert "TokenBudgetBatchSampler" in str(info.value)  # the fix: split in the sampler
    # Empty examples are not documents.
    assert col([*_docs()[:2], {"input_ids": [], "labels": []}])["cu_seq_lens_q"].tolist() == [
        0,
        7,
        10,
        64,
    ]


def test_pack_longer_than_the_largest_bucket_is_refused():
    col = PackingCollator(pad_to_buckets=(8, 12))
    with pytest.raises(ValueError, match=r"15 tokens.*largest bucket 12.*pad_to_buckets"):
        col(_docs())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pad_to_buckets": (), "max_documents": 2}, ValueError, "pad_to_buckets: expected"),
        ({"pad_to_buckets": (8, 8)}, ValueError, "pad_to_buckets: .*distinct"),
        ({"pad_to_buckets": (0, 8)}, ValueError, "pad_to_buckets"),
        ({"pad_to_buckets": (8.0,)}, TypeError, "pad_to_buckets"),
        ({"pad_to_buckets": "16"}, TypeError, "pad_to_buckets"),
        ({"pad_to_buckets": 0}, ValueError, "pad_to_buckets must be >= 1"),
        (
            {"pad_to_buckets": (8,), "pad_to_multiple_of": 8},
            ValueError,
            "pad_to_buckets and pad_to_multiple_of",
        ),
        ({"max_documents": 0}, ValueError, "max_documents must be >= 1"),
        ({"max_documents": 2.5}, TypeError, "max_documents must be an int"),
    ],
)
def test_bad_bucket_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        PackingCollator(**kwargs)


def test_bucketed_collator_pickles():
    col = PackingCollator(pad_to_buckets=bucket_ladder(512), max_documents=9)
    again = pickle.loads(pickle.dumps(col))
    assert again == col and again(_docs())["cu_seq_lens_q"].numel() == 11


# --------------------------------------------------------------------------- the samplers


def test_pack_by_tokens_max_documents_splits():
    lengths = [1] * 10 + [5, 6]
    result = pack_by_tokens(lengths, 64, max_documents=4, seed=None)
    assert max(len(b) for b in result.batches) == 4
    assert sorted(i for b in result.batches for i in b) == list(range(12))
    assert all(t <= 64 for t in result.batch_tokens)
    assert len(result.batches) == 3  # ceil(12 / 4): the count, not the budget, binds
    for strategy in ("ffd", "sequential"):
        r = pack_by_tokens(lengths, 64, strategy=strategy, max_documents=4, seed=None)
        assert max(len(b) for b in r.batches) == 4 and len(r.batches) == 3
    unconstrained = pack_by_tokens(lengths, 64, seed=None)
    assert len(unconstrained.batches) == 1


def test_sampler_max_documents():
    lengths = np.random.default_rng(0).integers(1, 50, size=400)
    capped = TokenBudgetBatchSampler(lengths, 2048, max_documents=32)
    assert capped.max_documents == 32
    assert max(len(b) for b in capped.batches) <= 32
    free = TokenBudgetBatchSampler(lengths, 2048)
    assert free.max_documents == max(len(b) for b in free.batches) > 32
    counted = ExampleCountBatchSampler(lengths, 24)
    assert counted.max_documents == 24
    with pytest.raises(ValueError, match="max_documents must be >= 1"):
        TokenBudgetBatchSampler(lengths, 2048, max_documents=0)


# --------------------------------------------------------------------------- the model


def _cpu_backends():
    """The CPU backends that run a model's forward and backward ('flex' needs CUDA backward)."""
    return [b for b in ("sdpa", "reference") if b in hf_varlen.available_backends()]


CFG = tiny_config(use_cache=False)
PAD_ID = 96  # never a real token below, so its embedding row must get exactly zero gradient


def _model(backend, dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**copy.deepcopy(CFG)), attn_implementation="varlen_packed"
    ).to(dtype)
    hf_varlen.set_backend(backend, model=model)
    return model


def _features(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 90, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = IGNORE_INDEX  # a prompt
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("backend", _cpu_backends())
@pytest.mark.parametrize(
    ("lengths", "buckets", "max_documents"),
    [
        ([7, 12, 3, 9], (16, 48, 64), 6),  # padding longer than every document
        ([20, 5, 30], (56, 64), 3),  # short padding, no spare document slot
        ([8, 8], (16, 32), 4),  # exact bucket: a zero-length padding segment
    ],
)
def test_bucketed_equals_unbucketed_loss_and_gradients(backend, lengths, buckets, max_documents):
    feats = _features(lengths)
    real = sum(lengths)
    plain = PackingCollator()(feats)
    bucketed = PackingCollator(
        pad_to_buckets=buckets, max_documents=max_documents, pad_token_id=PAD_ID
    )(feats)
    assert bucketed["cu_seq_lens_q"].numel() == max_documents + 2
    ref_hi = _run(_model(backend, torch.float64), plain)
    ref_lo = _run(_model(backend, torch.float32), plain)
    model = _model(backend, torch.float32)
    loss, logits, grads = _run(model, bucketed)
    assert_numerics("loss", loss, ref_hi[0], ref_lo[0])
    assert_numerics("logits", logits[:, :real], ref_hi[1], ref_lo[1])
    for name, g in grads.items():
        assert_numerics(f"grad {name}", g, ref_hi[2][name], ref_lo[2][name], factor=3.0)
    # The padding segment contributes nothing: the pad token's embedding gets no gradient.
    if bucketed["input_ids"].shape[1] > real:
        assert torch.equal(
            grads["model.embed_tokens.weight"][PAD_ID], torch.zeros(CFG["hidden_size"])
        )


# Models whose result depends on the position range: a dynamic-NTK RoPE Llama rescales every
# token's rotation once the largest position id passes max_position_embeddings (32 here), and
# GPT-2's learned table has n_positions (128) rows. The buckets pad far past both.
_POSITION_RANGE_MODELS = {
    "llama-dynamic-ntk": (
        lambda: LlamaConfig(
            **{**CFG, "max_position_embeddings": 32},
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),
        (128,),
    ),
    "gpt2-learned-positions": (
        lambda: GPT2Config(
            **dict(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128, use_cache=False),
            **dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1),
        ),
        (256,),
    ),
}


@pytest.mark.parametrize("backend", _cpu_backends())
@pytest.mark.parametrize("arch", sorted(_POSITION_RANGE_MODELS))
def test_padding_past_the_position_range_changes_nothing(backend, arch):
    """Bucket padding longer than the model's position range neither crashes (GPT-2's table) nor
    changes the real tokens (dynamic NTK follows the largest position id): loss, real logits and
    gradients equal the unbucketed batch's under the numerics rule."""
    make_config, buckets = _POSITION_RANGE_MODELS[arch]
    lengths = [20, 25, 14]
    feats = _features(lengths)
    real = sum(lengths)

    def model(dtype):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(make_config(), attn_implementation="varlen_packed")
        hf_varlen.set_backend(backend, model=m)
        return m.to(dtype)

    bucketed = PackingCollator(pad_to_buckets=buckets, max_documents=4, pad_token_id=PAD_ID)(feats)
    assert bucketed["input_ids"].shape[1] == buckets[0]
    assert int(bucketed["position_ids"].max()) == max(lengths) - 1
    plain = PackingCollator()(feats)
    ref_hi = _run(model(torch.float64), plain)
    ref_lo = _run(model(torch.float32), plain)
    loss, logits, grads = _run(model(torch.float32), bucketed)
    assert_numerics(f"{arch} loss", loss, ref_hi[0], ref_lo[0])
    assert_numerics(f"{arch} logits", logits[:, :real], ref_hi[1], ref_lo[1])
    for name, g in grads.items():
        assert_numerics(f"{arch} grad {name}", g, ref_hi[2][name], ref_lo[2][name], factor=3.0)


@pytest.mark.parametrize("backend", _cpu_backends())
def test_padding_content_does_not_matter(backend):
    """Real tokens never attend to the padding segment: other pad ids, same real logits and loss."""
    feats = _features([9, 4, 11])
    model = _model(backend, torch.float32)
    runs = [
        _run(model, PackingCollator(pad_to_buckets=(40,), max_documents=4, pad_token_id=p)(feats))
        for p in (0, 50, PAD_ID)
    ]
    for loss, logits, grads in runs[1:]:
        assert torch.equal(loss, runs[0][0])
        assert torch.equal(logits[:, :24], runs[0][1][:, :24])
        for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            torch.testing.assert_close(grads[name], runs[0][2][name], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- zero-length documents


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", hf_varlen.available_backends())
def test_backends_accept_zero_length_documents(backend):
    """cu_seqlens with repeated offsets (empty documents) in the middle and at the end give the
    output of the same batch without them, forward and backward (numerics rule against the
    reference on the plain offsets; on CUDA when the backend runs there)."""
    spec = get_spec(backend)
    device = "cuda" if torch.cuda.is_available() and "cuda" in spec.devices else "cpu"
    dtype = torch.float32 if torch.float32 in spec.dtypes else torch.bfloat16
    hi = torch.float64 if dtype == torch.float32 else torch.float32
    grad = spec.backward_devices is None or device in spec.backward_devices
    torch.manual_seed(0)
    qkv = [torch.randn(20, 2, 64, device=device, dtype=hi) for _ in range(3)]
    plain = torch.tensor([0, 6, 13, 20], dtype=torch.int32, device=device)
    padded = torch.tensor([0, 6, 6, 13, 20, 20, 20], dtype=torch.int32, device=device)

    def run(dtype, cu, name):
        q, k, v = (x.to(dtype).requires_grad_(grad) for x in qkv)
        out = hf_varlen.varlen_attention(q, k, v, cu, cu, 7, 7, backend=name)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v)) if grad else ()
        return out, grads

    ref_hi, ref_lo = run(hi, plain, "reference"), run(dtype, plain, "reference")
    out, grads = run(dtype, padded, backend)
    assert_numerics("out", out, ref_hi[0], ref_lo[0])
    for name, g, g_hi, g_lo in zip("qkv"[: len(grads)], grads, ref_hi[1], ref_lo[1], strict=True):
        assert_numerics(f"d{name}", g, g_hi, g_lo, factor=3.0)
