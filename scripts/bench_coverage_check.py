"""What the eager coverage check of collator offsets costs per training step (issue #12, item 5).

In eager mode ``varlen_packed`` checks once per forward that the collator's ``cu_seq_lens_q/k``
cover the batch (start at 0, never decrease, end at T, fit ``max_length_q/k``): a handful of tiny
reductions and one host sync, shared by all layers (``hf_varlen.metadata._check_covers``). This
script times forward + backward steps of a packed Llama with the check as shipped ("on") and with
the check replaced by the collator's ints as given ("off", what a compiled step does), over the
same packs, and reports the difference per step.

The step time is wall-clock over ``--steps`` consecutive steps with one synchronize at the end, so
the CPU may run ahead of the GPU exactly as in training; the sync stalls that run-ahead, which is
the check's real cost (the reductions themselves take microseconds).

    python scripts/bench_coverage_check.py --json runs/coverage.json
    python scripts/bench_coverage_check.py --layers 2,16 --docs 1,8,32
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from bench_common import run_header  # noqa: E402

import hf_varlen  # noqa: E402
import hf_varlen.metadata as metadata  # noqa: E402
from hf_varlen.training.builtin import PRESETS  # noqa: E402

VOCAB = 151_936  # the shared qwen2 tokenizer's vocabulary (bench_e2e's 1B shape)


def make_model(layers: int, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    family, shape = PRESETS["llama-1b"]
    config = AutoConfig.for_model(family, **dict(shape, num_hidden_layers=layers), vocab_size=VOCAB)
    config._attn_implementation = "varlen_packed"
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: minutes faster than on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.train()


def make_packs(n_docs: int, n_packs: int, device: str, seed: int = 0) -> list[dict]:
    """Packed batches of ``n_docs`` documents with Alpaca-like lengths (30-700 tokens)."""
    rng = random.Random(seed)
    collator = hf_varlen.PackingCollator()
    packs = []
    for _ in range(n_packs):
        feats = [
            {"input_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(30, 700))]}
            for _ in range(n_docs)
        ]
        batch = collator(feats)
        packs.append(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        )
    return packs


def step_ms(model, packs: list[dict], steps: int) -> float:
    """Mean wall-clock ms per forward + backward step, one synchronize per ``steps`` steps."""

    def run(n):
        for i in range(n):
            loss = model(**packs[i % len(packs)]).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

    run(3)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):  # best of three repeats: the least disturbed
        t0 = time.perf_counter()
        run(steps)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3 / steps)
    return best


def check_off(cu_q, cu_k, max_q, max_k, total_q, total_k):
    """The compiled path's behaviour: the collator's ints as given, nothing read back."""
    return int(max_q), int(max_k)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="2,16", help="decoder layers of the 1B shape, comma list")
    ap.add_argument("--docs", default="1,8,32", help="documents per pack, comma list")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_coverage_check.py needs a CUDA GPU (it times host syncs)")
    head = run_header(bench="coverage_check")
    print(json.dumps(head))
    shipped = metadata._check_covers
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        model = make_model(layers, "cuda")
        for n_docs in (int(x) for x in args.docs.split(",")):
            packs = make_packs(n_docs, 8, "cuda")
            tokens = sum(p["input_ids"].shape[1] for p in packs) / len(packs)
            timings = {}
            for name, check in (("on", shipped), ("off", check_off), ("on2", shipped)):
                metadata._check_covers = check
                try:
                    timings[name] = step_ms(model, packs, args.steps)
                finally:
                    metadata._check_covers = shipped
            on = min(timings["on"], timings["on2"])  # on twice: bounds the drift between runs
            row = dict(
                layers=layers,
                docs=n_docs,
                tokens=round(tokens),
                on_ms=round(on, 3),
                off_ms=round(timings["off"], 3),
                cost_ms=round(on - timings["off"], 3),
                cost_pct=round(100 * (on - timings["off"]) / timings["off"], 2),
                noise_ms=round(abs(timings["on"] - timings["on2"]), 3),
            )
            rows.append(row)
            print(json.dumps(row))
        del model
        torch.cuda.empty_cache()
    print(
        "\n| layers | docs | tokens | check on ms | check off ms | cost ms | cost % | on-vs-on ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['docs']} | {r['tokens']} | {r['on_ms']:.2f} | {r['off_ms']:.2f} "
            f"| {r['cost_ms']:+.3f} | {r['cost_pct']:+.1f} | {r['noise_ms']:.3f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": head, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
