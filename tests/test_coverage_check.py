"""The eager coverage check of collator offsets (``hf_varlen.coverage``): synchronous for the first
batch, deferred (read back without a host sync) afterwards, and never inside a CUDA graph capture.

The deferred path runs on CUDA only; here it is switched on for CPU tensors too
(``coverage.DEFER_DEVICES``), where a copy has always landed, so the bookkeeping is what is tested:
which batch's check is read when, what is raised and when, and that ``hf-varlen train`` reads the
pending checks every step before the optimizer step.
"""

from __future__ import annotations

import pytest
import torch
from tiny_packed import collator_batch, tiny_llama

from hf_varlen import coverage, metadata


@pytest.fixture
def deferred(monkeypatch):
    """Deferred checks on CPU tensors, from a fresh process state."""
    monkeypatch.setattr(coverage, "DEFER_DEVICES", {"cpu", "cuda"})
    coverage.DEFERRED.reset()
    metadata._KWARGS_CACHE.clear()
    yield coverage.DEFERRED
    coverage.DEFERRED.reset()


def _tiny_llama():
    """Three layers on ``flex``: it keeps the offsets on the device (clamped), where the
    host-offset CPU backends (sdpa, reference) check them in full anyway."""
    return tiny_llama(backend="flex")


GOOD = ([0, 5, 12], 7)
SHORT = ([0, 5, 9], 5)  # ends at 9 of 12 tokens
SHORT_MSG = r"cu_seq_lens_q runs from 0 to 9 .* batch has 12 tokens"


@torch.no_grad()
def test_first_batch_is_checked_synchronously(deferred):
    model = _tiny_llama()
    with pytest.raises(ValueError, match=SHORT_MSG) as err:
        model(**collator_batch(*SHORT))
    assert "found" not in str(err.value)  # raised in the forward of the bad batch itself
    assert not deferred.armed


def test_a_cpu_batch_does_not_arm_the_deferred_path():
    coverage.DEFERRED.reset()
    metadata._KWARGS_CACHE.clear()
    try:
        with torch.no_grad():
            tiny_llama(backend="flex")(**collator_batch(*GOOD))  # CPU: synchronous, not deferred
        assert not coverage.DEFERRED.armed  # the first CUDA batch will still be checked at once
    finally:
        coverage.DEFERRED.reset()


@torch.no_grad()
def test_later_batches_are_deferred_and_raise_at_the_next_batch(deferred):
    model = _tiny_llama()
    model(**collator_batch(*GOOD))  # synchronous: arms the deferred path
    assert deferred.armed and not deferred.pending
    out = model(
        **collator_batch(*SHORT)
    )  # deferred: runs (offsets clamped on the device), no raise
    assert out.logits.shape == (1, 12, 50) and torch.isfinite(out.logits).all()
    assert len(deferred.pending) == 1
    with pytest.raises(ValueError, match=SHORT_MSG + r".*found 1 batch\(es\) after"):
        model(**collator_batch(*GOOD))
    assert not deferred.pending  # cleared after the error
    model(**collator_batch(*GOOD))  # and the next good batch runs


@torch.no_grad()
def test_check_pending_offsets_reads_them_now(deferred):
    import hf_varlen

    model = _tiny_llama()
    model(**collator_batch(*GOOD))
    model(**collator_batch(*GOOD))
    hf_varlen.check_pending_offsets()  # good: nothing raised, nothing left
    assert not deferred.pending
    model(**collator_batch([0, 5, 12], 4))  # max_length 4 for a 7-token document
    with pytest.raises(ValueError, match="max_length_q is 4 but cu_seq_lens_q holds a 7-token"):
        hf_varlen.check_pending_offsets()


@torch.no_grad()
def test_one_check_per_batch_not_per_layer(deferred, monkeypatch):
    submitted = []
    real = deferred.submit
    monkeypatch.setattr(deferred, "submit", lambda *a: submitted.append(1) or real(*a))
    model = _tiny_llama()  # three layers
    model(**collator_batch(*GOOD))
    model(**collator_batch(*GOOD))
    model(**collator_batch(*GOOD))
    assert submitted == [1, 1]  # the first batch is the synchronous check


def test_tensor_max_lengths_stay_synchronous(deferred):
    model = _tiny_llama()
    with torch.no_grad():
        model(**collator_batch(*GOOD))
        bad = collator_batch(*SHORT)
        bad["max_length_q"] = bad["max_length_k"] = torch.tensor(5)  # read in the same sync
        with pytest.raises(ValueError, match=SHORT_MSG) as err:
            model(**bad)
    assert "found" not in str(err.value) and not deferred.pending


def test_unread_checks_are_bounded(deferred, monkeypatch):
    class Late:  # an event whose copy never lands on its own
        def query(self):
            return False

        def synchronize(self):
            pass

    cu = torch.tensor(GOOD[0], dtype=torch.int32)
    deferred.armed = True
    for _ in range(5):
        deferred.submit(cu, cu, 7, 7, 12, 12)
        for item in deferred.pending:
            item.event = Late()
    assert len(deferred.pending) == deferred.depth + 1  # the older ones were read (blocking)


def test_packed_trainer_reads_pending_checks_every_step(tmp_path, monkeypatch):
    from hf_varlen.training import PackedTrainer, TrainConfig, loop

    calls = []
    monkeypatch.setattr(loop, "check_pending_offsets", lambda: calls.append(1))
    cfg = TrainConfig(
        output_dir=str(tmp_path / "run"),
        builtin_examples=32,
        max_length=128,
        tokens_per_batch=384,
        max_steps=3,
        progress=False,
        save_final=False,
    )
    PackedTrainer(cfg).run()
    assert calls == [1, 1, 1]
