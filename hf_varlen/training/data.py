"""Data: load records, render them in a format, tokenize, mask prompts, and build batches.

Records -> examples. One record becomes ``input_ids`` (n,) and ``labels`` (n,) with

    alpaca:  prompt = "### Instruction:\\n{instruction}\\n\\n[### Input:\\n{input}\\n\\n]### Response:\\n"
             ids    = tok(prompt) + tok(output) + [eos]        (also accepts prompt / completion)
    chat:    ids    = tok.apply_chat_template(messages); the tokens of every assistant turn are the
             difference between the rendering up to that turn and the prompt before it
    text:    ids    = tok(text) + [eos]
    labels   = ids where trained, -100 elsewhere (prompt tokens when completion_only)

then truncation to ``max_length``. Examples left with no label token after the first position are
dropped (counted and logged): they carry no loss and would only cost compute.

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

import codecs
import collections
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..ops.common import IGNORE_INDEX
from .builtin import builtin_records
from .config import TrainConfig
from .options import DataOptions
from .sources import dataset_access, local_or_hub

logger = logging.getLogger("hf_varlen.training")

_ALPACA_FIELDS = (("instruction", "output"), ("prompt", "completion"))


# --------------------------------------------------------------------------------------------- #
# Loading


class Records(list):
    """Loaded records plus where each came from (``origins[i]``, e.g. "data.jsonl line 12", for
    error messages) and how many bad ones ``--skip-bad-records`` dropped (``skipped``)."""

    def __init__(self, items=(), origins=None, skipped: int = 0):
        super().__init__(items)
        self.origins = list(origins) if origins is not None else [None] * len(self)
        self.skipped = skipped

    def where(self, i: int) -> str:
        return f"record {i}" + (f" ({self.origins[i]})" if self.origins[i] else "")

    def head(self, n: int) -> Records:
        return Records(self[:n], self.origins[:n], self.skipped)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only ``indices`` (in place); the rest count as skipped."""
        indices = list(indices)
        self.skipped += len(self) - len(indices)
        self.origins = [self.origins[i] for i in indices]
        self[:] = [self[i] for i in indices]


def load_records(source: str, cfg: TrainConfig, flag: str = "--dataset") -> Records:
    """``source``: 'builtin', a local .json/.jsonl/.parquet file (or a directory of them), or a
    hub dataset id (``sources.local_or_hub``: a missing path is an error, not a Hub lookup).
    Returns the records (at most ``cfg.max_examples``). A line of a JSON-lines file that is not
    valid JSON is an error naming the file and line (skipped and counted with
    ``cfg.skip_bad_records``)."""
    if source == "builtin":
        records = Records(builtin_records(cfg.builtin_examples, cfg.seed))
    else:
        path, local = local_or_hub(flag, source, data=True)
        if local:
            records = _load_local(path, cfg.skip_bad_records)
        else:
            records = Records(_load_hub(source, cfg, flag))
    if not records:
        raise ValueError(f"{flag} {source!r}: no records found")
    if cfg.max_examples is not None:
        records = records.head(cfg.max_examples)
    return records


def _load_local(path: str, skip_bad: bool = False) -> Records:
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if f.endswith((".json", ".jsonl", ".parquet"))
        )
        if not files:
            raise ValueError(f"--dataset {path!r}: directory holds no .json/.jsonl/.parquet file")
        parts = [_load_local(f, skip_bad) for f in files]
        return Records(
            [r for p in parts for r in p],
            [o for p in parts for o in p.origins],
            sum(p.skipped for p in parts),
        )
    name = os.path.basename(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return Records(rows, [f"{name} row {i}" for i in range(len(rows))])
    with open(path, "rb") as fh:
        raw = fh.read()
    raw = raw.removeprefix(codecs.BOM_UTF8)  # editors on Windows start UTF-8 files with one
    # JSON lines are split on b"\n" (and \r\n) only: a str split would also break a record at
    # U+2028 or U+0085 inside one of its strings.
    lines = raw.splitlines()
    if not path.endswith(".jsonl"):
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            first = next((ln for ln in lines if ln.strip()), b"")
            if not _is_json_object(first.decode("utf-8", "replace")):
                raise ValueError(_not_utf8(path, raw, exc.start)) from None
            data = None  # JSON lines with a .json name: per line below
        except json.JSONDecodeError as exc:
            first = next((ln for ln in lines if ln.strip()), b"")
            if not _is_json_object(first.decode("utf-8", "replace")):
                raise ValueError(
                    f"--dataset {path!r}: not valid JSON: {exc.msg} at line {exc.lineno} column "
                    f"{exc.colno}; expected a JSON list of records or JSON lines"
                ) from None
            data = None  # JSON lines with a .json name
        if isinstance(data, dict):  # {"train": [...]} or {"data": [...]}
            lists = [v for v in data.values() if isinstance(v, list)]
            data = lists[0] if len(lists) == 1 else None
        if isinstance(data, list):
            return Records(data)
    records, origins, skipped = [], [], 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if skip_bad:
                skipped += 1
                continue
            if isinstance(exc, UnicodeDecodeError):
                why = (
                    f"is not UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1}); "
                    "re-save the file as UTF-8"
                )
            else:
                why = f"is not valid JSON ({exc.msg} at column {exc.colno}); fix"
            raise ValueError(
                f"--dataset {path!r}: line {number} {why} or remove that line, or pass "
                "--skip-bad-records to skip such records (counted in the summary)"
            ) from None
        origins.append(f"{name} line {number}")
    if skipped:
        logger.warning("%s: skipped %d lines that are not valid UTF-8 JSON", path, skipped)
    return Records(records, origins, skipped)


def _not_utf8(path: str, raw: bytes, start: int) -> str:
    line = raw.count(b"\n", 0, start) + 1
    column = start - (raw.rfind(b"\n", 0, start) + 1) + 1
    return (
        f"--dataset {path!r}: line {line} is not UTF-8 (byte 0x{raw[start]:02x} at column "
        f"{column}); re-save the file as UTF-8"
    )


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _load_hub(name: str, cfg: DataOptions, flag: str = "--dataset") -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{flag} {name!r} is not a local file, so it is read from the Hugging Face Hub, "
            "which needs `datasets`: `pip install datasets` (or pass a local .json/.jsonl/.parquet)"
        ) from None
    dataset_access(flag, name)
    what = f"{flag} {name!r} is not a local file, so it is a Hugging Face Hub dataset"
    try:
        ds = datasets.load_dataset(name, cfg.dataset_config, split=cfg.dataset_split)
    except datasets.exceptions.DatasetNotFoundError:
        raise FileNotFoundError(
            f"{what}, but the Hub has no such dataset (or it is private or gated: `hf auth login`)"
            "; check the id, or pass a local .json/.jsonl/.parquet file"
        ) from None
    except ConnectionError as exc:  # HF_HUB_OFFLINE=1 and not in the datasets cache
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE=1 and it is not in the datasets cache" if offline else str(exc)
        fix = "unset HF_HUB_OFFLINE and connect to the network" if offline else "check the network"
        raise ConnectionError(
            f"{what}, but {why}: {fix}, or pass a local .json/.jsonl/.parquet file"
        ) from None
    return ds.to_list()


def _alpaca_fields(rec: dict[str, Any]) -> tuple[str, ...] | None:
    """The alpaca field pair a record uses (instruction/output first), or None."""
    return next((pair for pair in _ALPACA_FIELDS if all(k in rec for k in pair)), None)


def _bad_field(rec: dict[str, Any], fmt: str, cfg: DataOptions) -> str | None:
    """Why a record that has the needed fields cannot be used (null / non-string), or None."""

    def kind(value) -> str:
        return "null" if value is None else type(value).__name__

    if fmt == "text":
        need = [cfg.text_field]
    elif fmt == "alpaca":
        need = list(_alpaca_fields(rec))
        if need[0] == "instruction" and rec.get("input") is not None:  # input is optional
            need.append("input")
    else:
        msgs = rec[cfg.messages_field]
        if not isinstance(msgs, list):
            return (
                f"field '{cfg.messages_field}' is {kind(msgs)}, expected a list of "
                "{role, content} messages"
            )
        for j, m in enumerate(msgs):
            if not isinstance(m, dict):
                return f"field '{cfg.messages_field}'[{j}] is {kind(m)}, expected a mapping"
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    return (
                        f"field '{cfg.messages_field}'[{j}]['{key}'] is {kind(m.get(key))}, "
                        "expected a string"
                    )
                if why := _not_unicode(m[key]):
                    return f"field '{cfg.messages_field}'[{j}]['{key}'] {why}"
        return None
    for key in need:
        if not isinstance(rec[key], str):
            return f"field '{key}' is {kind(rec[key])}, expected a string"
        if why := _not_unicode(rec[key]):
            return f"field '{key}' {why}"
    return None


def _not_unicode(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate: JSON's "\\ud800" escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"holds a lone surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), "
            "not valid Unicode; fix the text (a surrogate pair needs both halves)"
        )
    return None


def _record_format(rec: Any, cfg: DataOptions) -> str | None:
    """The format one record's fields suggest (chat, then alpaca, then text), or None."""
    if not isinstance(rec, dict):
        return None
    if cfg.messages_field in rec:
        return "chat"
    if _alpaca_fields(rec) is not None:
        return "alpaca"
    return "text" if cfg.text_field in rec else None


def detect_format(records: Sequence[dict[str, Any]], cfg: DataOptions, source: str) -> str:
    """The record format to use; checks that every record has the fields it needs, as strings.

    A record that lacks a field, or has it null or not a string, is an error naming the record
    (and its file and line). With ``cfg.skip_bad_records`` such records are removed from
    ``records`` in place instead (a ``Records`` list counts them in ``records.skipped``).
    """
    where = records.where if isinstance(records, Records) else (lambda i: f"record {i}")
    first = next((r for r in records if isinstance(r, dict)), None)
    keys = set(first) if first is not None else set()
    fmt = cfg.format
    if fmt == "auto":
        # From every record, not the first: one stray record must not decide the format (and
        # with --skip-bad-records leave one usable example of sixty).
        kinds = [_record_format(r, cfg) for r in records]
        counts = collections.Counter(k for k in kinds if k is not None)
        if counts:
            fmt, n = counts.most_common(1)[0]
            if len(counts) > 1:
                odd = next(i for i, k in enumerate(kinds) if k not in (None, fmt))
                mixed = ", ".join(f"{c} {k}" for k, c in counts.most_common())
                if not cfg.skip_bad_records or 2 * n <= sum(counts.values()):
                    raise ValueError(
                        f"--dataset {source!r}: records of several formats ({mixed}); "
                        f"{where(odd)} is {kinds[odd]}, unlike the {n} {fmt} records. Fix the "
                        f"records, or pass --format {fmt} with --skip-bad-records to skip the "
                        "others"
                    )
                logger.warning(
                    "--format auto: records of several formats (%s) in %s; using %s, the "
                    "majority (--skip-bad-records skips the others; first: %s)",
                    mixed,
                    source,
                    fmt,
                    where(odd),
                )
        else:
            raise ValueError(
                f"--dataset {source!r}: cannot tell the format from the fields {sorted(keys)}; "
                f"expected '{cfg.messages_field}' (chat), instruction+output or prompt+completion "
                f"(alpaca), or '{cfg.text_field}' (text). Pass --format and --text-field / "
                "--messages-field"
            )
    need = {
        "chat": [(cfg.messages_field,)],
        "alpaca": list(_ALPACA_FIELDS),
        "text": [(cfg.text_field,)],
    }[fmt]
    good, first_bad = [], None
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            problem = f"{where(i)} is a {type(rec).__name__}, not a JSON object"
        elif not any(all(k in rec for k in opt) for opt in need):
            want = " or ".join("+".join(opt) for opt in need)
            problem = (
                f"{where(i)} lacks the fields --format {fmt} needs ({want}); it has "
                f"{sorted(rec)}. Hint: choose --format (alpaca/chat/text) or name the field with "
                "--text-field / --messages-field"
            )
        else:
            why = _bad_field(rec, fmt, cfg)
            problem = None if why is None else f"{where(i)}: {why}"
        if problem is None:
            good.append(i)
        elif not cfg.skip_bad_records:
            hint = "" if "Hint" in problem else "; fix the record or pass --skip-bad-records"
            raise ValueError(f"--dataset {source!r}: {problem}{hint}")
        elif first_bad is None:
            first_bad = problem
    if len(good) < len(records):
        if not good:
            raise ValueError(
                f"--dataset {source!r}: no usable record for --format {fmt}; first: {first_bad}"
            )
        logger.warning(
            "--skip-bad-records: skipped %d of %d records of %s (first: %s)",
            len(records) - len(good),
            len(records),
            source,
            first_bad,
        )
        if isinstance(records, Records):
            records.keep(good)
        else:
            records[:] = [records[i] for i in good]
    return fmt


# --------------------------------------------------------------------------------------------- #
# Tokenization


@dataclass
class Examples:
    """Tokenized examples: ``input_ids[i]`` and ``labels[i]`` int64 arrays of ``lengths[i]``."""

    input_ids: list[np.ndarray]
    labels: list[np.ndarray]
    lengths: np.ndarray
    dropped: int = 0
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def subset(self, idx: Sequence[int]) -> Examples:
        return Examples(
            [self.input_ids[i] for i in idx],
            [self.labels[i] for i in idx],
            self.lengths[np.asarray(idx, dtype=np.int64)] if len(idx) else np.zeros(0, np.int64),
        )

    def features(self, idx: Sequence[int]) -> list[dict[str, np.ndarray]]:
        return [{"input_ids": self.input_ids[i], "labels": self.labels[i]} for i in idx]


def _alpaca_prompt(rec: dict[str, Any]) -> tuple[str, str]:
    if _alpaca_fields(rec)[0] == "instruction":
        extra = rec.get("input") or ""
        prompt = f"### Instruction:\n{rec['instruction']}\n\n"
        if extra:
            prompt += f"### Input:\n{extra}\n\n"
        return prompt + "### Response:\n", str(rec.get("output") or "")
    return str(rec["prompt"]), str(rec["completion"])


def _encode(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=special)["input_ids"]


def _chat_example(tokenizer, messages: list[dict], completion_only: bool, index: int):
    """(ids, labels) of one conversation; assistant turns are found by prefix rendering."""

    def render(msgs, gen):
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    ids = render(messages, False)
    if not completion_only:
        return ids, list(ids)
    labels = [IGNORE_INDEX] * len(ids)
    for turn, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prefix, upto = render(messages[:turn], True), render(messages[: turn + 1], False)
        if ids[: len(prefix)] != prefix or ids[: len(upto)] != upto:
            raise ValueError(
                f"record {index}: the tokenizer's chat template does not render conversations "
                "prefix-stably, so assistant tokens cannot be located; use --no-completion-only "
                "or a template without per-turn rewriting"
            )
        labels[len(prefix) : len(upto)] = ids[len(prefix) : len(upto)]
    return ids, labels


def tokenize(records: Sequence[dict[str, Any]], fmt: str, tokenizer, cfg: DataOptions) -> Examples:
    """Render, tokenize, mask and truncate every record (see the module docstring)."""
    eos = tokenizer.eos_token_id
    pairs: list[tuple[list[int], list[int]]] = []
    if fmt == "alpaca":
        prompts, answers = zip(*(_alpaca_prompt(r) for r in records), strict=True)
        p_ids = _encode(tokenizer, list(prompts), special=True)
        a_ids = _encode(tokenizer, list(answers), special=False)
        for p, a in zip(p_ids, a_ids, strict=True):
            a = list(a) + ([eos] if eos is not None and (not a or a[-1] != eos) else [])
            ids = list(p) + a
            labels = ([IGNORE_INDEX] * len(p) + a) if cfg.completion_only else list(ids)
            pairs.append((ids, labels))
    elif fmt == "chat":
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "--format chat needs a tokenizer with a chat template; this tokenizer has none. "
                "Pass --tokenizer with a chat template or use --format alpaca/text"
            )
        for i, r in enumerate(records):
            pairs.append(_chat_example(tokenizer, r[cfg.messages_field], cfg.completion_only, i))
    else:
        texts = [str(r[cfg.text_field]) for r in records]
        for ids in _encode(tokenizer, texts, special=True):
            ids = list(ids) + ([eos] if eos is not None else [])
            pairs.append((ids, list(ids)))

    input_ids, labels, dropped, truncated = [], [], 0, 0
    for ids, lab in pairs:
        if len(ids) > cfg.max_length:
            truncated += 1
            ids, lab = ids[: cfg.max_length], lab[: cfg.max_length]
        # Position 0 is never a target (nothing precedes it), so it does not count.
        if len(ids) < 2 or all(x == IGNORE_INDEX for x in lab[1:]):
            dropped += 1
            continue
        input_ids.append(np.asarray(ids, dtype=np.int64))
        labels.append(np.asarray(lab, dtype=np.int64))
    if not input_ids:
        raise ValueError(
            f"no usable example: all {len(pairs)} have no label token within --max-length "
            f"{cfg.max_length}; raise --max-length or check --format / --completion-only"
        )
    if dropped:
        logger.warning(
            "dropped %d of %d examples with no label token after truncation to %d tokens",
            dropped,
            len(pairs),
            cfg.max_length,
        )
    lengths = np.fromiter((len(x) for x in input_ids), dtype=np.int64, count=len(input_ids))
    return Examples(input_ids, labels, lengths, dropped=dropped, truncated=truncated)


def split_eval(examples: Examples, fraction: float, seed: int) -> tuple[Examples, Examples | None]:
    """Deterministic hold-out of ``fraction`` of the examples (at least one when fraction > 0)."""
    if fraction <= 0:
        return examples, None
    perm = np.random.default_rng([seed, 1234]).permutation(len(examples))
    n_eval = max(1, int(round(fraction * len(examples))))
    if n_eval >= len(examples):
        raise ValueError(
            f"--eval-split {fraction}: leaves no training example out of {len(examples)}"
        )
    return examples.subset(np.sort(perm[n_eval:])), examples.subset(np.sort(perm[:n_eval]))


# --------------------------------------------------------------------------------------------- #
# Batches


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
