"""The host side of a profiled bench_e2e step: where its Python time goes (cProfile) and where it
waits for the GPU (torch's sync debug mode). torch.profiler, in e2e_measure.profile_step, sees the
ops; these see what lies between them.
"""

from __future__ import annotations

import time
from pathlib import Path

SYNC_WARNING = "called a synchronizing CUDA operation"


def sync_points(trainer, slot) -> dict:
    """Where one more step waits for the GPU: torch's sync debug mode warns at every implicit
    host-device synchronisation (``.item()``, a blocking copy, ``nonzero``); each is recorded with
    the Python frames that caused it. A hidden sync mid-step stops the host from running ahead of
    the GPU, which a host-bound step pays for in full. Empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        syncs = capture_syncs(lambda: trainer.train_step([slot]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"sync_points": syncs}


def capture_syncs(fn) -> list[tuple[int, str]]:
    """Run ``fn``; (count, innermost Python frames) per distinct place that raised the sync-debug
    warning, most frequent first."""
    import traceback
    import warnings

    counts: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return
        frames = [
            f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")
        ]
        where = " < ".join(f"{_short(f.filename)}:{f.lineno}({f.name})" for f in frames[::-1][:4])
        counts[where] = counts.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        fn()
    return sorted(((n, where) for where, n in counts.items()), reverse=True)


def _short(path: str) -> str:
    """The last two parts of a source path (``torch/_dynamo/eval_frame.py`` -> ``_dynamo/..``)."""
    return "/".join(Path(path).parts[-2:])


PYTHON_STEPS = 5  # steps under cProfile: enough to average, few enough for a short cell


def python_profile(trainer, slots: list, first: int) -> dict:
    """Where the host's Python time goes in ``PYTHON_STEPS`` more steps, under cProfile only.

    torch.profiler sees ops, not the Python between them (a compiled graph's guards and runtime
    wrappers, our op wrappers, the trainer's bookkeeping); this is the other half. cProfile adds a
    cost per Python call, so compare modes with each other. Per step: wall ms, and the top
    functions by own time (ms per step, calls per step, where)."""
    import cProfile
    import pstats

    import torch

    groups = [[slots[(first + i) % len(slots)]] for i in range(PYTHON_STEPS)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for group in groups:
        trainer.train_step(group)
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, prim, tottime, cumtime, ..)
    rows = sorted(
        (
            (tt, calls, f"{_short(f)}:{line}({name})")
            for (f, line, name), (calls, _, tt, *_) in stats.items()
        ),
        reverse=True,
    )
    n = len(groups)
    return {
        "python_step_ms": 1e3 * wall / n,
        "python_ms": 1e3 * sum(tt for tt, _, _ in rows) / n,
        "python_calls": sum(c for _, c, _ in rows) / n,
        "python_top": [(1e3 * tt / n, c / n, where[:120]) for tt, c, where in rows[:30]],
    }
