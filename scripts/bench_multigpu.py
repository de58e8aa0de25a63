"""Scaling of ``hf-varlen train`` over the processes of one machine: one process vs DDP vs FSDP2.

    python scripts/bench_multigpu.py --processes 2 --model llama-1b --tokenizer TOK \\
        --dataset alpaca_5000.json --tokens-per-batch 16384 --steps 30 --out runs/multigpu

Runs, each a real ``hf-varlen train`` (accelerate-launched when several processes):

    single        1 process, --grad-accum N: the global batch of N micro-batches per step
    ddp           N processes (--ddp-config, default scripts/accelerate/ddp.yaml), --grad-accum 1
    single-mixed  as single with --precision bf16-mixed: FSDP2's precision (fp32 sharded weights,
                  bf16 compute; scripts/accelerate/fsdp2.yaml), so fsdp2's losses have a reference
    fsdp2         N processes (--fsdp2-config), --grad-accum 1
    single-graphs as single with --static-shapes --cuda-graphs on (not run unless named in
                  --runs): the one-GPU step with its host work captured, the ceiling next to
                  which the eager multi-process runs stand (the CUDA-graph step is one process
                  only: DDP's all-reduce is eager, hf_varlen/training/graphs.py)
    ddp-resume    (not run unless named) ddp saving a checkpoint at step K (--resume-step, default
                  the middle one), then a second launch resumed from it: its steps K+1.. must
                  repeat the first launch's losses and gradient norms (checkpoint + resume across
                  the ranks)

All with --no-shuffle: the sampler deals its fixed order of packs to the ranks, so step s of an
N-process run trains on exactly the packs of step s of the one-process run with accumulation N
(tests/training/test_train_distributed.py), and the per-step losses must agree (to rounding in fp32,
to bf16 tolerance in bf16; the table gives the largest relative difference). Per run: tokens/s (all
processes), tokens/s per process, scaling efficiency (tokens/s / (N x the one-process run's of the
same precision), skipping step 1 as the summary does), peak memory per rank, and the rank
imbalance (max / mean real tokens of a step over the ranks, from the trainer's summary). Every
run profiles one step (``--profile-step``, default the middle one; the trainer's throughput leaves
it out): per rank, its wall time split into GPU compute, communication (NCCL kernels), the
communication no compute overlaps, and GPU idle time (hf_varlen/training/profiling.py), which is
what limits the scaling (on CPU processes over gloo it cannot split communication from compute).
Writes ``results.json`` and ``multigpu.md`` (the tables, with the run header) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

RUNS = ("single", "ddp", "single-mixed", "fsdp2")
EXTRA_RUNS = ("single-graphs", "ddp-resume")  # run only when --runs names them
REFERENCE = {"ddp": "single", "fsdp2": "single-mixed"}  # whose losses and tokens/s a run meets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(name: str, args, out_dir: Path, extra=(), profile: bool = True) -> list[str]:
    """The ``hf-varlen train`` command line of run ``name`` (``extra``: more train flags;
    ``profile``: pass --profile-step)."""
    n = args.processes
    train = [
        "train",
        "--max-steps",
        str(args.steps),
        "--tokens-per-batch",
        str(args.tokens_per_batch),
        "--max-length",
        str(args.max_length),
        "--grad-accum",
        str(n if name.startswith("single") else 1),
        "--no-shuffle",
        "--no-progress",
        "--no-save-final",
        "--overwrite-output-dir",
        "--output-dir",
        str(out_dir),
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
        *(["--precision", "bf16-mixed"] if name == "single-mixed" else []),
        *(["--static-shapes", "--cuda-graphs", "on"] if name == "single-graphs" else []),
        *(["--profile-step", str(args.profile_step)] if args.profile_step and profile else []),
        *extra,
        *args.train_args,
    ]
    if name.startswith("single"):
        return [sys.executable, "-m", "hf_varlen.cli", *train]
    config = args.ddp_config if name.startswith("ddp") else args.fsdp2_config
    launch = ["--config_file", config, "--num_processes", str(n)]
    launch += ["--main_process_port", str(_free_port())]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launch,
        "-m",
        "hf_varlen.cli",
    ] + train


def run_one(
    name: str, args, out: Path, run_dir: Path | None = None, extra=(), profile: bool = True
) -> dict:
    """Train run ``name`` (into ``run_dir``, default OUT/name; ``extra``, ``profile``: see
    ``command``); its summary and per-step losses, or a status saying why not."""
    run_dir = run_dir or out / name
    cmd = command(name, args, run_dir, extra, profile)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"name": name, "status": f"timeout after {args.timeout:.0f} s"}
    log = "_".join(run_dir.relative_to(out).parts)
    (out / f"{log}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"name": name, "status": f"error (rc {proc.returncode}): " + " | ".join(tail)}
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    profiles = []
    if args.profile_step and profile:
        for rank in range(summary["processes"]):
            path = run_dir / "profile" / f"step{args.profile_step}_rank{rank}.json"
            profiles.append(json.loads(path.read_text()) if path.exists() else {"rank": rank})
    return {
        "name": name,
        "status": "ok",
        "seconds": time.perf_counter() - t0,
        "processes": summary["processes"],
        "distribution": summary.get("distribution", "-"),  # what really ran: DDP / FSDP2 over ..
        "tokens_per_s": summary["tokens_per_s"],
        "peak_mem_gib": summary["peak_mem_gib"],
        "ranks": summary.get("ranks"),
        "losses": [r["loss"] for r in steps],
        "grad_norms": [r["grad_norm"] for r in steps],
        "real_tokens": [r["real_tokens"] for r in steps],
        "profile": profiles,
        "command": " ".join(cmd[cmd.index("train") :]),
    }


def run_resume(args, out: Path) -> dict:
    """ddp-resume: a ddp launch that saves at step K, then one resumed from that checkpoint into
    a folder of its own; the first launch's result with the resumed steps compared."""
    k = args.resume_step
    base = out / "ddp-resume"
    first = run_one("ddp-resume", args, out, base / "straight", ("--save-every", str(k)))
    if first["status"] != "ok":
        return first
    checkpoint = base / "straight" / f"checkpoint-{k}"
    second = run_one(
        "ddp-resume", args, out, base / "resumed", ("--resume", str(checkpoint)), profile=False
    )
    if second["status"] != "ok":
        return {**first, "status": f"resumed launch: {second['status']}"}
    want, got = first["losses"][k:], second["losses"]
    gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)]
    return {
        **first,
        "resume_step": k,
        "resumed_losses": got,
        "resume_identical": got == want and second["grad_norms"] == first["grad_norms"][k:],
        "resume_max_rel_gap": max(gaps, default=0.0),
        "resumed_steps": len(got),
    }


def compare(results: dict[str, dict]) -> None:
    """Add scaling efficiency and the loss gap against each multi-process run's reference."""
    for name, ref_name in REFERENCE.items():
        r, ref = results.get(name), results.get(ref_name)
        if not (r and ref and r["status"] == ref["status"] == "ok"):
            continue
        r["scaling_efficiency"] = r["tokens_per_s"] / (r["processes"] * ref["tokens_per_s"])
        r["same_tokens"] = r["real_tokens"] == ref["real_tokens"]
        gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"])]
        r["max_rel_loss_gap"] = max(gaps, default=0.0)


def table(results: dict[str, dict], header: dict) -> str:
    head = " | ".join(f"{k}: {v}" for k, v in header.items())
    lines = [
        f"Header: `{head}`",
        "",
        "| run | processes | distribution | tokens/s | per process | scaling efficiency | "
        "peak GiB per rank | rank imbalance mean / worst | max loss gap vs reference | "
        "same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} | | | | | | | | |")
            continue
        ranks = r.get("ranks") or {}
        peaks = ranks.get("peak_mem_gib") or [r["peak_mem_gib"]]
        imb = f"{ranks['imbalance_mean']:.3f} / {ranks['imbalance_worst']:.3f}" if ranks else "-"
        eff = f"{r['scaling_efficiency']:.3f}" if "scaling_efficiency" in r else "-"
        gap = (
            f"{r['max_rel_loss_gap']:.2e} (vs {REFERENCE[name]})"
            if "max_rel_loss_gap" in r
            else "-"
        )
        same = {True: "yes", False: "no"}.get(r.get("same_tokens"), "-")
        lines.append(
            f"| {name} | {r['processes']} | {r['distribution']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / r['processes']:,.0f} | {eff} | "
            f"{', '.join(f'{p:.2f}' for p in peaks)} | {imb} | {gap} | {same} |"
        )
    resumed = [(n, r) for n, r in results.items() if r["status"] == "ok" and "resume_step" in r]
    for name, r in resumed:
        same = "yes" if r["resume_identical"] else "no"
        lines += [
            "",
            f"Checkpoint + resume ({name}, {r['processes']} ranks): saved at step "
            f"{r['resume_step']}, a second launch resumed from it ran steps {r['resume_step'] + 1}"
            f"-{r['resume_step'] + r['resumed_steps']}: losses and gradient norms identical to "
            f"the first launch's: **{same}** (largest relative loss gap "
            f"{r['resume_max_rel_gap']:.2e}).",
        ]
    profiled = [(n, r) for n, r in results.items() if r["status"] == "ok" and r.get("profile")]
    if profiled:
        lines += [
            "",
            f"Where the profiled step's time goes (step {profiled[0][1]['profile'][0].get('step')}"
            ", per rank; hf_varlen/training/profiling.py):",
            "",
            "| run | rank | clock | step ms | compute ms | communication ms | not overlapped ms | "
            "idle ms | top collective |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in profiled:
            for p in r["profile"]:
                if "step_ms" not in p:
                    lines.append(f"| {name} | {p['rank']} | no profile written | | | | | | |")
                    continue
                fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
                top = p["top_comm"][0][1] if p.get("top_comm") else "-"
                lines.append(
                    f"| {name} | {p['rank']} | {p['clock']} | {p['step_ms']:.1f} | "
                    f"{p['compute_ms']:.1f} | {p['comm_ms']:.1f} | {fmt(p['comm_exposed_ms'])} | "
                    f"{fmt(p['idle_ms'])} | {top} |"
                )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument(
        "--runs", default=",".join(RUNS), help=f"comma-separated, of {RUNS + EXTRA_RUNS}"
    )
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dataset", default="builtin")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--tokens-per-batch", type=int, default=16384, help="per rank and micro-batch")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ddp-config", default=str(ROOT / "scripts" / "accelerate" / "ddp.yaml"))
    p.add_argument("--fsdp2-config", default=str(ROOT / "scripts" / "accelerate" / "fsdp2.yaml"))
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="the step every run profiles (0: none; default: the middle one, after warm-up)",
    )
    p.add_argument(
        "--resume-step",
        type=int,
        default=None,
        help="ddp-resume: the step whose checkpoint the second launch resumes from (default: the "
        "middle one)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", default="runs/multigpu")
    p.add_argument(
        "train_args", nargs="*", help="more hf-varlen train flags for every run (after --)"
    )
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    if unknown := [r for r in runs if r not in RUNS + EXTRA_RUNS]:
        p.error(f"--runs: unknown {unknown}; known: {list(RUNS + EXTRA_RUNS)}")
    if args.processes < 2:
        p.error(f"--processes {args.processes}: scaling needs at least 2")
    if args.profile_step is None:
        args.profile_step = max(1, (args.steps + 1) // 2)
    if not 0 <= args.profile_step <= args.steps:
        p.error(f"--profile-step {args.profile_step}: expected 0 (none) to --steps ({args.steps})")
    if args.resume_step is None:
        args.resume_step = max(1, args.steps // 2)
    if not 1 <= args.resume_step < args.steps:
        p.error(f"--resume-step {args.resume_step}: expected 1 to --steps - 1 ({args.steps - 1})")
    args.runs = runs
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from bench_common import run_header

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = run_header(processes=args.processes, model=args.model, steps=args.steps)
    results: dict[str, dict] = {}
    for name in args.runs:
        results[name] = run_resume(args, out) if name == "ddp-resume" else run_one(name, args, out)
        r = results[name]
        done = f"{r['tokens_per_s']:,.0f} tokens/s" if r["status"] == "ok" else r["status"]
        print(f"{name}: {done}", flush=True)
    compare(results)
    (out / "results.json").write_text(json.dumps({"header": header, "runs": results}, indent=1))
    text = table(results, header)
    (out / "multigpu.md").write_text(text)
    print(text, flush=True)
    failed = [n for n, r in results.items() if r["status"] != "ok"]
    if failed:
        raise SystemExit(f"runs that did not finish: {failed} (logs in {out})")
    return results


if __name__ == "__main__":
    main()
