"""The sections of the training options that shape the run itself: optimisation, compile and
CUDA graphs, checkpointing, logging (``options.py`` has the data and model sections and says how
the sections make up ``TrainConfig``)."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

from .options import (
    NONFINITE,
    OPTIMIZERS,
    REPORT_TO,
    SCHEDULES,
    TENSORBOARD_DIR,
    TOGGLES,
    TRACKERS,
    check_choices,
    check_ints,
    option,
)


@dataclass
class OptimOptions:
    """Optimizer, learning-rate schedule, run length and seed (consumed by ``loop.py`` and
    ``builders.py``)."""

    optim: str = option("adamw", "optimizer", choices=OPTIMIZERS)
    lr: float | None = option(
        None, "peak learning rate; default: 1e-3 for random-init presets, 2e-4 for LoRA, else 2e-5"
    )
    lr_schedule: str = option("cosine", "learning-rate schedule", choices=SCHEDULES)
    warmup_steps: int | None = option(None, "warm-up steps; default: 5%% of the run")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0: no clipping)")
    on_nonfinite: str = option(
        "stop",
        "a step whose loss or gradient norm is NaN/inf: stop the run with an error, or skip its "
        "optimizer update (counted in the summary)",
        choices=NONFINITE,
    )
    grad_accum: int = option(1, "micro-batches per optimizer step (gradient accumulation)")
    max_steps: int | None = option(None, "optimizer steps (overrides --epochs)")
    epochs: float = option(1.0, "passes over the training data")
    seed: int = option(0, "seed for initialisation, shuffling and packing")
    ddp_timeout: int = option(
        1800,
        "seconds a collective of a multi-process run waits for the other ranks before it fails "
        "with an error (torch's default, 30 min; a lower value turns a stuck rank into an error "
        "sooner)",
    )

    def validate(self) -> None:
        check_ints(self, 1, ("grad_accum", "ddp_timeout"))
        check_ints(self, 1, ("max_steps",), allow_none=True)
        check_ints(self, 0, ("seed",))
        check_ints(self, 0, ("warmup_steps",), allow_none=True)
        # `not x >= 0` is also true for NaN; inf is refused where it has no meaning.
        if not self.max_grad_norm >= 0:
            raise ValueError(
                f"--max-grad-norm: expected >= 0 (0: no clipping), got {self.max_grad_norm}"
            )
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(
                f"--weight-decay: expected a finite value >= 0, got {self.weight_decay}"
            )
        if not self.epochs > 0 and math.isfinite(self.epochs):
            raise ValueError(f"--epochs: expected > 0, got {self.epochs}")
        if not math.isfinite(self.epochs):
            raise ValueError(
                f"--epochs: expected a finite number > 0, got {self.epochs}; for a run of a fixed "
                "length pass --max-steps"
            )
        if self.lr is not None and not 0 <= self.lr < math.inf:
            raise ValueError(f"--lr: expected a finite value >= 0, got {self.lr}")
        check_choices(self, lr_schedule=SCHEDULES, optim=OPTIMIZERS, on_nonfinite=NONFINITE)


@dataclass
class CompileOptions:
    """torch.compile and the CUDA-graph-captured step (consumed by ``compiling.py`` and
    ``graphs.py``; their checks that need the device run there)."""

    compile: bool = option(
        False,
        "torch.compile the model (default mode, fullgraph=True; each batch's token count and "
        "document count marked dynamic, so changing packs do not recompile); the summary reports "
        "the compile time and the number of compilations. A compile that fails raises with the "
        "reason: nothing silently runs eager",
    )
    compile_backend: str = option(
        "inductor",
        "advanced: torch.compile backend for --compile; aot_eager traces without generating "
        "code (CPU tests, debugging)",
    )
    compile_mode: str = option(
        "default",
        "Inductor mode for --compile: default; reduce-overhead (CUDA graphs through Inductor's "
        "cudagraph trees, one graph per batch shape: pair it with --static-shapes); "
        "max-autotune; max-autotune-no-cudagraphs; lite",
    )
    cuda_graphs: str = option(
        "auto",
        "capture the training step in CUDA graphs (one per batch shape holding the whole step; "
        "with --grad-accum > 1, one per shape for forward + backward and one for clip + fused "
        "AdamW) and replay it: on (raises when the run cannot: it needs "
        "CUDA, static shapes, one process, adamw, no dropout under --gradient-checkpointing); "
        "auto (default: captured on CUDA below ~10K real tokens per micro-batch, where the "
        "eager step waits on the host, with enough free memory; else eager, the reason in the "
        "summary: hf_varlen/captured_step/auto_mode.py); off",
        choices=TOGGLES,
    )

    def validate(self) -> None:
        check_choices(self, cuda_graphs=TOGGLES)


@dataclass
class CheckpointOptions:
    """The output folder, checkpoints and resume (consumed by ``checkpoint.py``)."""

    output_dir: str = option("runs/hf-varlen", "where logs, checkpoints and plots go")
    save_every: int = option(0, "save a resumable checkpoint every N steps (0: never)")
    save_total_limit: int | None = option(
        None,
        "keep only the newest N checkpoint-<step> folders, deleting older ones after each save "
        "(final/ and anything else in --output-dir stay); default: keep all",
    )
    save_final: bool = option(True, "save the final model (safetensors) and tokenizer")
    overwrite_output_dir: bool = option(
        False,
        "start a new run in an --output-dir that holds one, deleting the old run (metrics, "
        "summary, final model, checkpoints); without it (or --resume) such a start is refused",
    )
    resume: str | None = option(
        None,
        "checkpoint folder to resume from, or 'latest' (the newest complete checkpoint under "
        "--output-dir; starts fresh when there is none and the folder holds no run)",
    )
    resume_without_rng: bool = option(
        False,
        "resume from a checkpoint that lacks a process's random states (fresh random states; "
        "the continuation is then not bit-identical)",
    )

    def validate(self) -> None:
        from ..ops.common import check_int

        check_ints(self, 0, ("save_every",))
        check_int("--save-total-limit", self.save_total_limit, 1, allow_none=True)
        if self.save_total_limit is not None and not self.save_every:
            raise ValueError(
                f"--save-total-limit {self.save_total_limit} keeps the newest checkpoints, but "
                "--save-every is 0 (no checkpoints are saved); pass --save-every N too, or drop "
                "--save-total-limit"
            )
        if self.overwrite_output_dir and self.resume == "latest":
            raise ValueError(
                "--overwrite-output-dir deletes the checkpoints that --resume latest would "
                "continue from; pass one of them"
            )
        if self.resume not in (None, "latest") and not os.path.isdir(self.resume):
            from .sources import closest_existing

            guess = closest_existing(self.resume)
            raise ValueError(
                f"--resume: expected a checkpoint folder or 'latest', got {self.resume!r} (no such "
                "folder" + (f"; did you mean {guess!r}?)" if guess else ")")
            )


@dataclass
class LoggingOptions:
    """Metrics, trackers, eval cadence, plots and profiling (consumed by ``metrics.py``,
    ``profiling.py`` and the loop's reporting)."""

    eval_every: int = option(0, "evaluate every N steps (0: only at the end)")
    log_every: int = option(1, "write a metrics line (and send it to --report-to) every N steps")
    report_to: str = option(
        "none",
        "experiment tracker (accelerate's trackers): loss, tokens/s, packing efficiency, peak "
        f"memory, lr and gradient norm every --log-every steps; tensorboard writes event files "
        f"to OUTPUT_DIR/{TENSORBOARD_DIR}",
        choices=REPORT_TO,
    )
    run_name: str | None = option(
        None,
        "tracker project name (wandb / trackio project, tensorboard subfolder); default: "
        "the --output-dir folder name",
    )
    peak_tflops: float | None = option(
        None, "accelerator peak TFLOP/s for the MFU estimate (default: known GPUs only)"
    )
    profile_step: int | None = option(
        None,
        "profile optimizer step N (1-based) on every rank with torch.profiler: "
        "OUTPUT_DIR/profile/step<N>_rank<r>.json splits its time into compute and communication "
        "(collectives), with the communication no compute overlaps on CUDA, and "
        "step<N>_rank<r>.trace.json.gz is its Chrome / Perfetto trace",
    )
    plot: bool = option(False, "write loss / throughput PNGs (needs matplotlib)")
    progress: bool = option(True, "show a progress bar")

    def validate(self) -> None:
        check_ints(self, 1, ("log_every",))
        check_ints(self, 1, ("profile_step",), allow_none=True)
        check_ints(self, 0, ("eval_every",))
        if self.peak_tflops is not None and not 0 < self.peak_tflops < math.inf:
            raise ValueError(
                f"--peak-tflops: expected the accelerator's peak TFLOP/s, a finite number > 0, got "
                f"{self.peak_tflops}; leave it out to use the known GPUs' table"
            )
        if self.run_name is not None:
            _check_run_name(self.run_name)
        check_choices(self, report_to=REPORT_TO)
        if self.plot and importlib.util.find_spec("matplotlib") is None:
            raise ImportError(
                "--plot needs `matplotlib`, which is not installed; "
                "`pip install 'hf_varlen[plot]'` or drop --plot"
            )
        if self.report_to != "none" and not any(
            importlib.util.find_spec(p) is not None for p in TRACKERS[self.report_to]
        ):
            package = TRACKERS[self.report_to][0]
            raise ImportError(
                f"--report-to {self.report_to} needs the `{package}` package, which is not "
                f"installed; `pip install 'hf_varlen[{self.report_to}]'` (or `pip install "
                f"{package}`) or drop --report-to"
            )


def _check_run_name(name: str) -> None:
    """--run-name names a folder under OUTPUT_DIR/tensorboard (and a tracker project): one plain
    name, so nothing is written outside --output-dir."""
    if (
        not name.strip()
        or name in (".", "..")
        or any(sep in name for sep in ("/", "\\", os.sep))
        or os.path.isabs(name)
        or "\0" in name
    ):
        raise ValueError(
            f"--run-name: expected one folder name (no '/', '\\', '..' or absolute path: the "
            f"tracker writes under OUTPUT_DIR/{TENSORBOARD_DIR}/RUN_NAME), got {name!r}"
        )
