"""What the eager coverage check of collator offsets costs per training step (issue #12, item 5).

In eager mode ``varlen_packed`` checks once per batch that the collator's ``cu_seq_lens_q/k``
cover it (start at 0, never decrease, end at T, fit ``max_length_q/k``): a handful of tiny
reductions whose result must reach the host (``hf_varlen.coverage``). This script times forward +
backward steps of a packed Llama (1B shape) over the same packs with the check

    sync      read back with a host sync every batch (how it shipped first)
    deferred  read back without a sync, once the copy has landed (as shipped now)
    off       not done: the collator's ints as given (what a compiled step does)

and reports each one's cost against ``off``. The step time is wall-clock over ``--steps``
consecutive steps with one synchronize at the end, so the CPU may run ahead of the GPU exactly as
in a loop without host reads; a sync stalls that run-ahead, which is the real cost (the
reductions themselves take microseconds). ``--read-loss`` reads the loss every step (as a
trainer that logs or checks it does), which gives the run-ahead up anyway.

    python scripts/bench_coverage_check.py --json runs/coverage.json
    python scripts/bench_coverage_check.py --layers 16 --docs 1,8,32 --read-loss
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
import hf_varlen.coverage as coverage  # noqa: E402
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


def timed_steps(model, packs: list[dict], steps: int, read_loss: bool) -> float:
    """Mean wall-clock ms per forward + backward step over ``steps`` steps, one synchronize at
    the end (and a loss read per step with ``read_loss``)."""
    t0 = time.perf_counter()
    for i in range(steps):
        loss = model(**packs[i % len(packs)]).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if read_loss:
            float(loss.detach())
    coverage.check_pending_offsets()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def check_off(cu_q, cu_k, max_q, max_k, total_q, total_k):
    """The compiled path's behaviour: the collator's ints as given, nothing read back."""
    return int(max_q), int(max_k)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="2,16", help="decoder layers of the 1B shape, comma list")
    ap.add_argument("--docs", default="1,8,32", help="documents per pack, comma list")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per variant (best)")
    ap.add_argument("--read-loss", action="store_true", help="read the loss every step")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_coverage_check.py needs a CUDA GPU (it times host syncs)")
    head = run_header(bench="coverage_check")
    print(json.dumps(head))
    sync_check, wants = metadata._check_covers, coverage.DEFERRED.wants
    variants = {  # name -> (the synchronous check, whether a batch's check is deferred)
        "sync": (sync_check, lambda *a: False),
        "deferred": (sync_check, wants),
        "off": (check_off, lambda *a: False),
    }
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        model = make_model(layers, "cuda")
        for n_docs in (int(x) for x in args.docs.split(",")):
            packs = make_packs(n_docs, 8, "cuda")
            tokens = sum(p["input_ids"].shape[1] for p in packs) / len(packs)
            # Repeats interleave the variants (off twice: the gap between two identical runs is
            # the noise), so drift over the call hits all of them alike; best repeat per variant.
            ms = dict.fromkeys(("off", "sync", "deferred", "off2"), float("inf"))
            for repeat in range(args.repeats + 1):  # repeat 0 warms every variant up
                for name in ms:
                    check, defer = variants[name.rstrip("2")]
                    metadata._check_covers, coverage.DEFERRED.wants = check, defer
                    try:
                        t = timed_steps(model, packs, args.steps if repeat else 3, args.read_loss)
                    finally:
                        metadata._check_covers, coverage.DEFERRED.wants = sync_check, wants
                    if repeat:
                        ms[name] = min(ms[name], t)
            off = min(ms["off"], ms["off2"])
            row = dict(layers=layers, docs=n_docs, tokens=round(tokens), read_loss=args.read_loss)
            row.update(off_ms=round(off, 3), noise_ms=round(abs(ms["off"] - ms["off2"]), 3))
            for name in ("sync", "deferred"):
                row[f"{name}_ms"] = round(ms[name], 3)
                row[f"{name}_cost_pct"] = round(100 * (ms[name] - off) / off, 2)
            rows.append(row)
            print(json.dumps(row))
        del model
        torch.cuda.empty_cache()
    print(
        "\n| layers | docs | tokens | off ms | sync ms | sync cost | deferred ms | deferred cost "
        "| off-vs-off ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['docs']} | {r['tokens']} | {r['off_ms']:.2f} "
            f"| {r['sync_ms']:.2f} | {r['sync_cost_pct']:+.1f}% | {r['deferred_ms']:.2f} "
            f"| {r['deferred_cost_pct']:+.1f}% | {r['noise_ms']:.3f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": head, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
