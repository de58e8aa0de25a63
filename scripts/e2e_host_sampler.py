"""Where a profiled bench_e2e step's host wall time goes, from py-spy samples of this process.

torch.profiler (e2e_measure.profile_step) sees ops and cProfile (e2e_host_profile) sees Python
calls, and both slow the host by a cost per event, which falls unevenly on two modes that launch
different mixes of work. A sampler costs per sample instead, and sees everything the thread does:
Python frames, native frames below them (a CUDA sync, the garbage collector, the dispatcher), and
time spent waiting. ``sampled_profile`` attaches ``py-spy record --native --idle --threads`` to
this process for ~``SAMPLED_SECONDS`` of more steps and files every main-thread sample taken inside
``train_step`` under one category: the innermost Python frame's package, or a native wait / sync /
collection below it. Other threads (the autograd engine's device thread runs a CUDA backward) are
reported by their busy samples.

py-spy pauses the process for each sample (blocking mode, needed for native frames) while it
unwinds the stack, so a sampled step is slower than an unsampled one: the report gives the step's
wall time while sampling, to set against the cell's own step time. The pauses stop the host, not
the GPU, so they shorten waits for the GPU; compare modes with each other, on an otherwise idle
machine (a sampled tiny-model CPU step took 1.9x its unsampled time on 2 idle cores, 12x on 2
busy ones). Where py-spy is missing or cannot attach (no ptrace permission), the result says so
and nothing fails.

Raw format (``--format raw --threads``), one line per distinct stack, root first:

    thread (TID): NAME;frame;frame;...;leaf COUNT
    Python frame: ``func (path/file.py:LINE)``; native frame: ``symbol (libfoo.so)``
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

# Sample for about this long (at least MIN_STEPS steps, at most MAX_STEPS): ~300 samples, enough to
# tell a category of 10% of the step from 5% (a 45 ms batch-8 step: ~65 steps). A low rate, since
# each sample pauses the process while py-spy unwinds its native stack (module doc).
SAMPLED_SECONDS = 3.0
MIN_STEPS, MAX_STEPS = 5, 100
RATE = 100  # samples per second

_PY_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*\.py|<[^>]+>):(?P<line>\d+)\)$")
_STEP_FRAME = re.compile(r"(^|\.)train_step \(")  # py-spy prints qualified names (Class.method)

# Native frames below the innermost Python frame that name what the thread waits for.
_NATIVE = (
    ("waiting for the GPU (sync)", r"Synchronize|_local_scalar_dense|cuMemcpyDtoH|cudaMemcpy\b"),
    ("garbage collection", r"gc_collect|collect_main|_PyGC_|deduce_unreachable|collect_with_cal"),
    ("waiting for the GIL", r"take_gil"),
)
_IDLE = re.compile(
    r"pthread_cond_(timed)?wait|futex|epoll_wait|\bpoll\b|\bselect\b|nanosleep|sem_(timed)?wait|"
    r"PyThread_acquire_lock"
)
# The innermost Python frame's file, first match wins.
_PYTHON = (
    ("Inductor graph code (launch calls, allocations)", r"torchinductor_"),
    ("Triton launch (Python)", r"/triton/|_inductor/runtime/"),
    ("AOT autograd runtime", r"_functorch/"),
    ("dynamo (frame entry, guards)", r"_dynamo/"),
    ("autograd (Python)", r"torch/autograd/"),
    ("optimizer", r"torch/optim/"),
    ("gradient clipping", r"nn/utils/clip_grad"),
    ("op dispatch (Python)", r"torch/_library/|torch/_ops\.py|torch/_higher_order_ops/"),
    (
        "hf_varlen ops (Python)",
        r"hf_varlen/(ops|backends|integrations|reference)/|hf_varlen/[a-z_]+\.py",
    ),
    ("trainer", r"hf_varlen/training/"),
    ("transformers", r"transformers/"),
    ("accelerate", r"accelerate/"),
    ("nn.Module call", r"torch/nn/modules/"),
    ("benchmark", r"scripts/"),
)


def parse_raw(text: str) -> dict[str, list[tuple[list[str], int]]]:
    """Thread label ("TID NAME") -> [(frames root first, sample count)] of a raw py-spy file."""
    threads: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, _, rest = stack.partition(";")
        if head.startswith("thread ("):
            tid, _, name = head[len("thread (") :].partition("): ")
            label, frames = f"{tid} {name}".strip(), rest.split(";") if rest else []
        else:
            label, frames = "all threads", stack.split(";")
        threads[label].append((frames, int(count)))
    return dict(threads)


def _innermost_python(frames: list[str]) -> tuple[int, re.Match | None]:
    for i in range(len(frames) - 1, -1, -1):
        m = _PY_FRAME.match(frames[i])
        if m:
            return i, m
    return -1, None


def category(frames: list[str]) -> str:
    """What a sample was doing: a native wait, sync or collection below the innermost Python
    frame, or that frame's package (``_PYTHON``); idle leaves name the frame they wait in."""
    i, m = _innermost_python(frames)
    native = ";".join(frames[i + 1 :])
    for name, pattern in _NATIVE:
        if re.search(pattern, native):
            return name
    if m is None:
        return "native (no Python frame)"
    file = m["file"].replace("\\", "/")
    idle = bool(_IDLE.search(native))
    if idle and "torch/autograd/" in file:  # a CUDA backward runs on the engine's device thread
        return "backward: waiting for the autograd thread"
    for name, pattern in _PYTHON:
        if re.search(pattern, file):
            return f"{name}{' (idle wait)' if idle else ''}"
    return f"other: {Path(file).name}"


def leaf(frames: list[str]) -> str:
    """The innermost Python frame and the native frame the sample ended in, shortened."""
    i, m = _innermost_python(frames)
    py = f"{m['func']} ({'/'.join(Path(m['file']).parts[-2:])}:{m['line']})" if m else "-"
    native = frames[-1] if i < len(frames) - 1 else ""
    return f"{py}{' > ' + native.split(' (')[0][:60] if native else ''}"


def summarize(threads: dict, steps: int, rate: float) -> dict:
    """ms per step by category and by leaf for the thread running ``train_step``, and the same
    over the busy (non-idle) samples of every other thread that runs Python (on CUDA the autograd
    engine's device thread runs the backward while the step's thread waits for it)."""
    per_sample_ms = 1e3 / rate / steps

    def in_step(frames: list[str]) -> bool:
        return any(_STEP_FRAME.search(f) for f in frames)

    main = next((t for t, stacks in threads.items() if any(in_step(f) for f, _ in stacks)), None)
    if main is None:
        return {"sampled": "no sample inside train_step (the sampler saw no step)"}
    by_cat: Counter = Counter()
    by_leaf: Counter = Counter()
    for frames, n in threads[main]:
        if not in_step(frames):
            continue
        by_cat[category(frames)] += n
        by_leaf[leaf(frames)] += n
    others = {}
    for t, stacks in threads.items():
        if t == main:
            continue
        busy, busy_leaf = Counter(), Counter()
        for frames, n in stacks:
            if _innermost_python(frames)[1] is not None and not _IDLE.search(frames[-1]):
                busy[category(frames)] += n
                busy_leaf[leaf(frames)] += n
        if sum(busy.values()) * per_sample_ms >= 0.5:  # threads busy >= 0.5 ms a step
            others[t] = {
                "busy_ms": sum(busy.values()) * per_sample_ms,
                "by_category_ms": [(c, n * per_sample_ms) for c, n in busy.most_common()],
                "top": [(w, n * per_sample_ms) for w, n in busy_leaf.most_common(10)],
            }
    return {
        "sampled_step_ms": sum(by_cat.values()) * per_sample_ms,
        "sampled_by_category_ms": [(c, n * per_sample_ms) for c, n in by_cat.most_common()],
        "sampled_top": [(w, n * per_sample_ms) for w, n in by_leaf.most_common(20)],
        "sampled_threads": others,
    }


def _wait_attached(proc: subprocess.Popen, timeout: float) -> tuple[bool, str]:
    """(attached, py-spy's output so far): read its lines until the one it prints once sampling
    ("Sampling process ..."), its exit, or ``timeout`` seconds; a warning before it is kept."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0 and sel.select(left):
            line = proc.stdout.readline()
            if not line:  # py-spy exited
                break
            seen.append(line)
            if "Sampling" in line:
                return True, "".join(seen)
    finally:
        sel.close()
    return False, "".join(seen)


def sampled_profile(trainer, slots: list, first: int) -> dict:
    """More steps under py-spy for ~``SAMPLED_SECONDS`` (module doc); {"sampled": why} when it
    cannot run."""
    import torch

    exe = shutil.which("py-spy")
    if exe is None:
        return {"sampled": "not run: py-spy is not installed (pip install py-spy)"}
    fd, out = tempfile.mkstemp(prefix="hf_varlen_pyspy_", suffix=".txt")
    os.close(fd)
    cmd = [exe, "record", "--pid", str(os.getpid()), "--native", "--idle", "--threads"]
    cmd += ["--rate", str(RATE), "--format", "raw", "-o", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        attached, said = _wait_attached(proc, timeout=30.0)
        if not attached:
            proc.kill()
            rest = proc.communicate(timeout=30)[0]
            why = " ".join((said + rest).split())[:300] or "no output in 30 s"
            return {"sampled": f"not run: py-spy could not attach: {why}"}
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        steps = 0
        while steps < MIN_STEPS or (
            time.perf_counter() - t0 < SAMPLED_SECONDS and steps < MAX_STEPS
        ):
            trainer.train_step([slots[(first + steps) % len(slots)]])
            steps += 1
        sync()
        wall = time.perf_counter() - t0
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        proc.communicate(timeout=120)
        text = Path(out).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        Path(out).unlink(missing_ok=True)
    summary = summarize(parse_raw(text), steps, RATE)
    return {
        **summary,
        "sampled_steps": steps,
        "sampled_wall_step_ms": 1e3 * wall / steps,
        "sampled_rate": RATE,
    }
