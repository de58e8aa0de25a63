"""PackingCollator: a batch of tokenized examples -> one padding-free packed row.

A drop-in for transformers' ``DataCollatorWithFlattening`` (same arguments, keys, dtypes and
values on the same features; the differences are listed in one place, the class docstring), plus
tail padding to a multiple, per-example truncation, empty-example skipping and columnar input.
Unmodified HF models forward ``cu_seq_lens_q/k`` and ``max_length_q/k`` to the attention
function, so ``attn_implementation="varlen_packed"`` attends only within each document.

Math. Documents ``d_0 .. d_{n-1}`` with lengths ``L_i`` (after dropping ``attention_mask == 0``
tokens and truncating to ``max_length``; empty examples are dropped),
``cu_i = L_0 + ... + L_{i-1}``, ``T_real = cu_n``:

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
``pad_token_id``, labels -100 on every pad token, positions ``position_ids_start + arange(P) mod
max(max_i L_i, 1)`` (they wrap at the longest real document, so the padding never uses a position
the real tokens do not: a learned position table is never indexed past its end, and a RoPE scaling
that follows the largest position id, e.g. dynamic NTK, sees the unpadded batch's) and ``seq_idx =
n``. Attention therefore treats the padding as its own causal document (real tokens never attend
to it) and the loss never counts it, whatever the model's position range. ``max_length`` includes the pad segment, so it is
always >= the longest segment, as varlen kernels require. With padding, a batch without tokens
(no examples, or only empty ones) becomes one full multiple of padding, so a data-parallel rank
can still run a zero-label step; without padding it is a ``ValueError`` (a ``[1, 0]`` row cannot
run through a model).

Static shapes (CUDA graphs, ``torch.compile`` without recompiles). ``pad_to_buckets=ladder``
pads to the first bucket ``>= T_real`` instead (``P = bucket - T_real``, the smallest bucket when
``T_real == 0``; a batch longer than the largest bucket is a ``ValueError``), so a run sees only
the ladder's lengths (``hf_varlen.bucket_ladder``: < 5 % extra tokens on alpaca). ``max_documents
= M`` fixes ``cu_seq_lens`` at ``M + 1`` entries, ``M + 2`` with padding (one slot for the pad
segment, present with ``P = 0`` too): the slots after the last segment repeat the total ``T``,
i.e. zero-length documents, which every backend skips. A batch of more than ``M`` documents is a
``ValueError`` naming ``max_documents`` (never truncated); ``TokenBudgetBatchSampler(...,
max_documents=M)`` builds no such batch. Worked example: lengths 5, 3, 7, buckets (16, 24),
``M = 4`` -> ``T = 16``, ``cu_seq_lens [0, 5, 8, 15, 16, 16]``, ``max_length 7``.

Real tokens: ``T - P`` (``real_tokens`` with ``return_real_tokens=True``). Pad tokens have
labels -100, so a loss normalised by the label count (``num_items_in_batch``) and its gradients
are those of the unpadded batch; count tokens/s and MFU from real tokens, not ``input_ids.numel()``.

Shape legend: T = total tokens (real + pad), S = segments (documents, + 1 when padded).

    input_ids, labels, position_ids : [1, T] int64
    seq_idx                         : [1, T] int32
    cu_seq_lens_q, cu_seq_lens_k    : [S + 1] int32 (equal values, separate tensors); with
                                      max_documents, S = max_documents (+ 1 with padding)
    max_length_q, max_length_k      : Python int
    real_tokens                     : Python int (only with return_real_tokens)

Counters. A collator is called once per batch and must not add keys that a model would receive as
unexpected kwargs, so what it drops is counted on the instance: ``num_skipped_empty``,
``num_truncated``, ``num_truncated_tokens``. Under a ``DataLoader`` with ``num_workers > 0`` each
worker updates its own copy; ``hf_varlen.pack_by_tokens`` reports the same counts up front.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from numbers import Integral
from typing import Any

import numpy as np
import torch
from transformers.data.data_collator import DefaultDataCollator

from .ops.common import IGNORE_INDEX, check_int
from .packing import bucket_ladder

__all__ = ["PackingCollator"]

logger = logging.getLogger(__name__)

_RETURN_TENSORS = ("pt", "np")
_ROW_KEYS = ("input_ids", "labels", "attention_mask")


def _as_int_array(value: Any, where: str, allow_bool: bool = False) -> np.ndarray:
    """One example's ``input_ids`` / ``labels`` / ``attention_mask`` -> 1-D int64 numpy array."""
    if isinstance(value, torch.Tensor):
        if (
            value.dtype.is_floating_point
            or value.dtype.is_complex
            or (value.dtype == torch.bool and not allow_bool)
        ):
            raise TypeError(f"{where}: expected an integer tensor, got dtype {value.dtype}")
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif arr.dtype.kind not in ("iub" if allow_bool else "iu"):
            raise TypeError(f"{where}: expected integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{where}: expected a 1-D sequence, got shape {tuple(arr.shape)}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        # int64 would wrap such an id to a negative one, silently
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise ValueError(
            f"{where}: token id {int(arr[i])} at index {i} does not fit int64 (the dtype of "
            "input_ids and labels); token ids are below the vocabulary size"
        )
    return arr.astype(np.int64, copy=False)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, Integral) or (
        isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0
    )


def _row_name(i: int):
    """Error-message names in a list of examples: features[i], features[i]['key']."""
    return lambda key=None: f"features[{i}]" + ("" if key is None else f"[{key!r}]")


def _column_name(i: int):
    """Error-message names in a mapping of columns: features[...][i], features['key'][i]."""
    return lambda key=None: f"features[{'...' if key is None else repr(key)}][{i}]"


def _column_rows(column: Any, label: str) -> Sequence[Any]:
    """A column of a mapping batch (list of rows, 2-D tensor or array) -> one entry per example."""
    if isinstance(column, (torch.Tensor, np.ndarray)):
        if column.ndim == 2:
            return list(column)
        flat = column.ndim == 1
    elif isinstance(column, Sequence) and not isinstance(column, (str, bytes)):
        flat = len(column) > 0 and _is_scalar(column[0])
        if not flat:
            return column
    else:
        raise TypeError(
            f"{label}: expected one row per example (a list of token-id lists, or a 2-D "
            f"tensor / array), got {type(column).__name__}"
        )
    shape = tuple(column.shape) if hasattr(column, "shape") else (len(column),)
    raise TypeError(
        "features: expected a list of examples or a mapping of columns with one row per example; "
        f"{label} is {'a flat sequence' if flat else 'an array'} of shape {shape}. "
        "For a single example pass [example]; for a padded batch pass 2-D input_ids with its "
        "attention_mask"
    )


def _check_buckets(buckets: Any) -> tuple[int, ...]:
    """``pad_to_buckets`` -> ascending tuple of distinct ints >= 1 (an int N: bucket_ladder(N))."""
    if isinstance(buckets, Integral) and not isinstance(buckets, bool):
        return bucket_ladder(check_int("pad_to_buckets", buckets, 1))
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (Sequence, np.ndarray)):
        raise TypeError(
            "pad_to_buckets: expected a sequence of token counts or an int token budget, got "
            f"{type(buckets).__name__}"
        )
    values = [check_int(f"pad_to_buckets[{i}]", b, 1) for i, b in enumerate(buckets)]
    if not values:
        raise ValueError("pad_to_buckets: expected at least one bucket, got an empty sequence")
    if len(set(values)) != len(values):
        twice = sorted({b for b in values if values.count(b) > 1})
        raise ValueError(f"pad_to_buckets: expected distinct buckets, got {twice} more than once")
    return tuple(sorted(values))


@dataclass
class PackingCollator(DefaultDataCollator):
    """Flatten a batch of examples into one packed ``[1, T]`` row with varlen attention metadata.

    A drop-in for ``transformers.DataCollatorWithFlattening``: it takes the same arguments (the
    first, ``return_tensors``, also positionally: ``PackingCollator("np")``), is a
    ``DefaultDataCollator`` dataclass like it, and ``__call__(features, return_tensors=None,
    separator_id=None)`` has the same signature and per-call overrides.

    Args:
        return_tensors: ``"pt"`` (torch) or ``"np"`` (numpy).
        return_position_ids: emit ``position_ids``, restarting at ``position_ids_start`` per
            document.
        separator_id: label of each document's first token (default -100, ignored by the loss).
        return_flash_attn_kwargs: emit ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (int).
        return_seq_idx: emit ``seq_idx`` (int32 ``[1, T]``, document index of each token).
        position_ids_start: first position of every document (RoBERTa-like models use
            ``padding_idx + 1``).
        pad_to_multiple_of: pad the tail to a multiple of this many tokens as one separate segment
            (see the module docstring). ``None``: no padding.
        pad_to_buckets: pad the tail to the first of these lengths that holds the batch (one
            separate segment, as ``pad_to_multiple_of``, which it replaces): a sequence of
            distinct ints (any order), or an int ``N`` for ``bucket_ladder(N)``, the default
            ladder up to a token budget ``N``. ``None``: no buckets.
        max_documents: ``cu_seq_lens`` gets a fixed ``max_documents + 1`` entries (``+ 2`` with
            padding), unused ones zero-length documents; more documents raise ``ValueError``.
            ``None``: one entry per segment.
        return_real_tokens: also return ``real_tokens`` (a Python int: tokens that are
            not padding). Off by default because a model called with ``**batch`` would receive
            it; pop it before the forward.
        pad_token_id: input id of pad tokens (only used with ``pad_to_multiple_of`` /
            ``pad_to_buckets``).
        max_length: truncate each example (and its labels) to this many tokens. ``None``: keep all.
            With ``TokenBudgetBatchSampler`` / ``pack_by_tokens`` use ``max_length=max_tokens``, so
            the examples they count as ``max_tokens`` long are cut to exactly that.

    Input (``features``), any of:
        - a list of mappings (one per example) with ``input_ids`` and optionally ``labels`` and
          ``attention_mask``, each a list, numpy array or torch tensor of integers;
        - a mapping of columns, e.g. a tokenizer's ``BatchEncoding`` or a ``datasets`` batch:
          ``{"input_ids": rows, "labels": rows, "attention_mask": rows}`` where ``rows`` is a list
          of per-example sequences or a 2-D tensor / array (``PackingCollator()(tokenizer(texts))``
          and ``tokenizer(texts, padding=True, return_tensors="pt")`` both work);
        - a 2-D tensor or numpy array of ``input_ids`` (one row per example, no padding).
        ``labels`` has the length of ``input_ids``; either every example has labels or none does
        (``labels=None`` counts as none). Other keys (``token_type_ids``, ...) are not used.

    Differences from ``DataCollatorWithFlattening`` (everything else is identical, and tested so):
        - ``return_flash_attn_kwargs`` defaults to True (transformers: False), so the attention
          gets the document offsets without a host sync to derive them from ``position_ids``.
          ``PackingCollator(return_flash_attn_kwargs=False)`` returns exactly transformers' keys.
        - Empty examples are dropped and counted in ``num_skipped_empty`` (transformers gives each
          an extra label with no token, so ``labels`` no longer lines up with ``input_ids``).
        - A batch with no token at all raises ``ValueError`` (transformers returns a ``[1, 0]``
          row that fails deep inside the model), unless ``pad_to_multiple_of`` or
          ``pad_to_buckets`` is set.
        - ``attention_mask == 0`` tokens are padding and are dropped (transformers packs them as
          real tokens); a mapping of columns or a 2-D tensor is accepted (transformers needs a
          list of mappings).
        - Features are validated: integer ids, 1-D, labels as long as input_ids, labels for all
          examples or none; a bad one raises naming it.
        - Extras, off by default: ``pad_to_multiple_of`` / ``pad_to_buckets`` / ``pad_token_id``,
          ``max_documents``, ``return_real_tokens`` and ``max_length``.

    Example:
        >>> collator = PackingCollator()
        >>> batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
        >>> batch["input_ids"], batch["labels"], batch["position_ids"]
        (tensor([[1, 2, 3, 4, 5]]), tensor([[-100,    2,    3, -100,    5]]), tensor([[0, 1, 2, 0, 1]]))
        >>> batch["cu_seq_lens_q"], batch["max_length_q"]
        (tensor([0, 3, 5], dtype=torch.int32), 3)
        >>> padded = {"input_ids": [[1, 2, 3], [4, 5, 0]], "attention_mask": [[1, 1, 1], [1, 1, 0]]}
        >>> collator(padded)["input_ids"]
        tensor([[1, 2, 3, 4, 5]])
        >>> PackingCollator("np", pad_to_multiple_of=4)(padded)["cu_seq_lens_q"]
        array([0, 3, 5, 8], dtype=int32)
        >>> static = PackingCollator(pad_to_buckets=(4, 8), max_documents=3)(padded)
        >>> static["input_ids"].shape, static["cu_seq_lens_q"]
        (torch.Size([1, 8]), tensor([0, 3, 5, 8, 8], dtype=torch.int32))
    """

    # ``return_tensors: str = "pt"`` is DefaultDataCollator's field: the one positional argument.
    _: KW_ONLY
    return_position_ids: bool = True
    separator_id: int = IGNORE_INDEX
    return_flash_attn_kwargs: bool = True
    return_seq_idx: bool = False
    position_ids_start: int = 0
    pad_to_multiple_of: int | None = None
    pad_token_id: int = 0
    max_length: int | None = None
    pad_to_buckets: Sequence[int] | int | None = None
    max_documents: int | None = None
    return_real_tokens: bool = False
    num_skipped_empty: int = field(default=0, init=False, repr=False, compare=False)
    num_truncated: int = field(default=0, init=False, repr=False, compare=False)
    num_truncated_tokens: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_return_tensors(self.return_tensors)
        self.separator_id = check_int("separator_id", self.separator_id, minimum=None)
        self.position_ids_start = check_int("position_ids_start", self.position_ids_start, 0)
        self.pad_to_multiple_of = check_int(
            "pad_to_multiple_of", self.pad_to_multiple_of, 1, allow_none=True
        )
        self.pad_token_id = check_int("pad_token_id", self.pad_token_id, 0)
        self.max_length = check_int("max_length", self.max_length, 1, allow_none=True)
        self.return_position_ids = bool(self.return_position_ids)
        self.return_flash_attn_kwargs = bool(self.return_flash_attn_kwargs)
        self.return_seq_idx = bool(self.return_seq_idx)
        self.return_real_tokens = bool(self.return_real_tokens)
        self.max_documents = check_int("max_documents", self.max_documents, 1, allow_none=True)
        if self.pad_to_buckets is not None:
            if self.pad_to_multiple_of is not None:
                raise ValueError(
                    "pad_to_buckets and pad_to_multiple_of both set the padded length; give one "
                    "of them (a ladder of multiples: bucket_ladder(N, steps_per_doubling=None))"
                )
            self.pad_to_buckets = _check_buckets(self.pad_to_buckets)

    @staticmethod
    def _check_return_tensors(return_tensors: Any) -> None:
        if return_tensors not in _RETURN_TENSORS:
            raise ValueError(f"return_tensors: expected 'pt' or 'np', got {return_tensors!r}")

    @staticmethod
    def _raw_examples(features: Any) -> list[tuple[Any, Mapping[str, Any]]]:
        """(error-message name of a key, {input_ids, labels?, attention_mask?}) per example."""
        if isinstance(features, (torch.Tensor, np.ndarray)):
            rows = _column_rows(features, "features")
            return [(_row_name(i), {"input_ids": row}) for i, row in enumerate(rows)]
        if isinstance(features, Mapping):
            if "input_ids" not in features:
                raise TypeError(
                    f"features: a mapping of columns needs 'input_ids', got keys {sorted(features)}"
                )
            columns = {
                key: _column_rows(features[key], f"features[{key!r}]")
                for key in _ROW_KEYS
                if features.get(key) is not None
            }
            n = len(columns["input_ids"])
            for key, rows in columns.items():
                if len(rows) != n:
                    raise ValueError(
                        f"features[{key!r}]: expected {n} rows (as 'input_ids'), got {len(rows)}"
                    )
            return [
                (_column_name(i), {key: rows[i] for key, rows in columns.items()}) for i in range(n)
            ]
        if not isinstance(features, Sequence) or isinstance(features, (str, bytes)):
            raise TypeError(
                "features: expected a list of mappings, a mapping of columns or a 2-D tensor, got "
                f"{type(features).__name__}"
            )
        out = []
        for i, feature in enumerate(features):
            if not isinstance(feature, Mapping) or "input_ids" not in feature:
                hint = (
                    f" with keys {sorted(feature)}"
                    if isinstance(feature, Mapping)
                    else "; for bare token-id rows pass {'input_ids': rows}"
                )
                raise TypeError(
                    f"features[{i}]: expected a mapping with 'input_ids', got "
                    f"{type(feature).__name__}{hint}"
                )
            out.append((_row_name(i), feature))
        return out

    def _documents(self, features: Any) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Validated, unpadded, truncated, non-empty (input_ids, labels | None), in input order."""
        has_labels = None
        docs = []
        for name, feature in self._raw_examples(features):
            this_has_labels = feature.get("labels") is not None
            if has_labels is None:
                has_labels = this_has_labels
            elif this_has_labels != has_labels:
                raise ValueError(
                    f"{name()}: 'labels' is {'present' if this_has_labels else 'missing'} "
                    f"but was {'present' if has_labels else 'missing'} in the first example; "
                    "give labels for every example or for none"
                )
            ids = _as_int_array(feature["input_ids"], name("input_ids"))
            labels = None
            if this_has_labels:
                labels = _as_int_array(feature["labels"], name("labels"))
                if labels.shape != ids.shape:
                    raise ValueError(
                        f"{name('labels')}: expected length {ids.shape[0]} (as input_ids), "
                        f"got {labels.shape[0]}"
                    )
            mask = feature.get("attention_mask")
            if mask is not None:
                mask = _as_int_array(mask, name("attention_mask"), allow_bool=True)
                if mask.shape != ids.shape:
                    raise ValueError(
                        f"{name('attention_mask')}: expected length {ids.shape[0]} (as "
                        f"input_ids), got {mask.shape[0]}"
                    )
                if mask.size and (mask.min() < 0 or mask.max() > 1):
                    raise ValueError(f"{name('attention_mask')}: expected 0/1 values")
                if not mask.all():
                    keep = mask.astype(bool)
                    ids = ids[keep]
                    labels = None if labels is None else labels[keep]
            if ids.shape[0] == 0:
                if self.num_skipped_empty == 0:
                    logger.warning("PackingCollator: skipping empty example (%s)", name())
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
        features: Any,
        return_tensors: str | None = None,
        separator_id: int | None = None,
    ) -> dict[str, Any]:
        return_tensors = self.return_tensors if return_tensors is None else return_tensors
        self._check_return_tensors(return_tensors)
        if separator_id is None:
            separator_id = self.separator_id
        separator_id = check_int("separator_id", separator_id, minimum=None)

        docs = self._documents(features)
        n_docs = len(docs)
        padding = self.pad_to_multiple_of is not None or self.pad_to_buckets is not None
        if not docs and not padding:
            raise ValueError(
                "features: the batch has no token to pack (no example, or only empty ones); a "
                "[1, 0] row cannot run through a model. Drop empty examples before batching, or "
                "set pad_to_multiple_of / pad_to_buckets to turn such a batch into one all-padding "
                "row with no label (a zero-loss step, e.g. for a data-parallel rank without data)"
            )
        if self.max_documents is not None and n_docs > self.max_documents:
            raise ValueError(
                f"features: the batch has {n_docs} documents (non-empty examples), more than "
                f"max_documents={self.max_documents}, the fixed number of cu_seq_lens slots; a "
                "document is never dropped. Raise max_documents (e.g. to the batch sampler's "
                "max_documents attribute) or build the batches with "
                f"TokenBudgetBatchSampler(..., max_documents={self.max_documents}), which splits "
                "them"
            )
        lengths = np.fromiter((ids.shape[0] for ids, _ in docs), dtype=np.int64, count=n_docs)
        real = int(lengths.sum())
        pad = 0
        if self.pad_to_multiple_of is not None:
            pad = -real % self.pad_to_multiple_of
            if real == 0:
                pad = self.pad_to_multiple_of
        elif self.pad_to_buckets is not None:
            buckets = self.pad_to_buckets
            j = bisect.bisect_left(buckets, max(real, 1))
            if j == len(buckets):
                raise ValueError(
                    f"features: the batch packs {real} tokens, more than the largest bucket "
                    f"{buckets[-1]} of pad_to_buckets; end the ladder at the batch sampler's token "
                    "budget (pad_to_buckets=max_tokens, i.e. bucket_ladder(max_tokens)) or cut "
                    "examples with max_length"
                )
            pad = buckets[j] - real
        if self.max_documents is None:
            seg_lengths = np.append(lengths, pad) if pad else lengths
        else:  # fixed slots: documents, the pad segment (even when P = 0), zero-length rest
            seg_lengths = np.zeros(self.max_documents + padding, dtype=np.int64)
            seg_lengths[:n_docs] = lengths
            if padding:
                seg_lengths[n_docs] = pad
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
            labels[starts[:n_docs]] = separator_id

        batch: dict[str, Any] = {"input_ids": input_ids[None], "labels": labels[None]}
        if self.return_position_ids:
            seg_starts = np.repeat(starts, seg_lengths)
            positions = np.arange(total, dtype=np.int64) - seg_starts
            # The pad segment's positions wrap at the longest real document, so they never pass a
            # position the real tokens use: a learned position table (GPT-2's n_positions) is never
            # indexed out of range, and what a model derives from the largest position id
            # (dynamic-NTK / longrope RoPE scale all tokens by it) is that of the unpadded batch.
            positions[real:] %= max(int(lengths.max()) if n_docs else 1, 1)
            batch["position_ids"] = (positions + self.position_ids_start)[None]
        if self.return_seq_idx:
            seq_idx = np.repeat(np.arange(len(seg_lengths), dtype=np.int32), seg_lengths)
            batch["seq_idx"] = seq_idx[None]
        if self.return_flash_attn_kwargs:
            cu = np.append(starts, total).astype(np.int32)
            batch["cu_seq_lens_q"] = cu
            batch["cu_seq_lens_k"] = cu.copy()
            batch["max_length_q"] = batch["max_length_k"] = int(seg_lengths.max())
        if self.return_real_tokens:
            batch["real_tokens"] = real

        if return_tensors == "pt":
            batch = {
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()
            }
        return batch
