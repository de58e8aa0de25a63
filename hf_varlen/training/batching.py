"""Micro-batches: index lists of examples -> model inputs and the counts the loop needs.

Batches. A ``TokenBudgetBatchSampler`` packs the examples once into micro-batches of at most
``tokens_per_batch`` tokens (or, with ``--batch-size B``, an ``ExampleCountBatchSampler`` cuts one
seeded shuffle into micro-batches of B examples) and deals them to ranks (every rank gets the same
number; ``[]`` fills the last group). Packed mode collates a micro-batch with ``PackingCollator``
into one ``[1, T]`` row; the padded baseline collates the *same* examples into a right-padded
``[B, L_max]`` batch, so both modes see identical data in identical order. An empty slot becomes a one-token dummy batch
with no label (a zero-loss forward/backward keeps data-parallel collectives matched).

Static shapes (``--static-shapes``): the packing collator pads T up to a rung of
``bucket_ladder(token budget)`` and gives ``cu_seq_lens`` the sampler's ``max_documents + 2``
entries; a dummy is then one all-padding row of the smallest rung. ``real_tokens`` and
``label_tokens`` never count the padding.

Shape legend: B examples in a micro-batch, L_max the longest of them, T = sum of their lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..ops.common import IGNORE_INDEX
from .config import TrainConfig
from .examples import Examples


@dataclass
class MicroBatch:
    """Model inputs of one micro-batch plus the counts the loop and the metrics need."""

    inputs: dict[str, Any]
    real_tokens: int  # tokens of real examples
    tensor_tokens: int  # tokens the input tensor holds (padding and dummies included)
    label_tokens: int  # targets that count in the loss (shifted labels != -100)
    attn_sq: int  # sum over documents of L^2 (attention work)
    dummy: bool = False
    padded_tokens: int = 0  # B * L_max: the same examples padded to their longest


class Batcher:
    """Index lists -> ``MicroBatch`` for the packed or the padded mode (same examples either way)."""

    def __init__(
        self,
        examples: Examples,
        cfg: TrainConfig,
        pad_token_id: int,
        max_documents: int | None = None,
    ):
        from ..collator import PackingCollator
        from ..packing import bucket_ladder

        self.examples = examples
        self.padded = cfg.padded
        self.pad_token_id = int(pad_token_id)
        # --static-shapes: T is a rung of the ladder and cu_seq_lens has max_documents + 2 entries
        # (the sampler's cap), so the model sees len(buckets) shapes at most.
        self.buckets = bucket_ladder(cfg.token_budget) if cfg.static_shapes else None
        if self.buckets is not None and max_documents is None:
            raise ValueError("Batcher: --static-shapes needs max_documents (the sampler's)")
        self.collator = PackingCollator(
            pad_to_multiple_of=cfg.pad_to_multiple_of,
            pad_to_buckets=self.buckets,
            max_documents=max_documents if self.buckets is not None else None,
            pad_token_id=self.pad_token_id,
        )
        # Dummies stay 1 token, or, with buckets, an all-padding row of the smallest one.
        self._plain = (
            self.collator
            if self.buckets is not None
            else PackingCollator(pad_token_id=self.pad_token_id)
        )

    def __call__(self, indices: Sequence[int]) -> MicroBatch:
        if not indices:
            return self.dummy()
        feats = self.examples.features(indices)
        lengths = self.examples.lengths[np.asarray(indices, dtype=np.int64)]
        real = int(lengths.sum())
        attn_sq = int((lengths**2).sum())
        if self.padded:
            inputs = self._pad(feats)
            count = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
        else:
            inputs = self.collator(feats)
            count = int((inputs["labels"] != IGNORE_INDEX).sum())
        padded = len(indices) * int(lengths.max())
        return MicroBatch(
            inputs, real, inputs["input_ids"].numel(), count, attn_sq, padded_tokens=padded
        )

    def _pad(self, feats: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in feats)
        ids = np.full((len(feats), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(feats), width), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((len(feats), width), dtype=np.int64)
        for row, f in enumerate(feats):
            n = len(f["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = f["input_ids"], f["labels"], 1
        return {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask),
            "labels": torch.from_numpy(labels),
        }

    def dummy(self) -> MicroBatch:
        """One pad token, no label: a forward/backward that adds exactly zero to every gradient."""
        one = [{"input_ids": np.array([self.pad_token_id]), "labels": np.array([IGNORE_INDEX])}]
        if self.padded:
            inputs = self._pad(one)
        else:  # with buckets: no document, the padding segment alone
            inputs = self._plain([] if self.buckets is not None else one)
        return MicroBatch(inputs, 0, inputs["input_ids"].numel(), 0, 0, dummy=True)
