"""Long-lived benchmark workers for bench_e2e: one process per (model, mode), serving its cells
one after another.

A fresh process per cell paid Python's import of torch + transformers and CUDA's start-up again
for every cell (~9 s of a ~20 s eager cell on the H200) and, for compiled modes, a whole compile
per batch size. A worker pays them once: its later cells reuse the loaded modules and dynamo's
compiled code (a later cell compiles only what its shapes need; the first cell of a worker shows
the full compile time). Modes stay isolated from each other (process-wide patches such as
kernel-hub RoPE or Liger never reach another mode), and the parent still sends the cells in the
grid's order (the modes of a batch size one after another), so a drift of the host's speed
during a call reaches every mode alike. Between cells a worker frees the finished cell's memory
(gc, then the CUDA caching allocator's blocks), and the trainer resets the peak-memory counter
every step, so a cell's peak is its own.

Protocol: the parent writes one JSON run per line to the worker's stdin; the worker writes the
cell's result to ``<run_dir>/result.json`` (atomically). A worker whose cell ended in an error, an
OOM or a timeout is stopped (its CUDA state is not trusted further); the next cell of its mode
starts a new one. Worker output goes to ``<log_dir>/<model>_<mode>.log``.

A peer mode (e2e_peers: Unsloth, TRL) runs another script in another environment: ``spawn(run)``
gives the command and the environment of a run's worker (default: ``script --serve`` in this
process's environment).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

POLL_S = 0.2


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the parent dies, so a benchmark killed by
    its step timeout leaves no worker holding the GPU."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _trusted(result: dict) -> bool:
    """Whether the worker may serve another cell after this result."""
    status = result.get("status", "")
    return status == "ok" or status.startswith("skipped")


class WorkerPool:
    """Runs cells in per-(model, mode) worker processes of ``script --serve``."""

    def __init__(
        self,
        script: Path,
        log_dir: Path,
        spawn: Callable[[dict], tuple[list[str], dict | None]] | None = None,
    ):
        self.script = Path(script)
        self.log_dir = Path(log_dir)
        self.spawn = spawn or (lambda run: ([sys.executable, str(self.script), "--serve"], None))
        self.workers: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def _start(self, key: str, run: dict) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{key}.log"
        self.logs[key] = log
        command, env = self.spawn(run)
        with open(log, "a") as sink:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.PIPE,
                stdout=sink,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.workers[key] = proc
        return proc

    def _tail(self, key: str, lines: int = 3) -> str:
        text = self.logs[key].read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "worker exited with no output"

    def _stop(self, key: str) -> None:
        proc = self.workers.pop(key, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def run(self, run: dict, timeout: float) -> dict:
        """One cell in its mode's worker; ``status`` "ok", "OOM", "skipped: why", "error: ..."
        or "timeout after N s", as a fresh process per cell would report."""
        key = f"{run['model']}_{run['mode']}".replace("/", "_")
        proc = self.workers.get(key)
        if proc is None or proc.poll() is not None:
            proc = self._start(key, run)
        result_path = Path(run["run_dir"]) / "result.json"
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.unlink(missing_ok=True)
        try:
            proc.stdin.write(json.dumps(run) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died between cells: reported below from its log
        deadline = time.monotonic() + timeout
        while not result_path.exists():
            if proc.poll() is not None:
                self.workers.pop(key, None)
                return {"status": "error: " + self._tail(key)}
            if time.monotonic() > deadline:
                self._stop(key)
                return {"status": f"timeout after {timeout:.0f} s"}
            time.sleep(POLL_S)
        result = json.loads(result_path.read_text())
        if not _trusted(result):
            self._stop(key)
        return result

    def close(self, grace_s: float = 30.0) -> None:
        """End every worker: stdin closed (its loop ends), killed after ``grace_s``."""
        for key, proc in list(self.workers.items()):
            with contextlib.suppress(OSError):  # already gone
                proc.stdin.close()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._stop(key)
        self.workers.clear()


def serve(run_one: Callable[..., dict], requests: Iterable[str] = sys.stdin) -> None:
    """The worker's loop: one cell per request line, its result written to its run folder.
    ``run_one(run, fresh_dynamo=...)`` resets dynamo only for the worker's first cell."""
    import gc

    import torch

    for cell, line in enumerate(requests):
        run = json.loads(line)
        try:
            result = run_one(run, fresh_dynamo=cell == 0)
        except Exception as exc:  # the message in the cell, the traceback in the worker log
            traceback.print_exc()
            result = {"status": f"error: {type(exc).__name__}: {exc}"[:400]}
        result["worker_cell"] = cell  # 0: this cell paid the process's start-up and compiles
        path = Path(run["run_dir"]) / "result.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)  # the parent never reads half a file
        sys.stdout.flush()
        gc.collect()  # the cell's trainer, graphs and activations, before the next cell
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if not _trusted(result):
            return
