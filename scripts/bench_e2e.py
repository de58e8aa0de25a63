"""End-to-end training benchmark: tokens/s, peak memory, MFU and loss curves by per-device batch size.

Every measurement is a short ``hf-varlen train`` run (``hf_varlen.training.PackedTrainer``, the
same loop, data pipeline and metrics users get). Each (model, mode) runs its cells in one worker
process of its own (e2e_workers: process-wide patches such as kernel-hub RoPE or Liger never leak
into another mode, and a cell does not pay the imports, CUDA's start-up or a compiled mode's first
compile again); ``--process-per-cell`` starts a fresh process for every cell instead. Batches
are ``--batch-size B`` examples (the seed's per-device batch), consecutive in one seeded shuffle,
so every mode trains on identical examples in identical order.

Modes (``--modes``, comma-separated):

    padded_sdpa          right-padded [B, L_max] batches, HF ``sdpa``  (the usual baseline)
    packed_sdpa          packed [1, T] row, HF ``sdpa`` (dense block-diagonal mask from position_ids)
    packed_flex          packed row, HF ``flex_attention`` (document mask from position_ids)
    minimal_varlen       packed row, a 15-line custom attention calling torch ``varlen_attn``: the
                         simplest integration anyone could write, our floor
    hf_varlen            ``varlen_packed`` (auto backend) + kernelize + fused cross-entropy
    hf_varlen-attn       attribution: hf_varlen with the attention backend forced to ``torch``
    hf_varlen-kernels    attribution: hf_varlen without the RoPE/GLU/RMSNorm kernels
    hf_varlen-loss       attribution: hf_varlen without the fused cross-entropy
    liger_packed         minimal_varlen + Liger (rope, swiglu, rmsnorm, fused linear CE), if installed
    hf_varlen-compile    hf_varlen under ``hf-varlen train --compile`` (Inductor, fullgraph, every
                         pack marked dynamic: hf_varlen.training.compiling)
    hf_varlen-graphs     hf_varlen with ``--static-shapes --cuda-graphs on``: forward + backward per
                         batch shape and the fused AdamW update replayed from CUDA graphs
                         (hf_varlen.training.graphs)
    hf_varlen-compile-graphs  the same on the compiled model (``--compile``)
    hf_varlen-reduce-overhead  hf_varlen-compile with ``--compile-mode reduce-overhead``: Inductor's
                         cudagraph trees (forward + backward; the update eager), ``--static-shapes``
    minimal_varlen-compile  minimal_varlen under plain ``torch.compile(model)`` (default everything:
                         no fullgraph, automatic dynamic shapes), applied to the training model
                         after the trainer's eager trial forward: what a user would write, the
                         honest anchor for the compiled hf_varlen

LoRA (r=16 on every linear layer, peft) on each path: hf_varlen-lora, -lora-compile, -lora-graphs,
-lora-compile-graphs, minimal_varlen-lora(-compile); QLoRA (the same adapters over a 4-bit NF4
base, ``hf-varlen train --load-in-4bit``; skipped with the reason where this tree, bitsandbytes or
CUDA lacks it): hf_varlen-qlora, -qlora-compile, -qlora-graphs, minimal_varlen-qlora.

Peers (e2e_peers: what a user would pick instead, each in a worker process and environment of its
own, its site directory first on PYTHONPATH): unsloth (full fine-tuning, padding-free),
unsloth-lora, unsloth-qlora, trl-sdpa and trl-liger (TRL SFTTrainer padding_free=True on sdpa,
without / with Liger), torch-sdpa (a plain loop). Every mode and peer loads one saved random-init
model (``--model-cache``/models, written once per model, layers, precision and seed) and trains on
the same examples in the same order (hf-varlen train's sampler; the peers read the batches from
``--model-cache``/batches); each peer pins every optimizer and schedule setting to ours
(e2e_peers.sft_settings). Per cell a peer reports tokens/s after its warm-up (the warm-up, its
compile, import and load reported apart), peak memory, GPU busy, the per-step losses and the
attention kernels its profiled step ran (Unsloth also its packed-attention counters). The loss
check (e2e_report.check_losses) compares every mode's per-step losses with the reference mode's
(hf_varlen, hf_varlen-lora or hf_varlen-qlora) at each batch size: tolerance 2 x the spread among
our own modes + 2 x the unit roundoff of the run's precision (``--loss-rtol`` replaces it); a mode
past it is tabled as DIVERGED, not as a speed, and left out of the tokens/s plot.

Compile modes also report per cell: the compilations (dynamo's unique graphs, this run's process),
graph breaks, the first step's time, and the compile time estimate: the warm-up steps' excess over
the steady step time.

Metrics per run, over the steps after ``--warmup`` that neither compiled nor captured a CUDA graph
(graph modes capture each new bucket shape the first time it comes, possibly after the warm-up;
such steps are counted in the cell and their excess time goes to the compile time): real tokens/s,
peak GiB (``max_memory_allocated``), MFU = model FLOPs incl. attention / ``--peak-tflops`` (790 on
the H200, as measured; elsewhere the GPU's dense bf16 spec peak), the padding share of the
tensors, and the per-step loss. Loss equality: each mode's per-step losses against
``padded_sdpa`` (same examples, same order). ``--repeats R`` runs every
cell R times, interleaved across the modes of a batch size in alternating order (A B, B A, ...),
and the tables show the run of median tokens/s with the range: host-bound cells (batch 8 on the
1B shape) swing by 20-45% between runs of the same commit, so a single run per cell cannot rank
two modes that close.

Outputs (``--out``): ``results.json`` (streamed after every run), ``e2e_tables.md`` (the tables for
docs/BENCHMARKS.md), PNGs in ``--plots-dir`` (tokens/s vs batch size per mode, peak memory vs
batch size per mode, padding efficiency vs batch size, loss vs step and vs wall-clock per mode),
and with ``--profile`` one profiled step per model and profile mode in ``e2e_tables.md``: device
time by category, the top kernels and host ops (torch.profiler), the top Python functions of 5
more steps (cProfile: the host time between ops), the host-device syncs of one more step with
the frames that caused them, and where the host's wall time goes in ~3 s of more steps, sampled
by py-spy where it is installed (e2e_host_sampler: native frames and waits too, at a cost per
sample rather than per call).

    python scripts/bench_e2e.py --out runs/e2e --plots-dir docs          # the issue's table
    python scripts/bench_e2e.py --models qwen3-8b --layers 8 --batch-sizes 32,128
    python scripts/bench_e2e.py --padding-only --plots-dir docs          # data only, no GPU
    python scripts/bench_e2e.py --modes minimal_varlen-compile,hf_varlen-compile --batch-sizes 8 \
        --repeats 3                                                     # a host-bound ranking
    HF_VARLEN_PEER_SITE_UNSLOTH=/tmp/peers/unsloth HF_VARLEN_PEER_SITE_TRL=/tmp/peers/trl \
        python scripts/bench_e2e.py --modes hf_varlen,unsloth,trl-sdpa,trl-liger --batch-sizes 8
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from e2e_inputs import (  # noqa: E402
    export_batches,
    padding_rows,
    prepare_dataset,
    prepare_model_dir,
)
from e2e_measure import (  # noqa: E402
    default_peak_tflops,
    gpu_busy,
    profile_step,
    recompile_reasons,
    trainer_records,
)
from e2e_modes import (  # noqa: E402  (what each mode is; no torch: cheap)
    BENCH_ONLY,
    DEFAULT_MODES,
    MINIMAL_ATTN,
    MODES,
    mode_unavailable,
)

SHARED = ROOT.parent / "shared" / "data"
# --------------------------------------------------------------------------------------------- #
# The floor: the simplest varlen attention anyone could register with transformers.


@functools.cache
def _varlen_attn_has_gqa() -> bool:
    """Whether torch's ``varlen_attn`` takes ``enable_gqa`` (torch 2.13 does, 2.11 does not); asked
    once, so the floor pays no per-call ``inspect.signature``."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def minimal_varlen_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Packed (1, H, T, D) q/k/v -> torch ``varlen_attn`` over ``cu_seq_lens_q`` -> (1, T, H, D)."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    extra = {}
    if _varlen_attn_has_gqa():
        extra["enable_gqa"] = True
    else:  # torch 2.11: no GQA flag, expand the KV heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu, n = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, n, n, scale=scaling, window_size=(-1, 0), **extra)
    return out.unsqueeze(0), None


def register_minimal_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(MINIMAL_ATTN, minimal_varlen_attention)
    AttentionMaskInterface.register(MINIMAL_ATTN, flash_attention_mask)


def liger_hook(model) -> None:
    import liger_kernel.transformers as liger

    patch = getattr(liger, f"apply_liger_kernel_to_{model.config.model_type}", None)
    if patch is None:
        raise ValueError(f"liger-kernel has no patch for model type {model.config.model_type!r}")
    patch(model=model)


# --------------------------------------------------------------------------------------------- #
# One configuration (runs inside its own process).


def train_config(run: dict, device: str):
    from hf_varlen.training import TrainConfig

    spec = {k: v for k, v in MODES[run["mode"]].items() if k not in BENCH_ONLY}
    # Each mode is what it names: the eager step unless it asks for graphs (the default is auto).
    spec = {"cuda_graphs": "off", "static_shapes": False, **spec}
    if device != "cuda" and spec.get("fused_kernels") == "on":
        spec["fused_kernels"] = "auto"  # CPU smoke runs: the layer kernels are GPU kernels
    if device != "cuda" and spec.get("cuda_graphs") == "on":
        spec["cuda_graphs"] = "auto"  # CPU smoke runs: graphs need CUDA (auto says so)
    overrides = f"num_hidden_layers={run['layers']}" if run.get("layers") else None
    if run.get("model_dir"):  # the folder every mode and peer loads (its layers already cut)
        overrides = None
    return TrainConfig(
        model=run.get("model_dir") or run["model"],
        tokenizer=run["tokenizer"],
        config_overrides=overrides,
        dataset=run["dataset"],
        format="alpaca",
        max_length=run["max_length"],
        batch_size=run["batch_size"],
        max_steps=run["steps"],
        lr=run["lr"],
        warmup_steps=0,
        lr_schedule="constant",
        max_grad_norm=1.0,
        # a 4-bit base computes in bf16 whatever the row's precision (hf-varlen train refuses else)
        precision="bf16" if spec.get("load_in_4bit") else run["precision"],
        seed=run["seed"],
        output_dir=run["run_dir"],
        overwrite_output_dir=True,  # a benchmark re-run replaces its earlier runs
        save_final=False,
        progress=False,
        peak_tflops=run["peak_tflops"],
        **(
            {"compile_backend": run.get("compile_backend", "inductor")}
            if spec.get("compile")
            else {}
        ),
        **spec,
    )


def run_one(run: dict, fresh_dynamo: bool = True) -> dict:
    """Train one configuration; return its metrics (``status`` "ok", "OOM" or "skipped: why").
    ``fresh_dynamo=False`` (a worker's later cells) keeps dynamo's compiled code of earlier cells."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures

    from hf_varlen.training import PackedTrainer

    register_minimal_attention()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if why := mode_unavailable(run["mode"], device):
        return {"status": f"skipped: {why}"}
    hook = liger_hook if MODES[run["mode"]].get("liger") else None
    if fresh_dynamo:  # --no-isolate: each run compiles and counts on its own
        torch._dynamo.reset()
    counters.clear()  # a worker's later cell counts only its own (re)compilations
    guard_failures.clear()
    try:
        trainer = PackedTrainer(train_config(run, device), model_hook=hook)
        if MODES[run["mode"]].get("plain_compile"):
            plain_compile(trainer)
        if run.get("profile"):
            return profile_step(trainer, run)
        trainer.run()
        try:  # a diagnostic after the timed steps: its failure must not lose the cell's numbers
            busy = gpu_busy(trainer) if device == "cuda" else {}
        except Exception as exc:  # recorded in the cell (and shown by the report), not hidden
            busy = {"gpu_busy_error": f"{type(exc).__name__}: {exc}"[:300]}
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    records = trainer_records(run["run_dir"])
    # Steady state: the steps after the warm-up that neither compiled nor captured a CUDA graph
    # (a new bucket shape seen late); those are counted in the cell, their time in compile_s.
    timed = records[run["warmup"] :] or records
    steady = [r for r in timed if not _unsteady(r)] or timed
    seconds = sum(r["step_time"] for r in steady)
    tokens = sum(r["real_tokens"] for r in steady)
    tflops = sum(r["tflops_per_s"] * r["step_time"] for r in steady) / seconds
    return {
        "status": "ok",
        "tokens_per_s": tokens / seconds,
        "tokens_per_step": tokens / len(steady),
        "step_ms": 1e3 * seconds / len(steady),
        "peak_gib": max(r["peak_mem_gib"] for r in records),
        "tflops_per_s": tflops,
        "mfu": tflops / run["peak_tflops"] if run["peak_tflops"] else None,
        "excluded_steps": len(timed) - len(steady),
        "padding_efficiency": sum(r["real_tokens"] for r in records)
        / sum(r["tensor_tokens"] for r in records),
        "losses": [r["loss"] for r in records],
        "elapsed": [r["elapsed"] for r in records],
        "kernels": trainer.kernels,
        "precision_policy": precision_policy(run, trainer.precision),
        "params": trainer.params,
        **({"cuda_graphs": graphs["text"]} if (graphs := trainer.graphs_summary()) else {}),
        **compile_stats(run, records, steady),
        **busy,
    }


def precision_policy(run: dict, precision: str) -> str:
    """What a row's numbers were trained in, in the peers' words (e2e_peers._policy)."""
    text = {
        "bf16": "bf16 weights and math",
        "bf16-mixed": "fp32 weights + bf16 autocast",
    }.get(precision, precision)
    spec = MODES[run["mode"]]
    if spec.get("load_in_4bit"):
        text = "NF4 base, bf16 compute"
    return text + ("; LoRA adapters as peft creates them" if spec.get("lora") else "")


def plain_compile(trainer, backend: str = "inductor") -> None:
    """``torch.compile(model)`` in place, as the integration's user writes it, with Inductor
    unchanged behind a backend that counts each compilation into the trainer's counter: a timed
    step that recompiles (a new dynamic-shape range) is then left out of the steady state and
    counted in the compile time, as for our compiled modes, instead of weighing on its tokens/s."""
    import torch

    real = torch._dynamo.lookup_backend(backend)

    def counted(gm, example_inputs):
        trainer.compiler.compilations += 1
        return real(gm, example_inputs)

    trainer.acc.unwrap_model(trainer.model).compile(backend=counted)


def _unsteady(record: dict) -> bool:
    """Whether a step compiled or captured CUDA graphs (its time is not the steady step's)."""
    return bool(record.get("compilations") or record.get("captures"))


def compile_stats(run: dict, records: list[dict], steady: list[dict]) -> dict:
    """Per-cell compile numbers of a compile mode (empty for eager modes)."""
    spec = MODES[run["mode"]]
    if not (spec.get("compile") or spec.get("plain_compile")):
        return {}
    from torch._dynamo.utils import counters

    step = sum(r["step_time"] for r in steady) / len(steady)
    # The warm-up steps and any later step that compiled or captured: their excess over the
    # steady step.
    extra = records[: run["warmup"]] + [r for r in records[run["warmup"] :] if _unsteady(r)]
    return {
        "compilations": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "first_step_s": records[0]["step_time"],
        "compile_s": sum(max(0.0, r["step_time"] - step) for r in extra),
        "recompile_reasons": recompile_reasons(),
    }


# --------------------------------------------------------------------------------------------- #
# The driver.


def model_dirs(args, precision: str, cache: Path) -> dict[str, str]:
    """The saved model of each ``--models`` entry (a preset's random init; a local folder as it
    is). On a GPU each is built in a process of its own, so this one holds no CUDA context."""
    from hf_varlen.training.builtin import PRESETS

    dirs = {}
    for model in args.models:
        if model not in PRESETS:
            dirs[model] = model
            continue
        layers = f"_{args.layers}layers" if args.layers else ""
        spec = dict(model=model, layers=args.layers, tokenizer=args.tokenizer,
                    precision=precision, seed=args.seed)  # fmt: skip
        spec["dir"] = str(cache / "models" / f"{model}{layers}_{precision}_seed{args.seed}")
        if args.isolate:
            cmd = [sys.executable, __file__, "--prepare-model", json.dumps(spec)]
            subprocess.run(cmd, check=True)
            dirs[model] = spec["dir"]
        else:
            dirs[model] = prepare_model_dir(spec)
    return dirs


def peer_spawn(compile_dir: Path):
    """e2e_workers.WorkerPool's ``spawn`` for the peers: e2e_peers.py in the peer's environment."""
    import os

    from e2e_peers import peer_command, peer_env

    def spawn(run: dict) -> tuple[list[str], dict]:
        compile_dir.mkdir(parents=True, exist_ok=True)
        return peer_command(), peer_env(run["mode"], dict(os.environ), str(compile_dir))

    return spawn


def launch(run: dict, *, isolate: bool, timeout: float, pool=None, peer_pool=None) -> dict:
    if MODES[run["mode"]].get("peer"):  # always a worker of its own environment
        return peer_pool.run(run, timeout)
    if not isolate:
        return run_one(run)
    if pool is not None:
        return pool.run(run, timeout)
    result_path = Path(run["run_dir"]) / "result.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--one", json.dumps(run), "--result", str(result_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:.0f} s"}
    if proc.returncode != 0 or not result_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "error: " + " | ".join(tail)}
    return json.loads(result_path.read_text())


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=csv(str), default=["llama-1b"], help="trainer presets or paths")
    p.add_argument("--layers", type=int, default=None, help="cut every model to this many layers")
    p.add_argument("--data", type=csv(str), default=["alpaca"], help="alpaca, mix, or a file")
    p.add_argument("--max-lengths", type=csv(int), default=[1024])
    p.add_argument("--batch-sizes", type=csv(int), default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--modes", type=csv(str), default=DEFAULT_MODES.split(","))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per cell, interleaved across the modes; tables show the median and the range",
    )
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="default: 790 on an H200 (measured), else the GPU's spec peak",
    )
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "qwen2"))
    p.add_argument("--alpaca", default=str(SHARED / "alpaca" / "alpaca_5000.json"))
    p.add_argument("--lima", default=str(SHARED / "lima" / "lima.json"))
    p.add_argument("--out", default="runs/bench_e2e")
    p.add_argument("--plots-dir", default=None, help="where the PNGs go (default: --out)")
    p.add_argument(
        "--profile", action="store_true", help="also profile one step per model and profile mode"
    )
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument(
        "--profile-modes",
        type=csv(str),
        default=["hf_varlen"],
        help="the modes --profile profiles (compiled ones after their warm-up compiles)",
    )
    p.add_argument("--padding-only", action="store_true", help="only the data-only padding table")
    p.add_argument(
        "--no-isolate", dest="isolate", action="store_false", help="runs in this process"
    )
    p.add_argument(
        "--process-per-cell",
        action="store_true",
        help="a fresh process for every cell (default: one worker process per model and mode)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of hf_varlen-compile (aot_eager: CPU smoke runs)",
    )
    p.add_argument(
        "--model-cache",
        default=None,
        help="where the saved random-init models and the peers' batch files go (default: "
        "OUT/cache; keep it out of a folder that is copied back)",
    )
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=None,
        help="flag a mode whose per-step losses differ by more than this (relative) from the "
        "reference mode's; default: 2 x the spread among our own modes + 2 x the precision's "
        "unit roundoff",
    )
    p.add_argument("--prepare-model", help=argparse.SUPPRESS)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [m for m in args.modes + args.profile_modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; known: {list(MODES)}")
    peers = [m for m in args.profile_modes if MODES[m].get("peer")]
    if args.profile and peers:
        p.error(f"--profile-modes: {peers} are peers (their cells carry GPU busy and attention)")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be >= 1")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be < --steps {args.steps}")
    return args


def run_grid(args) -> list[dict]:
    """The runs in order: per model, data, length and batch size, ``--repeats`` rounds of every
    mode, then one profile per model and profile mode. Repeats interleave and alternate their
    order (A B, B A, A B: not A A B B, nor A B A B), so a drift of the host's speed during the run
    reaches every mode of a batch size alike: in A B A B the second mode always runs later (on the
    H200 at batch 8 both modes' steps slowed ~30% from the first round to the third)."""
    keys = ("model", "data", "max_length", "batch_size", "repeat", "mode")
    grid = itertools.product(args.models, args.data, args.max_lengths, args.batch_sizes)
    runs = [
        dict(zip(keys, (*cell, r, mode), strict=True))
        for cell in grid
        for r in range(args.repeats)
        for mode in (args.modes if r % 2 == 0 else args.modes[::-1])
    ]
    if args.profile:
        first = dict(data=args.data[0], max_length=args.max_lengths[0])
        for model, mode in itertools.product(args.models, args.profile_modes):
            runs.append(dict(model=model, **first, batch_size=args.profile_batch, mode=mode))
            runs[-1]["profile"] = True
    return runs


def run_cells(runs: list[dict], common: dict, datasets: dict, args, out: Path, record, pools,
              models: dict[str, str], cache: Path):  # fmt: skip
    """Run the grid's cells in order; ``record(result)`` after each (results.json is streamed).
    ``common``: the fields every run shares (precision, peak, ...); ``datasets``: paths by name;
    ``pools``: (our modes' worker pool or None, the peers' or None); ``models``: the saved model
    folder of each model; ``cache``: where the peers' batch files go."""
    from e2e_report import fmt_cell

    for i, run in enumerate(runs):
        repeated = args.repeats > 1 and "repeat" in run  # profiles run once
        rep = f"_r{run['repeat']}" if repeated else ""
        rep_note = f" repeat {run['repeat'] + 1}/{args.repeats}" if repeated else ""
        name = f"run{i:03d}_{run['model']}_{run['data']}_L{run['max_length']}"
        run.update(
            common,
            dataset=datasets[run["data"]],
            run_dir=str(out / f"{name}_B{run['batch_size']}_{run['mode']}{rep}"),
            model_dir=models[run["model"]],
        )
        if MODES[run["mode"]].get("peer"):
            run.update(peer=True, batches_path=export_batches(run, cache))
        t0 = time.perf_counter()
        pool, peer_pool = pools
        result = launch(
            run, isolate=args.isolate, timeout=args.timeout, pool=pool, peer_pool=peer_pool
        )
        result["run"] = run
        record(result)
        print(
            f"[{i + 1}/{len(runs)}] {run['model']} {run['data']} L{run['max_length']} "
            f"B{run['batch_size']} {run['mode']}{' (profile)' if run.get('profile') else ''}"
            f"{rep_note}: {fmt_cell(result)} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.prepare_model:
        prepare_model_dir(json.loads(args.prepare_model))
        return []
    if args.serve:  # a worker of e2e_workers.WorkerPool
        from e2e_workers import serve

        serve(run_one)
        return []
    if args.one:
        result = run_one(json.loads(args.one))
        Path(args.result).write_text(json.dumps(result))
        return [result]

    import torch
    from bench_common import run_header
    from e2e_report import check_losses, write_plots, write_tables

    cuda = torch.cuda.is_available()
    precision = args.precision or ("bf16" if cuda else "fp32")
    peak = args.peak_tflops if args.peak_tflops is not None else default_peak_tflops(cuda)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = run_header(
        precision=precision, steps=args.steps, warmup=args.warmup, layers=args.layers
    )
    print(json.dumps(header), flush=True)
    cache = Path(args.model_cache) if args.model_cache else out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    # the alpaca + lima mix file beside the saved models: data, not results to copy back
    datasets = {d: prepare_dataset(d, args, cache) for d in args.data}
    padding = padding_rows(args, datasets)
    results: list[dict] = []
    runs: list[dict] = []
    if not args.padding_only:
        runs = run_grid(args)
    from e2e_workers import WorkerPool

    models = model_dirs(args, precision, cache) if runs else {}
    pool = peer_pool = None
    if args.isolate and not args.process_per_cell and runs:
        pool = WorkerPool(Path(__file__), out / "workers")
    if any(MODES[r["mode"]].get("peer") for r in runs):
        peer_pool = WorkerPool(Path(__file__), out / "workers", spawn=peer_spawn(cache / "unsloth"))
    common = dict(
        tokenizer=args.tokenizer,
        layers=args.layers,
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        seed=args.seed,
        precision=precision,
        peak_tflops=peak,
        compile_backend=args.compile_backend,
    )

    def record(result: dict) -> None:
        results.append(result)
        (out / "results.json").write_text(
            json.dumps({"header": header, "padding": padding, "results": results}, indent=1)
        )

    try:
        run_cells(runs, common, datasets, args, out, record, (pool, peer_pool), models, cache)
    finally:
        for each in (pool, peer_pool):
            if each is not None:
                each.close()
    check_losses(results, args.loss_rtol)  # annotates every cell with its "loss_check"
    (out / "results.json").write_text(
        json.dumps({"header": header, "padding": padding, "results": results}, indent=1)
    )
    write_tables(results, padding, header, out / "e2e_tables.md")
    plots = write_plots(results, padding, Path(args.plots_dir or out))
    print(f"tables: {out / 'e2e_tables.md'}; plots: {', '.join(plots)}", flush=True)
    return results


if __name__ == "__main__":
    main()
