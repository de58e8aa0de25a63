"""Data: load records (built-in, local files, the Hub) and find their format.

``load_records`` returns the records with where each came from; ``detect_format`` picks alpaca,
chat or text from their fields (or checks ``--format``), naming a record that does not fit.
``examples.py`` renders, tokenizes and masks them; ``batching.py`` turns index lists into
micro-batches (both re-exported here).
"""

from __future__ import annotations

import codecs
import collections
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from .batching import Batcher, MicroBatch
from .builtin import builtin_records
from .config import TrainConfig
from .examples import ALPACA_FIELDS, Examples, alpaca_fields, split_eval, tokenize
from .options import DataOptions
from .sources import dataset_access, local_or_hub

logger = logging.getLogger("hf_varlen.training")


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


def _bad_field(rec: dict[str, Any], fmt: str, cfg: DataOptions) -> str | None:
    """Why a record that has the needed fields cannot be used (null / non-string), or None."""

    def kind(value) -> str:
        return "null" if value is None else type(value).__name__

    if fmt == "text":
        need = [cfg.text_field]
    elif fmt == "alpaca":
        need = list(alpaca_fields(rec))
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
    if alpaca_fields(rec) is not None:
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
        "alpaca": list(ALPACA_FIELDS),
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


__all__ = [
    "Batcher", "Examples", "MicroBatch", "Records", "detect_format", "load_records", "split_eval",
    "tokenize",
]  # fmt: skip
