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
    from hf_varlen.training import PackedTrainer, TrainConfig, stepping

    calls = []  # read at each step's read-back (training/stepping.py)
    monkeypatch.setattr(stepping, "check_pending_offsets", lambda: calls.append(1))
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


# ---- HF Trainer: OffsetsCheckCallback ---------------------------------------------------------------


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=16):
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 9, (n,), generator=g)
        self.rows = [
            {"input_ids": torch.randint(0, 50, (int(m),), generator=g).tolist()} for m in lengths
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class _BreaksOnSecondBatch:
    """PackingCollator output whose cu_seq_lens end one token early from the second batch on."""

    def __init__(self):
        import hf_varlen

        self.inner, self.calls = hf_varlen.PackingCollator(), 0

    def __call__(self, features):
        batch = self.inner(features)
        self.calls += 1
        if self.calls >= 2:
            for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
                batch[key] = batch[key].clone()
                batch[key][-1] -= 1
        return batch


@pytest.fixture
def device_offsets_backend():
    """A CPU backend with a backward that, like the triton / FlashAttention ones, never reads the
    offsets on the host (attention output = v repeated over the query heads: the check under test
    does not depend on the attention math). CPU's trainable backends (sdpa, reference) check host
    offsets in full themselves, so they cannot show a deferred check."""
    from hf_varlen.backends import BackendSpec, registry

    def fn(q, k, v, metadata, params):
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)

    spec = BackendSpec(
        name="test_device_offsets",
        fn=fn,
        description="test only",
        requires="nothing",
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
    )
    registry.register_backend(spec)
    yield spec.name
    registry._REGISTRY.pop(spec.name, None)


def _hf_trainer(tmp_path, collator, callbacks, steps=3, backend="sdpa"):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    model = tiny_llama(backend=backend)
    return Trainer(
        model=model, args=args, train_dataset=_Rows(), data_collator=collator, callbacks=callbacks
    )


def test_offsets_check_callback_runs_before_every_optimizer_step(tmp_path, monkeypatch):
    import hf_varlen
    from hf_varlen.integrations.trainers import callbacks as trainer_callbacks

    calls = []
    monkeypatch.setattr(trainer_callbacks, "check_pending_offsets", lambda: calls.append(1))
    trainer = _hf_trainer(tmp_path, hf_varlen.PackingCollator(), [hf_varlen.OffsetsCheckCallback()])
    trainer.train()
    assert calls == [1, 1, 1]


def test_offsets_check_callback_stops_a_bad_batch_before_its_update(
    tmp_path, deferred, device_offsets_backend
):
    """Batch 1 is checked synchronously (and is good); batch 2's cu_seq_lens end early: its check
    is deferred, its forward and backward run, and the callback raises before its optimizer step,
    so the weights are still those after step 1."""
    from transformers import TrainerCallback

    import hf_varlen

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    snap = Snapshot()
    trainer = _hf_trainer(
        tmp_path,
        _BreaksOnSecondBatch(),
        [hf_varlen.OffsetsCheckCallback(), snap],
        backend=device_offsets_backend,
    )
    with pytest.raises(ValueError, match=r"cu_seq_lens_q runs from 0 to \d+ .* batch has") as info:
        trainer.train()
    assert any(entry.name == "on_pre_optimizer_step" for entry in info.traceback)  # not forward
    assert trainer.state.global_step == 1
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), snap.weights[name]), name
