"""Choose the default bucket ladder of ``PackingCollator(pad_to_buckets=...)`` by measurement.

For each candidate ladder and each batching (``ExampleCountBatchSampler`` at 8 / 32 / 128 examples
of at most ``--max-length`` tokens, ``TokenBudgetBatchSampler`` at a ``--budget`` token budget),
every batch of one epoch is padded to its bucket, and the table reports

    extra  = (sum_b bucket(T_b) - sum_b T_b) / sum_b T_b     (padding tokens per real token)
    shapes = distinct packed lengths in the epoch / rungs of the ladder up to the top

A ladder ends at the largest packed length a batching allows (``batch_size * max_length``, or the
budget), so every batch has a bucket. A second table shows what a ``max_documents`` cap costs the
token-budget packing (more batches). The tokenization is the alpaca format of ``hf-varlen train``
(``### Instruction / ### Input / ### Response``, prompt with special tokens, answer + EOS).

    python scripts/gpu_evidence/bucket_ladder.py   # the shared alpaca, the Qwen2 tokenizer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from hf_varlen import ExampleCountBatchSampler, TokenBudgetBatchSampler, bucket_ladder

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"

# name -> (multiple, steps_per_doubling); steps None = linear multiples.
LADDERS = {
    "none (no buckets)": None,
    "linear x64": (64, None),
    "linear x128": (128, None),
    "linear x256": (256, None),
    "linear x512": (512, None),
    "powers of 2 (x64)": (64, 1),
    "geometric 4/doubling, x64": (64, 4),
    "geometric 8/doubling, x128": (128, 8),
    "geometric 8/doubling, x64 (default)": (64, 8),
    "geometric 16/doubling, x64": (64, 16),
}


def alpaca_lengths(path: str, tokenizer: str, max_length: int) -> np.ndarray:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    rows = json.loads(Path(path).read_text(encoding="utf-8"))
    prompts, answers = [], []
    for r in rows:
        prompt = f"### Instruction:\n{r['instruction']}\n\n"
        if r.get("input"):
            prompt += f"### Input:\n{r['input']}\n\n"
        prompts.append(prompt + "### Response:\n")
        answers.append(str(r.get("output") or ""))
    p_ids = tok(prompts, add_special_tokens=True)["input_ids"]
    a_ids = tok(answers, add_special_tokens=False)["input_ids"]
    eos = 0 if tok.eos_token_id is None else 1
    lengths = np.array([len(p) + len(a) + eos for p, a in zip(p_ids, a_ids, strict=True)])
    return np.minimum(lengths, max_length)


def measure(batch_tokens: list[int], ladder: tuple[int, ...] | None) -> tuple[float, int, int]:
    """(extra tokens / real tokens, distinct packed lengths, rungs of the ladder)."""
    tokens = np.asarray(batch_tokens, dtype=np.int64)
    if ladder is None:
        return 0.0, len(set(tokens.tolist())), 0
    rungs = np.asarray(ladder, dtype=np.int64)
    padded = rungs[np.searchsorted(rungs, tokens)]
    return (
        float(padded.sum() - tokens.sum()) / float(tokens.sum()),
        len(set(padded.tolist())),
        len(rungs),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alpaca", default=str(SHARED / "alpaca" / "alpaca_5000.json"))
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "qwen2"))
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-sizes", default="8,32,128")
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--max-documents", default="64,128,256")
    args = p.parse_args()

    lengths = alpaca_lengths(args.alpaca, args.tokenizer, args.max_length)
    cases = {}
    for bs in (int(x) for x in args.batch_sizes.split(",")):
        sampler = ExampleCountBatchSampler(lengths, bs, seed=0)
        cases[f"batch {bs}"] = (sampler.batch_tokens, bs * args.max_length)
    budget = TokenBudgetBatchSampler(lengths, args.budget)
    cases[f"{args.budget // 1024}K budget"] = (budget.batch_tokens, args.budget)

    print(
        f"{len(lengths)} examples, {int(lengths.sum())} tokens (mean {lengths.mean():.1f}, max "
        f"{int(lengths.max())}), max_length {args.max_length}\n"
    )
    means = [f"{name} {np.mean(tok):.0f} ({len(tok)} batches)" for name, (tok, _) in cases.items()]
    print("mean real tokens per batch: " + ", ".join(means))
    print()
    print("| ladder | " + " | ".join(f"{name}: extra, shapes" for name in cases) + " |")
    print("|---|" + "---|" * len(cases))
    for name, spec in LADDERS.items():
        cells = []
        for tokens, top in cases.values():
            ladder = None
            if spec is not None:
                ladder = bucket_ladder(top, multiple=spec[0], steps_per_doubling=spec[1])
            extra, shapes, rungs = measure(tokens, ladder)
            cells.append(f"{extra:.1%}, {shapes}" + (f"/{rungs}" if rungs else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")

    print(
        f"\nmax_documents at the {args.budget}-token budget (derived: {budget.max_documents}): "
        "batches and packing efficiency"
    )
    print("| max_documents | batches | packing efficiency |")
    print("|---|---|---|")
    print(
        f"| none ({budget.max_documents}) | {budget.stats.num_batches} | "
        f"{budget.stats.packing_efficiency:.1%} |"
    )
    for cap in (int(x) for x in args.max_documents.split(",")):
        s = TokenBudgetBatchSampler(lengths, args.budget, max_documents=cap)
        print(f"| {cap} | {s.stats.num_batches} | {s.stats.packing_efficiency:.1%} |")


if __name__ == "__main__":
    main()
