"""What every benchmark script shares: the run header and a CUDA-event timer.

Imported by the scripts in this folder (``python scripts/bench_x.py`` puts the folder on sys.path).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import re
import subprocess
import time
from pathlib import Path

import torch

PEAK_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, measured (docs/BENCHMARKS.md, RoPE table)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_header(**extra) -> dict:
    """GPU, torch, triton, transformers, liger-kernel versions, git commit ($HF_VARLEN_COMMIT, else
    ``git rev-parse``; "uncommitted" when there is none), UTC date, plus ``extra`` fields."""
    # A copy of the tree made with `git archive` (as sent to the GPU machine) may sit inside a
    # checkout whose git metadata is stale: HF_VARLEN_COMMIT names the tree's real commit then.
    commit = os.environ.get("HF_VARLEN_COMMIT", "")
    try:
        commit = (
            commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger-kernel"),
        "commit": commit or "uncommitted",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        **extra,
    }


def is_device_kernel(event) -> bool:
    """Whether a profiler event is device work: a CUDA-timeline event that is not a user
    annotation. The profiler also puts ``record_function`` ranges on the device timeline (the
    optimizer's ``Optimizer.step#AdamW.step``, 6.8 ms of a batch-32 step), which would count the
    kernels inside them twice; torch's own table total leaves them out the same way."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(
        event, "is_user_annotation", False
    )


def device_kernel_seconds(prof) -> float:
    """Device kernel time of a finished ``torch.profiler.profile`` (one stream: no overlap)."""
    us = sum(
        getattr(e, "self_device_time_total", 0) or 0
        for e in prof.key_averages()
        if is_device_kernel(e)
    )
    return us / 1e6


# Kernel names of attention: torch's flash / memory-efficient / cuDNN kernels, FlashAttention,
# Triton ones named so (ours: _attn_fwd / _attn_bwd*), SDPA's math path shows as bmm + softmax.
ATTENTION_KERNEL = re.compile(r"attn|attention|flash|fmha|varlen|sdpa|cudnn.*mha", re.IGNORECASE)


def attention_kernels(prof, top: int = 6) -> list[tuple[str, int, float]]:
    """The attention kernels a profiled step really ran: (name, calls, ms), most time first; a
    step whose attention ran as plain matmuls + softmax (SDPA's math path) lists none."""
    rows = [
        (e.key[:120], int(e.count), (getattr(e, "self_device_time_total", 0) or 0) / 1e3)
        for e in prof.key_averages()
        if is_device_kernel(e) and ATTENTION_KERNEL.search(e.key)
    ]
    return sorted(rows, key=lambda r: -r[2])[:top]


def busy_share(step) -> dict:
    """Run ``step()`` (one training step) under a CUDA-only profiler trace (no CPU op tracing,
    which would slow the host): device kernel time over the step's wall time (``gpu_busy``), that
    wall time, and the attention kernels it ran. Kernels on several streams could overlap and
    count twice; a training step uses one."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {
        "gpu_busy": device_kernel_seconds(prof) / wall,
        "busy_step_ms": 1e3 * wall,
        "attention_kernels": attention_kernels(prof),
    }


def time_ms(fn, *, min_runs: int = 10, min_total_ms: float = 60.0) -> float:
    """Median GPU time of fn() over >= min_runs runs after warm-up, L2 flushed before each."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    n_runs = max(min_runs, math.ceil(min_total_ms / max(start.elapsed_time(end) / 3, 1e-3)))
    times = []
    for _ in range(n_runs):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_provider_report(title: str, key: str, note: str, head: dict, results, int_vs_long):
    """The provider and int32-vs-LONG_INDEXING tables shared by bench_glu / bench_rmsnorm.

    ``key`` names the row field that tells variants apart ("act", "style"); rows are the dicts
    those scripts build (provider, dir, ms, GB/s, pct_peak, speedups, fwd_match)."""
    print(f"## {title}\n")
    print(", ".join(f"{k}: {v}" for k, v in head.items()))
    print(f"\nbf16; % of {PEAK_BYTES_PER_S / 1e12:.1f} TB/s; {note}\n")
    print(f"| {key} | T | dir | provider | ms | GB/s | % peak | vs eager | vs Liger | fwd match |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "skipped" in r:
            print(f"| {r[key]} | {r['T']} | - | {r['provider']} | {r['skipped']} |||||")
            continue
        print(
            f"| {r[key]} | {r['T']} | {r['dir']} | {r['provider']} | {r['ms']:.3f} | "
            f"{r['GB/s']:.0f} | {r['pct_peak']:.1f} | {_fmt(r['speedup_vs_eager'])}x | "
            f"{_fmt(r['speedup_vs_liger'])}x | {'ok' if r['fwd_match'] else 'FAIL'} |"
        )
    if int_vs_long:
        print(f"\n| {key} | T | path | fwd ms | bwd ms |\n|---|---|---|---|---|")
        for r in int_vs_long:
            path = "LONG_INDEXING (forced)" if r["long_indexing"] else "int32"
            print(f"| {r[key]} | {r['T']} | {path} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} |")


def print_match_failures(key: str, results) -> None:
    for r in results:
        if r.get("fwd_match") is False:
            print(f"MATCH FAIL {r[key]} T={r['T']} {r['provider']}: {r['match_msg']}")


def bench_ms(fn, grad_to_none=None, min_runs=10, min_total_ms=100.0) -> float:
    """Median GPU time (CUDA events) of >= ``min_runs`` runs after 3 warm-ups, L2 flushed each run;
    a slow call (the 128K document: ~1 s per forward+backward) stops after 3 runs past 10x
    ``min_total_ms``, which keeps its median just as steady."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    times: list[float] = []
    for i in range(3 + 1000):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
            if len(times) >= min_runs and sum(times) >= min_total_ms:
                break
            if len(times) >= 3 and sum(times) >= 10 * min_total_ms:
                break
    times.sort()
    return times[len(times) // 2]
