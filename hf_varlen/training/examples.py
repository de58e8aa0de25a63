"""Examples: records rendered in their format, tokenized, prompt-masked and truncated.

Records -> examples. One record becomes ``input_ids`` (n,) and ``labels`` (n,) with

    alpaca:  prompt = "### Instruction:\\n{instruction}\\n\\n[### Input:\\n{input}\\n\\n]### Response:\\n"
             ids    = tok(prompt) + tok(output) + [eos]        (also accepts prompt / completion)
    chat:    ids    = tok.apply_chat_template(messages); the tokens of every assistant turn are the
             difference between the rendering up to that turn and the prompt before it
    text:    ids    = tok(text) + [eos]
    labels   = ids where trained, -100 elsewhere (prompt tokens when completion_only)

then truncation to ``max_length``. Examples left with no label token after the first position are
dropped (counted and logged): they carry no loss and would only cost compute.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ops.common import IGNORE_INDEX
from .options import DataOptions

logger = logging.getLogger("hf_varlen.training")

ALPACA_FIELDS = (("instruction", "output"), ("prompt", "completion"))


def alpaca_fields(rec: dict[str, Any]) -> tuple[str, ...] | None:
    """The alpaca field pair a record uses (instruction/output first), or None."""
    return next((pair for pair in ALPACA_FIELDS if all(k in rec for k in pair)), None)


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
    if alpaca_fields(rec)[0] == "instruction":
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
