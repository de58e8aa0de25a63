"""Run metrics: per-step records, the progress bar, the JSONL log, the summary, MFU and plots.

Per optimizer step (global over ranks; ``real`` = tokens of real examples, ``held`` = tokens the
input tensors hold, i.e. the tokens computed, padding included; ``padded`` = sum over micro-batches
of B x L_max, what the same examples hold padded to their longest; ``budget`` = real micro-batches
x the token budget, i.e. --tokens-per-batch or batch_size x max_length). One definition each:

    tokens_per_s        = real / step wall-clock
    packing_efficiency  = real / held      (1.0 for packed rows; the real share of --padded batches)
    padded_efficiency   = real / padded    (the real share had these micro-batches been padded)
    budget_fill         = real / budget    (how full the micro-batches are)
    model_flops         = flops_per_token * real + 6 * layers * (H_q * D) * sum_docs L^2
    mfu                 = model_flops / step time / (peak FLOP/s per device * processes)

``flops_per_token`` counts the linear layers (6 per trained weight, 4 per frozen one); the second
term is causal attention, forward + backward (3x the forward's 2 * L^2 * H_q * D per layer). The
peak is ``--peak-tflops`` or the dense bf16 peak of a known GPU; elsewhere MFU is not reported.

Files (main process only), in ``--output-dir``: ``metrics.jsonl`` (one JSON object per logged step
and per evaluation; strict JSON: a non-finite value, e.g. a skipped step's loss, is ``null``), ``summary.json``, and with ``--plot`` ``loss_vs_step.png``,
``loss_vs_time.png``, ``tokens_per_s.png``. ``plot_runs`` overlays several runs (packed vs padded).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from typing import Any

import torch

logger = logging.getLogger("hf_varlen.training")

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), matched against the CUDA device name.
_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("4090", 165.0),
    ("3090", 71.0),
)


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (CPU, unlisted GPU)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)  # bytes on macOS, KiB on Linux


def environment(device: torch.device) -> dict[str, str]:
    """Run header: hardware, library versions and the code's git commit ("uncommitted" if none)."""
    import subprocess

    import accelerate
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        threads = torch.get_num_threads()
        hardware = f"CPU, {threads} thread{'s' if threads != 1 else ''}"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "hardware": hardware,
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "commit": commit or "uncommitted",
    }


def _fmt_tokens(x: float) -> str:
    return f"{x / 1e3:.1f}K" if x < 1e6 else f"{x / 1e6:.2f}M"


class MetricsWriteError(RuntimeError):
    """metrics.jsonl could not be written (a full disk, a file system gone read-only)."""


def finite_or_none(value: Any) -> Any:
    """``value`` with NaN/inf floats as None, so that it is JSON (a bare NaN is not)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def json_line(record: dict[str, Any]) -> str:
    """One metrics.jsonl line: strict JSON, a non-finite number (a skipped step's loss) as null."""
    return json.dumps(finite_or_none(record), allow_nan=False) + "\n"


class RunLogger:
    """Collects step records; on the main process writes JSONL and drives the progress bar."""

    def __init__(
        self,
        output_dir: str,
        *,
        main: bool,
        total_steps: int,
        start_step: int,
        progress: bool,
        flops_per_token: float,
        attn_dims: tuple[int, int],
        peak: float | None,
        world: int,
        device: torch.device,
    ):
        self.main = main
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.flops_per_token = flops_per_token
        self.layers, self.attn_width = attn_dims
        self.peak_total = peak * world if peak else None
        self.device = device
        self.records: list[dict[str, Any]] = []
        self.bar = None
        if main:
            os.makedirs(output_dir, exist_ok=True)
            _truncate_log(self.path, start_step)
            if progress:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step")

    def step(self, **r: Any) -> dict[str, Any]:
        """Complete and record one step (``r`` holds the raw global counts); returns the record."""
        dt = max(r["step_time"], 1e-9)
        flops = (
            self.flops_per_token * r["real_tokens"]
            + 6.0 * self.layers * self.attn_width * r["attn_sq"]
        )
        r["tokens_per_s"] = r["real_tokens"] / dt
        r["packing_efficiency"] = r["real_tokens"] / max(r["tensor_tokens"], 1)
        r["padded_efficiency"] = r["real_tokens"] / max(r["padded_tokens"], 1)
        r["budget_fill"] = r["real_tokens"] / max(r["budget_tokens"], 1)
        r["tflops_per_s"] = flops / dt / 1e12
        r["mfu"] = flops / dt / self.peak_total if self.peak_total else None
        r["peak_mem_gib"] = peak_memory_gib(self.device)
        r.pop("attn_sq")
        self.records.append(r)
        if self.bar is not None:
            mfu = f" mfu={r['mfu']:.1%}" if r["mfu"] is not None else ""
            self.bar.set_postfix_str(
                f"loss={r['loss']:.4f} tok/s={_fmt_tokens(r['tokens_per_s'])} "
                f"eff={r['packing_efficiency']:.0%} mem={r['peak_mem_gib']:.2f}GiB{mfu}",
                refresh=False,
            )
            self.bar.update(1)
        return r

    def write(self, record: dict[str, Any]) -> None:
        if self.main:
            try:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(json_line(record))
            except OSError as exc:
                raise MetricsWriteError(
                    f"appending step {record.get('step')} to {self.path} failed: "
                    f"{exc.strerror or exc}; free space there (or choose another --output-dir) "
                    "and resume from the last checkpoint"
                ) from exc

    def message(self, text: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _truncate_log(path: str, keep_upto_step: int) -> None:
    """On resume keep the records up to the checkpoint's step (a crashed run may have more)."""
    if not os.path.exists(path):
        return
    if keep_upto_step == 0:
        os.remove(path)
        return
    kept = [r for r in _parse_log(path) if r.get("step", 0) <= keep_upto_step]
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json_line(r) for r in kept)


def _parse_log(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A torn last line (a run killed while writing it) is
    dropped with a warning; a damaged line before it is an error naming the line."""
    with open(path, encoding="utf-8") as fh:
        lines = [(i, ln) for i, ln in enumerate(fh, 1) if ln.strip()]
    records = []
    for k, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if k == len(lines) - 1:
                logger.warning("%s: dropped its torn last line %d: %r", path, number, line[:60])
                continue
            from .checkpoint import CheckpointError

            raise CheckpointError(
                f"{path} line {number} is damaged ({exc.msg}); the run log is not a record of "
                "one run: repair or delete that line, or start over with --overwrite-output-dir"
            ) from None
    return records


def read_log(run_dir: str) -> list[dict[str, Any]]:
    return _parse_log(os.path.join(run_dir, "metrics.jsonl"))


def summarize(records: list[dict[str, Any]], evals: list[dict[str, Any]], **info: Any) -> dict:
    """Whole-run numbers. Throughput skips step 1 (compilation, allocator warm-up) and the step
    --profile-step profiled (the profiler's overhead) when it can."""
    steady = [r for r in records[1:] if not r.get("profiled")] or records[1:] or records
    tokens = sum(r["real_tokens"] for r in steady)
    seconds = sum(r["step_time"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    held = sum(r["tensor_tokens"] for r in records)
    budget = sum(r["budget_tokens"] for r in records)
    padded = sum(r.get("padded_tokens", 0) for r in records)
    real = sum(r["real_tokens"] for r in records)
    updated = [r for r in records if not r.get("skipped")]  # skipped steps have no finite loss
    head = [r["loss"] for r in updated[: max(1, len(updated) // 10)]]
    tail = [r["loss"] for r in updated[-max(1, len(updated) // 10) :]]
    return {
        **info,
        "steps": records[-1]["step"] if records else 0,
        "real_tokens": real,
        "wall_time_s": records[-1]["elapsed"] if records else 0.0,
        "loss_first": updated[0]["loss"] if updated else math.nan,
        "loss_last": updated[-1]["loss"] if updated else math.nan,
        "loss_first_10pct": sum(head) / len(head) if updated else math.nan,
        "loss_last_10pct": sum(tail) / len(tail) if updated else math.nan,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "packing_efficiency": real / held if held else 0.0,
        "padded_efficiency": real / padded if padded else 0.0,
        "budget_fill": real / budget if budget else 0.0,
        "peak_mem_gib": max((r["peak_mem_gib"] for r in records), default=0.0),
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "tflops_per_s": (
            sum(r["tflops_per_s"] * r["step_time"] for r in steady) / seconds if seconds else 0.0
        ),
    }


def format_summary(s: dict[str, Any]) -> str:
    mfu = (
        f"MFU {s['mfu']:.1%}"
        if s.get("mfu") is not None
        else "MFU n/a (peak unknown: --peak-tflops)"
    )
    eval_part = f", eval {s['eval_loss']:.4f}" if s.get("eval_loss") is not None else ""
    mem_kind = "GPU allocated" if s.get("device", "cpu").startswith("cuda") else "process RSS"
    env = s.get("env") or {}
    lines = [
        "hf-varlen train: summary",
        "  env         " + ", ".join(f"{k} {v}" for k, v in env.items()),
        f"  model       {s['model']} ({s['params'] / 1e6:.2f}M params, {s['trainable'] / 1e6:.2f}M "
        f"trained), {s['mode']}, attention {s['attention']}, precision {s['precision']}",
        f"  kernels     {s['kernels']}",
        f"  loss fn     {s.get('loss_impl', 'transformers cross-entropy')}",
        f"  data        {s['data']}"
        + (f", {s['skipped_records']} bad records skipped" if s.get("skipped_records") else ""),
        f"  run         {s['steps']} steps on {s['processes']} x {s['device']}"
        + (
            f" ({s['distribution']})"
            if s.get("distribution", "one process") != "one process"
            else ""
        )
        + ", "
        f"{s['wall_time_s']:.1f} s, {_fmt_tokens(s['real_tokens'])} tokens"
        + (f", {s['skipped_steps']} steps skipped (non-finite)" if s.get("skipped_steps") else ""),
        f"  loss        {s['loss_first']:.4f} -> {s['loss_last']:.4f} (mean of first/last 10%: "
        f"{s['loss_first_10pct']:.4f} -> {s['loss_last_10pct']:.4f}){eval_part}",
        f"  throughput  {s['tokens_per_s']:,.0f} tokens/s (after step 1), "
        f"{s['tflops_per_s']:.2f} model TFLOP/s, {mfu}",
        f"  tokens      {s['packing_efficiency']:.1%} of the tokens computed were real (packing "
        f"efficiency); padded to their longest example the same micro-batches would be "
        f"{s.get('padded_efficiency', 0.0):.1%} real; micro-batches {s['budget_fill']:.1%} full "
        "(budget fill)",
        f"  memory      peak {s['peak_mem_gib']:.2f} GiB ({mem_kind})",
    ]
    if s.get("vs_padded"):  # after the tokens line: the padding this run avoids
        lines.insert(len(lines) - 1, f"  vs padded   {s['vs_padded']['text']}")
    for key, label in (
        ("ranks", "ranks"), ("static_shapes", "shapes"), ("compile", "compile"),
        ("cuda_graphs", "cuda graphs"), ("profile", "profile"),
    ):  # fmt: skip
        if s.get(key):
            lines.append(f"  {label:<11} {s[key]['text']}")
    if s.get("output_dir"):
        lines.append(f"  output      {s['output_dir']}")
    return "\n".join(lines)


def plot_runs(run_dirs: list[str], out_dir: str, labels: list[str] | None = None) -> list[str]:
    """Loss vs step, loss vs wall-clock and tokens/s vs step, one line per run. Returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    runs = [read_log(d) for d in run_dirs]
    panels = (
        ("loss_vs_step.png", "step", "loss", "training loss vs step"),
        ("loss_vs_time.png", "elapsed", "loss", "training loss vs wall-clock (s)"),
        ("tokens_per_s.png", "step", "tokens_per_s", "real tokens/s vs step"),
    )
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for fname, x_key, y_key, title in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        for label, recs in zip(labels, runs, strict=True):
            steps = [r for r in recs if "loss" in r]
            ax.plot([r[x_key] for r in steps], [r[y_key] for r in steps], label=label, lw=1.2)
            evals = [r for r in recs if "eval_loss" in r]
            if y_key == "loss" and evals:
                ax.plot(
                    [r[x_key] for r in evals],
                    [r["eval_loss"] for r in evals],
                    "o--",
                    ms=3,
                    label=f"{label} (eval)",
                )
        ax.set_title(title)
        ax.set_xlabel("wall-clock (s)" if x_key == "elapsed" else "step")
        ax.set_ylabel(y_key.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
