"""Benchmark the lm_head + cross-entropy step: forward+backward time and peak extra memory.

Providers (bf16 hidden (T, H) and weight (V, H), random labels, a share --ignore-frac of them
-100, loss = sum / n_labels as HF's ``ForCausalLMLoss`` with ``num_items_in_batch``):

    hf         logits = hidden @ W^T; F.cross_entropy(logits.float(), labels, reduction="sum") / n
    compile    torch.compile of the hf function
    liger      liger-kernel's LigerFusedLinearCrossEntropyLoss (comparator only, if installed)
    hf_varlen  hf_varlen.ops.cross_entropy.fused_linear_cross_entropy (every row, no host sync)
    hf_varlen-drop  the same with drop_ignored_tokens=True (ignored rows dropped before the
               matmuls: fewer FLOPs at a high --ignore-frac, one host sync per call)

Time: CUDA events around (forward + backward), median of --reps runs after --warmup runs.
Memory: torch.cuda.max_memory_allocated() during one step minus what was allocated before it
(the inputs), i.e. logits, temporaries and the gradients. Combinations that run out of memory are
reported as OOM. Results stream into the --json file after every shape.

    python scripts/bench_loss.py --json out/loss.json
    python scripts/bench_loss.py --T 32768 --V 151936 --H 4096 --chunk-sweep 2048,4096,8192
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import run_header  # noqa: E402

from hf_varlen.ops import cross_entropy as ce  # noqa: E402
from hf_varlen.ops.cross_entropy import chunks  # noqa: E402

GIB = 1 << 30
TARGET = (32768, 151936, 4096)  # issue 6: at this shape, memory <= HF / 8 and time <= 1.05 x HF


def _hf_loss(hidden, weight, labels, n_items):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / n_items


def _providers(names: list[str]) -> tuple[dict, dict]:
    fns, notes = {}, {}
    for name in names:
        if name == "hf":
            fns[name] = _hf_loss
        elif name == "compile":
            fns[name] = torch.compile(_hf_loss)
        elif name == "liger":
            try:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            except ImportError as err:
                notes[name] = f"not installed ({err})"
                continue
            liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            fns[name] = lambda h, w, y, n, _m=liger: _m(w, h, y) / n
        elif name == "hf_varlen":
            fns[name] = lambda h, w, y, n: ce.fused_linear_cross_entropy(h, w, y) / n
        elif name == "hf_varlen-drop":
            fns[name] = lambda h, w, y, n: (
                ce.fused_linear_cross_entropy(h, w, y, drop_ignored_tokens=True) / n
            )
        elif name.startswith("hf_varlen[chunk="):
            chunk = int(name.split("=")[1].rstrip("]"))
            fns[name] = lambda h, w, y, n, c=chunk: (
                ce.fused_linear_cross_entropy(h, w, y, chunk_size=c) / n
            )
        else:
            raise ValueError(f"--providers: unknown provider {name!r}")
    return fns, notes


def _measure(fn, hidden, weight, labels, n_items, reps: int, warmup: int) -> dict:
    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels, n_items)
        loss.backward()
        return loss

    try:
        for _ in range(warmup):
            loss = step()
        torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        times = []
        for _ in range(reps):
            hidden.grad = weight.grad = None
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        return {
            "ms": statistics.median(times),
            "peak_gib": peak / GIB,
            "loss": float(loss.detach()),
        }
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        hidden.grad = weight.grad = None
        torch.cuda.empty_cache()


def _header() -> dict:
    dev = torch.device("cuda")
    return run_header(
        python=platform.python_version(),
        dw_accumulate="cuBLAS addmm out_dtype=fp32"
        if chunks._addmm_out_dtype_ok(dev, torch.bfloat16)
        else "bf16 product + fp32 add",
    )


def _table(rows: list[dict]) -> str:
    lines = [
        "| T | V | H | provider | fwd+bwd ms | x HF | peak extra GiB | x HF | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"| {r['T']} | {r['V']} | {r['H']} | {r['provider']} |"
        if r.get("oom") or r.get("skipped"):
            lines.append(f"{shape} {r.get('skipped', 'OOM')} | | | | |")
            continue
        hf = next(
            (
                x
                for x in rows
                if (x["T"], x["V"], x["H"]) == (r["T"], r["V"], r["H"])
                and x["provider"] == "hf"
                and "ms" in x
            ),
            None,
        )
        t_ratio = f"{r['ms'] / hf['ms']:.3f}" if hf else "-"
        m_ratio = f"{r['peak_gib'] / hf['peak_gib']:.3f}" if hf else "-"
        cells = f"{r['ms']:.2f} | {t_ratio} | {r['peak_gib']:.2f} | {m_ratio} | {r['loss']:.5f}"
        lines.append(f"{shape} {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--T", type=ints, default=[8192, 32768, 131072])
    parser.add_argument("--V", type=ints, default=[128256, 151936])
    parser.add_argument("--H", type=ints, default=[2048, 4096])
    parser.add_argument("--providers", default="hf,compile,liger,hf_varlen")
    parser.add_argument("--chunk-sweep", type=ints, default=[], help="extra hf_varlen chunk sizes")
    parser.add_argument("--ignore-frac", type=float, default=0.0, help="share of -100 labels")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=float("inf"), help="seconds")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_loss.py needs a CUDA GPU", file=sys.stderr)
        return 2

    header = {**_header(), "ignore_frac": args.ignore_frac}
    print("# lm_head + cross-entropy, forward+backward (bf16)")
    print(" | ".join(f"{k}: {v}" for k, v in header.items()))
    names = args.providers.split(",") + [f"hf_varlen[chunk={c}]" for c in args.chunk_sweep]
    fns, notes = _providers(names)
    for name, note in notes.items():
        print(f"note: provider {name}: {note}")
    rows: list[dict] = []
    t0 = time.monotonic()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n_tok in args.T:
        for vocab in args.V:
            for hidden_size in args.H:
                hidden = torch.randn(n_tok, hidden_size, device="cuda", generator=gen)
                hidden = hidden.bfloat16().requires_grad_()
                weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.02
                weight = weight.bfloat16().requires_grad_()
                labels = torch.randint(0, vocab, (n_tok,), device="cuda", generator=gen)
                ignored = torch.rand(n_tok, device="cuda", generator=gen) < args.ignore_frac
                labels[ignored] = -100  # e.g. prompt tokens in SFT; HF computes them anyway
                n_items = (labels != -100).sum().float()
                for name, fn in fns.items():
                    row = {"T": n_tok, "V": vocab, "H": hidden_size, "provider": name}
                    if time.monotonic() - t0 > args.time_budget:
                        row["skipped"] = "skipped (time budget)"
                    elif "[chunk=" in name and (n_tok, vocab, hidden_size) != TARGET:
                        continue
                    else:
                        try:
                            row.update(
                                _measure(
                                    fn, hidden, weight, labels, n_items, args.reps, args.warmup
                                )
                            )
                        except Exception as err:  # noqa: BLE001 - report e.g. a compile failure
                            row["skipped"] = f"error: {type(err).__name__}: {str(err)[:120]}"
                    rows.append(row)
                    status = row.get("skipped") or (
                        "OOM" if row.get("oom") else f"{row['ms']:.2f} ms"
                    )
                    print(f"  T={n_tok} V={vocab} H={hidden_size} {name}: {status}", flush=True)
                del hidden, weight, labels
                torch.cuda.empty_cache()
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))

    print()
    print(_table(rows))
    target = {r["provider"]: r for r in rows if (r["T"], r["V"], r["H"]) == TARGET and "ms" in r}
    if "hf" in target and "hf_varlen" in target:
        hf, ours = target["hf"], target["hf_varlen"]
        mem, tim = ours["peak_gib"] / hf["peak_gib"], ours["ms"] / hf["ms"]
        verdict = "PASS" if mem <= 1 / 8 and tim <= 1.05 else "FAIL"
        print(
            f"\ntarget T=32K V=151936 H=4096: memory {mem:.3f} x HF (<= 0.125), "
            f"time {tim:.3f} x HF (<= 1.05): {verdict}"
        )
    oom = [r for r in rows if r.get("oom")]
    if oom:
        print(
            "OOM (skipped): "
            + ", ".join(f"{r['provider']}@T={r['T']},V={r['V']},H={r['H']}" for r in oom)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
