"""TRL ``SFTTrainer`` end to end on the GPU: varlen_packed vs TRL's sdpa padding-free path vs Liger.

Every cell is one subprocess (kernelize and Liger patch process-wide) that builds a random-init
model of a ``hf_varlen.training.builtin.PRESETS`` shape with **fp32 weights** and trains it with
TRL's defaults for mixed precision (``bf16=True``: bf16 autocast over fp32 weights, the case that
used to crash ``varlen_packed``), on the same alpaca examples in the same order:

    varlen_kernelize   attn "varlen_packed" (auto backend) + hf_varlen.kernelize layer kernels
    varlen_fusedce     varlen_kernelize, trained by hf_varlen.integrations.trainers.VarlenSFTTrainer:
                       the loss is hf_varlen's fused linear cross-entropy, not TRL's head
                       (its eager step: cuda_graphs="off")
    varlen_captured    varlen_fusedce with the captured step (cuda_graphs="on": forward +
                       backward replayed from CUDA graphs per bucket shape)
    varlen_auto        varlen_fusedce as a user gets it (cuda_graphs="auto", the default)
    varlen             attn "varlen_packed", no layer kernels
    sdpa               attn "sdpa": TRL's padding-free path on transformers' own attention
    liger              attn "sdpa" + ``use_liger_kernel=True`` (TRL keeps its own LM head)

each under ``--strategies`` padding_free (SFTConfig(padding_free=True)) and bfd
(SFTConfig(packing=True, packing_strategy="bfd")). TRL 1.16 always runs its own fused LM head
(``trl.trainer.utils.add_fused_lm_head``: per-token log-probs, no full logits), so the
cross-entropy is TRL's in every cell but varlen_fusedce; the ``ce`` stage times that head against hf_varlen's
``fused_linear_cross_entropy`` on one (tokens, hidden) x (vocab, hidden) problem, forward+backward.

Metrics per cell, over the steps after ``--warmup``: real tokens/s (input tokens of the packed
batch; padding-free batches hold no padding) over the steps that captured no new CUDA graph (the
captured step's steady state), and over all of them (what a run this short sees; the capture cost
is also in ``step.capture_s``), peak GiB (``max_memory_allocated``), first/last loss, which LM head
ran.

    python scripts/bench_trl.py --tokenizer ../shared/data/tokenizers/qwen2 \
        --dataset ../shared/data/alpaca/alpaca_5000.json --out runs/trl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "examples"))

MODES = ("varlen_kernelize", "varlen_fusedce", "varlen", "sdpa", "liger")
CAPTURED_MODES = {"varlen_captured": "on", "varlen_auto": "auto"}  # not in the default list
STRATEGIES = ("padding_free", "bfd")


def _build_model(preset: str, vocab: int, attn: str, layers: int | None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_varlen.training.builtin import PRESETS

    family, shape = PRESETS[preset]
    shape = dict(shape, vocab_size=vocab, use_cache=False)
    if layers:
        shape["num_hidden_layers"] = layers
    config = AutoConfig.for_model(family, **shape)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def _runs_trl_head(model) -> bool:
    """Whether model.forward is TRL's fused-LM-head forward, under any wrappers (accelerate's
    autocast wrapper included). functools.wraps renames it, but its code object keeps its name."""
    fn = getattr(model.forward, "__func__", model.forward)
    for _ in range(8):
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_name == "_fused_forward":
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
        fn = getattr(fn, "__func__", fn)
    return False


def _lm_head(trainer, model) -> str:
    """Which head computed the training loss."""
    from hf_varlen import is_fused_cross_entropy_installed
    from hf_varlen.integrations.trainers import VarlenSFTTrainer

    if isinstance(trainer, VarlenSFTTrainer):
        assert is_fused_cross_entropy_installed(model)
        return "hf_varlen fused CE (VarlenSFTTrainer)"
    return "trl fused head" if _runs_trl_head(model) else "model forward"


def run_cell(args) -> dict:
    """One (mode, strategy) cell in this process; returns its metrics."""
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl_sft import alpaca_dataset, make_trainer

    import hf_varlen

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    attn = "sdpa" if args.mode in ("sdpa", "liger") else hf_varlen.ATTN_IMPLEMENTATION
    cuda = torch.cuda.is_available()  # CPU only for a smoke run of the script itself
    model = _build_model(args.preset, len(tokenizer), attn, args.layers)
    model = model.cuda() if cuda else model
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kernels = "off"
    fused = args.mode == "varlen_fusedce" or args.mode in CAPTURED_MODES
    if args.mode in ("varlen_kernelize", "varlen_fusedce", *CAPTURED_MODES):
        # varlen_fusedce: VarlenSFTTrainer installs the fused loss itself.
        report = hf_varlen.kernelize(model, cross_entropy=False, device="cuda" if cuda else "cpu")
        kernels = str(report)
    tokens: list[int] = []

    class Timer(TrainerCallback):
        """Per-step wall time, and whether the step captured a new CUDA graph (a batch shape
        first seen then): those steps are the captured step's one-time cost, kept apart."""

        def __init__(self):
            self.times: list[float] = []
            self.captured: list[bool] = []
            self._t0 = 0.0
            self._graphs = 0

        def _graph_count(self) -> int:
            return int(trainer.captured_step_summary().get("graphs") or 0) if fused else 0

        def on_step_begin(self, *a, **k):
            sync()
            self._graphs = self._graph_count()
            self._t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            self.times.append(time.perf_counter() - self._t0)
            self.captured.append(self._graph_count() > self._graphs)

    extra = dict(use_liger_kernel=True) if args.mode == "liger" else {}
    trainer = make_trainer(
        model,
        tokenizer,
        alpaca_dataset(args.dataset, args.examples),
        args.strategy,
        str(Path(args.out) / f"{args.mode}-{args.strategy}"),
        fused_loss=fused,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=2e-5,
        bf16=True,
        dataloader_num_workers=0,
        **extra,
    )
    if fused:  # VarlenSFTTrainer: eager unless the mode names the captured step
        trainer.configure_captured_step(CAPTURED_MODES.get(args.mode, "off"))
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        tokens.append(int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting
    timer = Timer()
    trainer.add_callback(timer)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # One record per optimizer step (per_device batch, no accumulation): time, real tokens, and
    # whether it captured. Steady state leaves out the capturing steps; the run as a whole, what
    # a run this short would see, keeps them.
    # With no step free of captures there is no steady state to report (None, shown as "-").
    steps = list(zip(timer.times, tokens, timer.captured, strict=False))[args.warmup :]
    steady = [(t, n) for t, n, cap in steps if not cap]
    whole_s, whole_tokens = sum(t for t, *_ in steps), sum(n for _, n, _ in steps)
    steady_s, steady_tokens = sum(t for t, _ in steady), sum(n for _, n in steady)
    return {
        "mode": args.mode,
        "strategy": args.strategy,
        "tokens_per_s": steady_tokens / steady_s if steady else None,
        "tokens_per_s_with_captures": whole_tokens / whole_s if steps else None,
        "capture_steps": len(steps) - len(steady),
        "tokens_per_step": steady_tokens / len(steady) if steady else None,
        "step_ms": 1e3 * steady_s / len(steady) if steady else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "lm_head": _lm_head(trainer, model),
        "attn": model.config._attn_implementation,
        "kernels": kernels,
        **({"step": trainer.captured_step_summary()} if fused else {}),
    }


def run_ce(args) -> dict:
    """hf_varlen's fused linear CE vs TRL's fused LM head on one problem, forward+backward."""
    import torch
    from bench_common import time_ms
    from trl.trainer import utils as trl_utils

    from hf_varlen.ops.cross_entropy import fused_linear_cross_entropy

    torch.manual_seed(0)
    n, hidden, vocab = args.ce_tokens, 2048, args.ce_vocab
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    chunk = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE

    def ours():
        fused_linear_cross_entropy(x, w, labels, reduction="sum").backward()

    def trl(outputs):
        def fn():
            out = trl_utils._ChunkedLogProbFunction.apply(
                x, w, None, labels, 1.0, chunk, None, 1.0, outputs
            )
            (-out[0].sum()).backward()

        return fn

    rows = {}
    for name, fn in (
        ("hf_varlen fused_linear_cross_entropy", ours),
        ("TRL head, log_probs only", trl(("log_probs",))),
        (
            "TRL head as SFTTrainer runs it (log_probs, entropy, is_top1)",
            trl(("log_probs", "entropy", "is_top1")),
        ),
    ):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = time_ms(fn, min_runs=10, min_total_ms=200.0)
        rows[name] = {
            "fwd_bwd_ms": ms,
            "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        }
    return {"tokens": n, "hidden": hidden, "vocab": vocab, "rows": rows}


def _with_captures(r: dict) -> str:
    """The whole timed run's tokens/s where some of its steps captured a graph, else "="."""
    if not r.get("capture_steps"):
        return "="
    return f"{r['tokens_per_s_with_captures']:,.0f} ({r['capture_steps']} capture steps)"


def table(results: list[dict], ce: dict | None, header: dict) -> str:
    lines = [
        "Run: " + ", ".join(f"{k} {v}" for k, v in header.items()),
        "",
        "| strategy | mode | attn | real tokens/s | with capture steps | tokens/step | step ms "
        "| peak GiB | loss first -> last | LM head |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['strategy']} | {r['mode']} | - | failed: {r['error'][:80]} |  |  |  |  |  |  |"
            )
            continue
        steady = r["tokens_per_s"] is not None
        rate, per_step, step_ms = (
            (f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_step']:,.0f}", f"{r['step_ms']:.1f}")
            if steady
            else ("-", "-", "-")
        )
        lines.append(
            f"| {r['strategy']} | {r['mode']} | {r['attn']} | {rate} | {_with_captures(r)} | "
            f"{per_step} | {step_ms} | {r['peak_gib']:.1f} | "
            f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['lm_head']} |"
        )
    if ce:
        lines += [
            "",
            f"LM head + cross-entropy, forward+backward, bf16, {ce['tokens']} tokens x hidden "
            f"{ce['hidden']} x vocab {ce['vocab']}:",
            "",
            "| implementation | f+b ms | extra peak GiB |",
            "|---|---|---|",
        ]
        for name, row in ce["rows"].items():
            lines.append(f"| {name} | {row['fwd_bwd_ms']:.2f} | {row['extra_peak_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--layers", type=int, default=None, help="cut the preset to N layers")
    p.add_argument("--modes", default=",".join(MODES), help=f"also: {', '.join(CAPTURED_MODES)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--examples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32, help="examples per step (bfd: rows)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=int, default=150, help="seconds per cell")
    p.add_argument("--ce-tokens", type=int, default=16384)
    p.add_argument("--ce-vocab", type=int, default=151936)
    p.add_argument("--skip-ce", action="store_true")
    p.add_argument("--out", default="runs/trl")
    p.add_argument("--cell", nargs=2, metavar=("MODE", "STRATEGY"), help=argparse.SUPPRESS)
    p.add_argument("--ce-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cell:
        args.mode, args.strategy = args.cell
        print("RESULT " + json.dumps(run_cell(args)))
        return 0
    if args.ce_only:
        print("RESULT " + json.dumps(run_ce(args)))
        return 0

    from bench_common import _version, run_header

    header = run_header(
        trl=_version("trl"), preset=args.preset, batch=args.batch_size, steps=args.steps
    )
    print(header)
    results = []
    base = [sys.executable, __file__] + [a for a in (argv or sys.argv[1:])]

    def child(extra: list[str]):
        try:
            proc = subprocess.run(
                base + extra, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {args.timeout}s"}
        name = "-".join(extra).replace("--", "")
        (out / f"{name}.log").write_text(proc.stdout + "\n" + proc.stderr)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
        return {"error": (errors or proc.stderr.strip().splitlines() or ["no output"])[-1]}

    for strategy in args.strategies.split(","):
        for mode in args.modes.split(","):
            r = child(["--cell", mode, strategy])
            r.setdefault("mode", mode)
            r.setdefault("strategy", strategy)
            results.append(r)
            print(json.dumps(r), flush=True)
            (out / "results.json").write_text(json.dumps({"header": header, "cells": results}))
    ce = None
    if not args.skip_ce:
        ce = child(["--ce-only"])
        print(json.dumps(ce), flush=True)
        if "error" in ce:
            ce = None
    text = table(results, ce, header)
    (out / "trl_tables.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"header": header, "cells": results, "ce": ce}))
    print(text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
