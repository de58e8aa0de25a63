"""``hf-varlen train --profile-step N``: one optimizer step under torch.profiler, its time split
into compute and communication.

Every rank profiles its step N and writes, under OUTPUT_DIR/profile/:

- ``step<N>_rank<r>.json``: the step's wall time, and on the clock that does the work (GPU kernels
  on CUDA, CPU ops on the CPU) the time covered by compute, by communication (collectives: NCCL
  kernels, gloo / c10d ops) and, on CUDA, the communication no compute kernel overlaps (exposed:
  what a rank waits for) and the time the GPU runs nothing (idle: host work, syncs); the top
  compute kernels and collectives.
- ``step<N>_rank<r>.trace.json.gz``: the Chrome / Perfetto trace of the step.

Times are unions of intervals, so kernels of one kind that overlap (streams) count once. On
several CPU processes gloo does the collectives' work, and the waits for it, on threads of its
own, outside any op, so the CPU cannot split communication from compute (the summary line says
so). On one CPU process ``exposed`` and ``idle`` are None (ops nest; there
is no device timeline). The profiled step's record carries ``profiled`` and the summary's
throughput leaves it out.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import time
from typing import Any

import torch

from .config import PROFILE_DIR

COMM = re.compile(
    r"nccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|broadcast",
    re.IGNORECASE,
)
TOP = 8  # kernels / collectives listed per kind


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length (ms) of the union of [start, end) intervals given in microseconds."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def minus_ms(these: list[tuple[float, float]], those: list[tuple[float, float]]) -> float:
    """Length (ms) of union(these) not covered by union(those) (intervals in microseconds)."""
    return union_ms(these + those) - union_ms(those)


def split_events(events: list[tuple[str, float, float]]) -> dict[str, Any]:
    """``events`` (name, start us, end us) of the work clock, split into compute and
    communication: interval unions (ms), exposed communication (ms), and the top names by time."""
    is_comm = {name: bool(COMM.search(name)) for name, _, _ in events}
    comm = [(a, b) for name, a, b in events if is_comm[name]]
    compute = [(a, b) for name, a, b in events if not is_comm[name]]

    def top(want_comm: bool) -> list[list]:
        by: dict[str, float] = {}
        for name, a, b in events:
            if is_comm[name] == want_comm:
                by[name] = by.get(name, 0.0) + (b - a) / 1e3
        return [[ms, name[:120]] for name, ms in sorted(by.items(), key=lambda x: -x[1])[:TOP]]

    return {
        "compute_ms": union_ms(compute),
        "comm_ms": union_ms(comm),
        "comm_exposed_ms": minus_ms(comm, compute),
        "busy_ms": union_ms(compute + comm),
        "top_compute": top(False),
        "top_comm": top(True),
    }


def _work_events(prof, on_gpu: bool) -> list[tuple[str, float, float]]:
    """(name, start, end) of the GPU kernels (user annotations on the device timeline left out:
    they would cover the kernels inside them), or of every CPU op."""
    out = []
    for e in prof.events():
        if on_gpu:
            if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation:
                continue
        elif e.device_type != torch.autograd.DeviceType.CPU or e.is_user_annotation:
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def summarize_profile(prof, wall_s: float, on_gpu: bool) -> dict[str, Any]:
    """The step's numbers (module docstring) from a finished profiler."""
    split = split_events(_work_events(prof, on_gpu))
    wall_ms = 1e3 * wall_s
    if not on_gpu:  # nested CPU ops: only the collectives' own time means something
        split["comm_exposed_ms"] = None
    return {
        "clock": "GPU kernels" if on_gpu else "CPU ops",
        "step_ms": wall_ms,
        **split,
        "idle_ms": max(0.0, wall_ms - split["busy_ms"]) if on_gpu else None,
    }


def profile_text(p: dict[str, Any]) -> str:
    head = f"step {p['step']} of rank {p['rank']}: {p['step_ms']:.1f} ms wall, "
    if p["clock"] == "CPU ops":  # gloo works and waits on threads of its own, outside any op
        return head + (
            f"CPU ops {p['compute_ms']:.1f} ms, collective calls {p['comm_ms']:.1f} ms (their "
            f"work runs on gloo's threads: the communication split needs CUDA); {p['path']}"
        )
    return head + (
        f"GPU compute {p['compute_ms']:.1f} ms, communication {p['comm_ms']:.1f} ms "
        f"({p['comm_exposed_ms']:.1f} ms not overlapped by compute), GPU idle "
        f"{p['idle_ms']:.1f} ms; {p['path']}"
    )


class StepProfiler:
    """Profiles optimizer step ``step`` (1-based) of this rank when it runs: ``around(step)`` is a
    context manager that profiles only that step and writes its files on exit."""

    def __init__(
        self,
        step: int | None,
        total_steps: int,
        output_dir: str,
        rank: int,
        device: torch.device,
    ):
        if step is not None and step > total_steps:
            raise ValueError(
                f"--profile-step {step}: the run has {total_steps} steps; pick one of them (or "
                "raise --max-steps)"
            )
        self.step, self.rank, self.device = step, rank, device
        self.dir = os.path.join(output_dir, PROFILE_DIR)
        self.result: dict[str, Any] | None = None

    def check_resume(self, resumed_step: int) -> None:
        """A run resumed after ``resumed_step`` never runs the steps up to it: refuse those."""
        if self.step is not None and self.step <= resumed_step:
            raise ValueError(
                f"--profile-step {self.step}: the run resumes after step {resumed_step}, so that "
                "step will not run; pick a later one"
            )

    @contextlib.contextmanager
    def around(self, step: int):
        if step != self.step:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        on_gpu = self.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        if on_gpu:
            torch.cuda.synchronize(self.device)  # the step starts with the GPU idle
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            yield
            if on_gpu:  # the update's kernels, launched after the step's read-back
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - t0
        self.result = self._write(prof, wall, on_gpu)

    def _write(self, prof, wall: float, on_gpu: bool) -> dict[str, Any]:
        os.makedirs(self.dir, exist_ok=True)
        stem = os.path.join(self.dir, f"step{self.step}_rank{self.rank}")
        result = {
            "step": self.step,
            "rank": self.rank,
            **summarize_profile(prof, wall, on_gpu),
            "path": stem + ".json",
            "trace": stem + ".trace.json.gz",
        }
        plain = stem + ".trace.json"
        prof.export_chrome_trace(plain)
        with open(plain, "rb") as src, gzip.open(result["trace"], "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(plain)
        with open(result["path"], "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        result["text"] = profile_text(result)
        return result
