"""PackingCollator: a list of tokenized examples -> one padding-free packed row.

Output-compatible with transformers' ``DataCollatorWithFlattening`` (same keys, dtypes and values on
the same features), plus tail padding to a multiple, per-example truncation and empty-example
skipping. Unmodified HF models forward ``cu_seq_lens_q/k`` and ``max_length_q/k`` to the attention
function, so ``attn_implementation="varlen_packed"`` attends only within each document.

Math. Documents ``d_0 .. d_{n-1}`` with lengths ``L_i`` (after truncation to ``max_length``; empty
examples are dropped), ``cu_i = L_0 + ... + L_{i-1}``, ``T_real = cu_n``:

    input_ids[cu_i + j]    = d_i[j]
    labels[cu_i]           = separator_id          (default -100: no cross-document target)
    labels[cu_i + j]       = labels_i[j]  (or d_i[j] when the example has no labels),  j >= 1
    position_ids[cu_i + j] = position_ids_start + j
    seq_idx[cu_i + j]      = i
    cu_seq_lens            = [cu_0, cu_1, ..., cu_n],  max_length = max_i L_i

Worked example: lengths 5, 3, 7 -> cu_seq_lens [0, 5, 8, 15], max_length 7,
position_ids [0 1 2 3 4 0 1 2 0 1 2 3 4 5 6].

Padding (``pad_to_multiple_of=m``, ``P = (-T_real) mod m``; ``P = m`` when ``T_real == 0``): the
``P`` pad tokens form one extra trailing segment, ``cu_seq_lens += [T_real + P]``, with input
``pad_token_id``, labels -100 on every pad token, positions ``position_ids_start + arange(P)`` and
``seq_idx = n``. Attention therefore treats the padding as its own causal document (real tokens
never attend to it) and the loss never counts it. ``max_length`` includes the pad segment, so it is
always >= the longest segment, as varlen kernels require. An empty batch (no features, or only
empty ones) is padded to one full multiple so a data-parallel rank can still run a zero-label step.

Shape legend: T = total tokens (real + pad), S = segments (documents, + 1 when padded).

    input_ids, labels, position_ids : [1, T] int64
    seq_idx                         : [1, T] int32
    cu_seq_lens_q, cu_seq_lens_k    : [S + 1] int32 (equal values, separate tensors)
    max_length_q, max_length_k      : Python int

Counters. A collator is called once per batch and must not add keys that a model would receive as
unexpected kwargs, so what it drops is counted on the instance: ``num_skipped_empty``,
``num_truncated``, ``num_truncated_tokens``. Under a ``DataLoader`` with ``num_workers > 0`` each
worker updates its own copy; ``hf_varlen.pack_by_tokens`` reports the same counts up front.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["PackingCollator"]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


def _as_int_array(value: Any, key: str, index: int) -> np.ndarray:
    """One example's ``input_ids`` / ``labels`` (list, numpy or torch) -> 1-D int64 numpy array."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(
                f"features[{index}][{key!r}]: expected an integer tensor, got dtype {value.dtype}"
            )
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif arr.dtype.kind not in "iu":
            raise TypeError(
                f"features[{index}][{key!r}]: expected integer token ids, got dtype {arr.dtype}"
            )
    if arr.ndim != 1:
        raise ValueError(
            f"features[{index}][{key!r}]: expected a 1-D sequence, got shape {tuple(arr.shape)}"
        )
    return arr.astype(np.int64, copy=False)


def _check_int(name: str, value: Any, minimum: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")


class PackingCollator:
    """Flatten a list of examples into one packed ``[1, T]`` row with varlen attention metadata.

    Args:
        return_position_ids: emit ``position_ids``, restarting at ``position_ids_start`` per
            document.
        separator_id: label of each document's first token (default -100, ignored by the loss).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (int).
            Default True (transformers: False), so ``varlen_packed`` needs no host sync.
        return_seq_idx: emit ``seq_idx`` (int32 ``[1, T]``, document index of each token).
        position_ids_start: first position of every document (RoBERTa-like models use
            ``padding_idx + 1``).
        pad_to_multiple_of: pad the tail to a multiple of this many tokens as one separate segment
            (see the module docstring). ``None``: no padding.
        pad_token_id: input id of pad tokens.
        max_length: truncate each example (and its labels) to this many tokens. ``None``: keep all.
        return_tensors: ``"pt"`` (torch) or ``"np"`` (numpy).

    Features are mappings with ``input_ids`` and optionally ``labels`` (same length), each a list,
    numpy array or torch tensor of integers; other keys are ignored. Either every feature has
    ``labels`` or none does. Empty examples are skipped and counted in ``num_skipped_empty``.
    """

    def __init__(
        self,
        *,
        return_position_ids: bool = True,
        separator_id: int = IGNORE_INDEX,
        return_flash_attn_kwargs: bool = True,
        return_seq_idx: bool = False,
        position_ids_start: int = 0,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int = 0,
        max_length: int | None = None,
        return_tensors: str = "pt",
    ):
        _check_int("separator_id", separator_id)
        _check_int("position_ids_start", position_ids_start, minimum=0)
        _check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1, allow_none=True)
        _check_int("pad_token_id", pad_token_id)
        _check_int("max_length", max_length, minimum=1, allow_none=True)
        self._check_return_tensors(return_tensors)
        self.return_position_ids = bool(return_position_ids)
        self.separator_id = int(separator_id)
        self.return_flash_attn_kwargs = bool(return_flash_attn_kwargs)
        self.return_seq_idx = bool(return_seq_idx)
        self.position_ids_start = int(position_ids_start)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = int(pad_token_id)
        self.max_length = max_length
        self.return_tensors = return_tensors
        self.num_skipped_empty = 0
        self.num_truncated = 0
        self.num_truncated_tokens = 0

    @staticmethod
    def _check_return_tensors(return_tensors: str) -> None:
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors: expected 'pt' or 'np', got {return_tensors!r}")

    def __repr__(self) -> str:
        return (
            f"PackingCollator(separator_id={self.separator_id}, "
            f"return_flash_attn_kwargs={self.return_flash_attn_kwargs}, "
            f"return_seq_idx={self.return_seq_idx}, pad_to_multiple_of={self.pad_to_multiple_of}, "
            f"max_length={self.max_length})"
        )

    def _documents(self, features: Sequence[Mapping[str, Any]]):
        """Validated, truncated, non-empty (input_ids, labels | None) pairs, in feature order."""
        if not isinstance(features, Sequence) or isinstance(features, (str, bytes, Mapping)):
            raise TypeError(f"features: expected a list of mappings, got {type(features).__name__}")
        has_labels = None
        docs = []
        for i, feature in enumerate(features):
            if not isinstance(feature, Mapping) or "input_ids" not in feature:
                raise TypeError(
                    f"features[{i}]: expected a mapping with 'input_ids', got "
                    f"{type(feature).__name__}"
                    + (f" with keys {sorted(feature)}" if isinstance(feature, Mapping) else "")
                )
            this_has_labels = feature.get("labels") is not None
            if has_labels is None:
                has_labels = this_has_labels
            elif this_has_labels != has_labels:
                raise ValueError(
                    f"features[{i}]: 'labels' is {'present' if this_has_labels else 'missing'} "
                    f"but was {'present' if has_labels else 'missing'} in features[0]; "
                    "give labels for every example or for none"
                )
            ids = _as_int_array(feature["input_ids"], "input_ids", i)
            labels = None
            if this_has_labels:
                labels = _as_int_array(feature["labels"], "labels", i)
                if labels.shape != ids.shape:
                    raise ValueError(
                        f"features[{i}]['labels']: expected length {ids.shape[0]} (as input_ids), "
                        f"got {labels.shape[0]}"
                    )
            if ids.shape[0] == 0:
                if self.num_skipped_empty == 0:
                    logger.warning("PackingCollator: skipping empty example (features[%d])", i)
                self.num_skipped_empty += 1
                continue
            if self.max_length is not None and ids.shape[0] > self.max_length:
                self.num_truncated += 1
                self.num_truncated_tokens += ids.shape[0] - self.max_length
                ids = ids[: self.max_length]
                labels = None if labels is None else labels[: self.max_length]
            docs.append((ids, labels))
        return docs

    def __call__(
        self,
        features: Sequence[Mapping[str, Any]],
        return_tensors: str | None = None,
        separator_id: int | None = None,
    ) -> dict[str, Any]:
        return_tensors = self.return_tensors if return_tensors is None else return_tensors
        self._check_return_tensors(return_tensors)
        if separator_id is None:
            separator_id = self.separator_id
        _check_int("separator_id", separator_id)

        docs = self._documents(features)
        lengths = np.fromiter((ids.shape[0] for ids, _ in docs), dtype=np.int64, count=len(docs))
        real = int(lengths.sum())
        pad = 0
        if self.pad_to_multiple_of is not None:
            pad = -real % self.pad_to_multiple_of
            if real == 0:
                pad = self.pad_to_multiple_of
        seg_lengths = np.append(lengths, pad) if pad else lengths
        starts = np.zeros(len(seg_lengths), dtype=np.int64)
        np.cumsum(seg_lengths[:-1], out=starts[1:])
        total = real + pad
        if total >= 2**31:
            raise ValueError(f"features: packed length {total} does not fit int32 cu_seq_lens")

        input_ids = np.full(total, self.pad_token_id, dtype=np.int64)
        labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
        if docs:
            input_ids[:real] = np.concatenate([ids for ids, _ in docs])
            labels[:real] = (
                input_ids[:real] if docs[0][1] is None else np.concatenate([lab for _, lab in docs])
            )
            labels[starts[: len(docs)]] = separator_id

        batch: dict[str, Any] = {"input_ids": input_ids[None], "labels": labels[None]}
        if self.return_position_ids:
            seg_starts = np.repeat(starts, seg_lengths)
            positions = np.arange(total, dtype=np.int64) - seg_starts + self.position_ids_start
            batch["position_ids"] = positions[None]
        if self.return_seq_idx:
            seq_idx = np.repeat(np.arange(len(seg_lengths), dtype=np.int32), seg_lengths)
            batch["seq_idx"] = seq_idx[None]
        if self.return_flash_attn_kwargs:
            cu = np.append(starts, total).astype(np.int32) if len(starts) else np.zeros(1, np.int32)
            batch["cu_seq_lens_q"] = cu
            batch["cu_seq_lens_k"] = cu.copy()
            max_len = int(seg_lengths.max()) if len(seg_lengths) else 0
            batch["max_length_q"] = batch["max_length_k"] = max_len

        if return_tensors == "pt":
            batch = {
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()
            }
        return batch
