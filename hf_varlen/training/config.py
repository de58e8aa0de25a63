"""Training configuration: one dataclass, its command-line parser, and the cheap checks.

Every option of ``hf-varlen train`` is a field of :class:`TrainConfig`; the parser is generated from
the fields (name ``tokens_per_batch`` -> flag ``--tokens-per-batch``, help from ``metadata``), so
the CLI and the Python API (``hf_varlen.training.run(TrainConfig(...))``) cannot drift apart.

``TrainConfig.validate()`` runs before anything is loaded; checks that need the data, the tokenizer
or the model (dataset fields, attention support, backend names) run in ``data.py`` / ``model.py``,
still before the first step. Every error names the option, the value received and a way out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("auto", "alpaca", "chat", "text")
PRECISIONS = ("auto", "fp32", "bf16", "bf16-mixed")
SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw", "sgd")
TOGGLES = ("auto", "on", "off")
NONFINITE = ("stop", "skip")
# --report-to: accelerate's tracker name -> the packages that provide it (pip name first).
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
}
REPORT_TO = ("none", *TRACKERS)
TENSORBOARD_DIR = "tensorboard"  # under --output-dir
PROFILE_DIR = "profile"  # under --output-dir: --profile-step's files
DEFAULT_TOKENS_PER_BATCH = 4096


def _opt(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that carries its CLI help (and argparse extras such as ``choices``)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """All options of a training run. Defaults train the built-in tiny model on built-in data."""

    # What to train.
    model: str = _opt(
        "tiny-llama",
        "hub id, local directory, or a built-in random-init preset "
        "(tiny-llama, tiny-qwen2, tiny-qwen3, tiny-mistral, llama-1b, qwen3-8b)",
    )
    tokenizer: str | None = _opt(
        None,
        "hub id or local directory; default: the model's own, or the built-in byte tokenizer "
        "for presets ('bytes')",
    )
    config_overrides: str | None = _opt(
        None,
        "comma-separated key=value model config overrides for presets, e.g. "
        "'num_hidden_layers=4,hidden_size=256'",
    )
    # Data.
    dataset: str = _opt(
        "builtin",
        "'builtin' (deterministic synthetic instructions), a local .json/.jsonl/.parquet "
        "file, or a hub dataset id (needs `datasets`)",
    )
    dataset_config: str | None = _opt(None, "hub dataset configuration name")
    dataset_split: str = _opt("train", "hub dataset split")
    format: str = _opt(
        "auto",
        "record format: alpaca (instruction/input/output or prompt/completion), chat "
        "(messages, rendered by the tokenizer's chat template), text; auto: from the fields",
        choices=FORMATS,
    )
    text_field: str = _opt("text", "field holding the text for --format text")
    messages_field: str = _opt("messages", "field holding the messages for --format chat")
    completion_only: bool = _opt(
        True, "instruction formats: loss on the response tokens only (prompt labels = -100)"
    )
    skip_bad_records: bool = _opt(
        False,
        "skip records that are not valid JSON or lack a needed field or have a null / non-string "
        "one (counted in the summary) instead of stopping at the first",
    )
    max_examples: int | None = _opt(None, "use only the first N examples of the dataset")
    builtin_examples: int = _opt(
        300,
        "number of examples the built-in dataset generates (300: the main job, about a minute "
        "on 2 CPU cores)",
    )
    max_length: int = _opt(1024, "truncate each example to this many tokens")
    tokens_per_batch: int | None = _opt(
        None,
        "token budget of one packed micro-batch per device (>= max_length); default 4096 "
        "unless --batch-size is given",
    )
    batch_size: int | None = _opt(
        None,
        "examples per micro-batch per device (the classic per-device batch size) instead of a "
        "token budget: consecutive examples of one seeded shuffle, packed into one row (or "
        "padded to [B, L_max] with --padded)",
    )
    grad_accum: int = _opt(1, "micro-batches per optimizer step (gradient accumulation)")
    shuffle: bool = _opt(True, "shuffle the order of the packed micro-batches every epoch")
    pad_to_multiple_of: int | None = _opt(
        None, "pad each packed micro-batch to a multiple of this many tokens (a separate segment)"
    )
    static_shapes: bool | None = _opt(
        None,
        "packed runs: pad every micro-batch to a rung of hf_varlen.bucket_ladder(token budget) "
        "(the budget is --tokens-per-batch, or --batch-size x --max-length) and give cu_seq_lens "
        "a fixed length (the batch sampler's max_documents + 2; zero-length documents fill it), "
        "so --compile and CUDA graphs see a few static shapes. The padding is its own segment with "
        "no label: loss, tokens/s, MFU and packing efficiency count real tokens only; the summary "
        "gives the distinct shapes and the padding share. Not with --padded or "
        "--pad-to-multiple-of. Unset (auto): on exactly when the captured step runs "
        "(--cuda-graphs)",
    )
    # Baseline and attention.
    padded: bool = _opt(
        False, "padded baseline: same data and order, padded [B, L] batches, attention 'sdpa'"
    )
    attn_implementation: str = _opt(
        "varlen_packed", "transformers attention implementation for packed batches"
    )
    attn_backend: str = _opt("auto", "varlen attention backend (hf_varlen.available_backends())")
    fused_kernels: str = _opt(
        "auto",
        "hf_varlen fused kernels (RoPE, GLU, RMSNorm, CE); auto: on when CUDA is used",
        choices=TOGGLES,
    )
    fused_loss: str = _opt(
        "auto",
        "fused chunked linear cross-entropy (never materialises the [tokens, vocab] logits); "
        "auto: on with CUDA or on the CPU, elsewhere from a 32K vocabulary on (independent of "
        "--fused-kernels; the summary says which loss ran)",
        choices=TOGGLES,
    )
    precision: str = _opt(
        "auto",
        "fp32; bf16 (bf16 weights and math); bf16-mixed (fp32 weights, bf16 autocast); "
        "auto: bf16 on a GPU that supports it, else fp32",
        choices=PRECISIONS,
    )
    gradient_checkpointing: bool = _opt(False, "recompute activations in backward")
    compile: bool = _opt(
        False,
        "torch.compile the model (default mode, fullgraph=True; each batch's token count and "
        "document count marked dynamic, so changing packs do not recompile); the summary reports "
        "the compile time and the number of compilations. A compile that fails raises with the "
        "reason: nothing silently runs eager",
    )
    compile_backend: str = _opt(
        "inductor",
        "advanced: torch.compile backend for --compile; aot_eager traces without generating "
        "code (CPU tests, debugging)",
    )
    compile_mode: str = _opt(
        "default",
        "Inductor mode for --compile: default; reduce-overhead (CUDA graphs through Inductor's "
        "cudagraph trees, one graph per batch shape: pair it with --static-shapes); "
        "max-autotune; max-autotune-no-cudagraphs; lite",
    )
    cuda_graphs: str = _opt(
        "auto",
        "capture the training step in CUDA graphs (one per batch shape for forward + backward, "
        "one for clip + fused AdamW) and replay it: on (raises when the run cannot: it needs "
        "CUDA, static shapes, one process, adamw, no dropout under --gradient-checkpointing); "
        "auto (default: captured on CUDA below ~10K real tokens per micro-batch, where the "
        "eager step waits on the host, with enough free memory; else eager, the reason in the "
        "summary: hf_varlen/training/auto_mode.py); off",
        choices=TOGGLES,
    )
    # LoRA.
    lora: bool = _opt(False, "train LoRA adapters (needs `peft`)")
    lora_r: int = _opt(16, "LoRA rank")
    lora_alpha: int = _opt(32, "LoRA alpha")
    lora_dropout: float = _opt(0.0, "LoRA dropout")
    lora_target: str = _opt("all-linear", "LoRA target modules (peft syntax, comma-separated)")
    fused_lora: bool = _opt(
        False,
        "with --lora: run peft's LoRA Linear layers on hf_varlen's one-op LoRA projection "
        "(base + scale * B(A(x)) with a hand-written backward that keeps only x and the rank-r "
        "intermediate); needs --lora-dropout 0 and a full-precision base; off by default until "
        "measured on the GPU (docs/lora.md)",
    )
    load_in_4bit: bool = _opt(
        False,
        "QLoRA: load the base model's linear layers in 4-bit NF4 (bitsandbytes through "
        "transformers' BitsAndBytesConfig, double quantisation, bf16 compute); needs --lora, one "
        "CUDA GPU and bf16 precision (pip install 'hf_varlen[qlora]')",
    )
    # Optimisation.
    optim: str = _opt("adamw", "optimizer", choices=OPTIMIZERS)
    lr: float | None = _opt(
        None, "peak learning rate; default: 1e-3 for random-init presets, 2e-4 for LoRA, else 2e-5"
    )
    lr_schedule: str = _opt("cosine", "learning-rate schedule", choices=SCHEDULES)
    warmup_steps: int | None = _opt(None, "warm-up steps; default: 5%% of the run")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    max_grad_norm: float = _opt(1.0, "clip the gradient norm to this (0: no clipping)")
    on_nonfinite: str = _opt(
        "stop",
        "a step whose loss or gradient norm is NaN/inf: stop the run with an error, or skip its "
        "optimizer update (counted in the summary)",
        choices=NONFINITE,
    )
    max_steps: int | None = _opt(None, "optimizer steps (overrides --epochs)")
    epochs: float = _opt(1.0, "passes over the training data")
    seed: int = _opt(0, "seed for initialisation, shuffling and packing")
    ddp_timeout: int = _opt(
        1800,
        "seconds a collective of a multi-process run waits for the other ranks before it fails "
        "with an error (torch's default, 30 min; a lower value turns a stuck rank into an error "
        "sooner)",
    )
    # Evaluation.
    eval_split: float = _opt(0.0, "fraction of the data held out for the eval loss")
    eval_dataset: str | None = _opt(None, "separate eval dataset (same format)")
    eval_every: int = _opt(0, "evaluate every N steps (0: only at the end)")
    # Output, checkpoints, metrics.
    output_dir: str = _opt("runs/hf-varlen", "where logs, checkpoints and plots go")
    save_every: int = _opt(0, "save a resumable checkpoint every N steps (0: never)")
    save_total_limit: int | None = _opt(
        None,
        "keep only the newest N checkpoint-<step> folders, deleting older ones after each save "
        "(final/ and anything else in --output-dir stay); default: keep all",
    )
    save_final: bool = _opt(True, "save the final model (safetensors) and tokenizer")
    overwrite_output_dir: bool = _opt(
        False,
        "start a new run in an --output-dir that holds one, deleting the old run (metrics, "
        "summary, final model, checkpoints); without it (or --resume) such a start is refused",
    )
    resume: str | None = _opt(
        None,
        "checkpoint folder to resume from, or 'latest' (the newest complete checkpoint under "
        "--output-dir; starts fresh when there is none and the folder holds no run)",
    )
    resume_without_rng: bool = _opt(
        False,
        "resume from a checkpoint that lacks a process's random states (fresh random states; "
        "the continuation is then not bit-identical)",
    )
    log_every: int = _opt(1, "write a metrics line (and send it to --report-to) every N steps")
    report_to: str = _opt(
        "none",
        "experiment tracker (accelerate's trackers): loss, tokens/s, packing efficiency, peak "
        f"memory, lr and gradient norm every --log-every steps; tensorboard writes event files "
        f"to OUTPUT_DIR/{TENSORBOARD_DIR}",
        choices=REPORT_TO,
    )
    run_name: str | None = _opt(
        None,
        "tracker project name (wandb / trackio project, tensorboard subfolder); default: "
        "the --output-dir folder name",
    )
    plot: bool = _opt(False, "write loss / throughput PNGs (needs matplotlib)")
    progress: bool = _opt(True, "show a progress bar")
    peak_tflops: float | None = _opt(
        None, "accelerator peak TFLOP/s for the MFU estimate (default: known GPUs only)"
    )
    profile_step: int | None = _opt(
        None,
        "profile optimizer step N (1-based) on every rank with torch.profiler: "
        "OUTPUT_DIR/profile/step<N>_rank<r>.json splits its time into compute and communication "
        "(collectives), with the communication no compute overlaps on CUDA, and "
        "step<N>_rank<r>.trace.json.gz is its Chrome / Perfetto trace",
    )

    # ----------------------------------------------------------------------------------------- #

    def _validate_lora(self) -> None:
        """--fused-lora and --load-in-4bit: what they need (the device is checked at start)."""
        for flag, on in (("--fused-lora", self.fused_lora), ("--load-in-4bit", self.load_in_4bit)):
            if on and not self.lora:
                raise ValueError(f"{flag} applies to LoRA training: add --lora or drop {flag}")
        if self.fused_lora and self.lora_dropout > 0:
            raise ValueError(
                f"--fused-lora: the one-op LoRA projection has no dropout, got --lora-dropout "
                f"{self.lora_dropout}; pass --lora-dropout 0 or drop --fused-lora"
            )
        if not self.load_in_4bit:
            return
        if self.fused_lora:
            raise ValueError(
                "--fused-lora needs a full-precision base layer, but --load-in-4bit quantises it; "
                "drop one of them"
            )
        if self.precision not in ("auto", "bf16"):
            raise ValueError(
                f"--load-in-4bit computes in bf16 (4-bit weights, bf16 activations), got "
                f"--precision {self.precision}; pass --precision bf16 (or auto)"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError(
                "--load-in-4bit needs the `bitsandbytes` package, which is not installed; "
                "`pip install 'hf_varlen[qlora]'` or drop --load-in-4bit"
            )

    def validate(self) -> None:
        """Checks that need nothing but the options. Raises ValueError/TypeError/ImportError with
        a hint."""
        from ..ops.common import check_int  # here, not at the top: --help must not load torch

        check_int("--max-length", self.max_length, None)
        if self.max_length < 2:
            raise ValueError(
                f"--max-length: expected >= 2 (one input and one target token), got "
                f"{self.max_length}"
            )
        if self.tokens_per_batch is not None and self.batch_size is not None:
            raise ValueError(
                f"--tokens-per-batch {self.tokens_per_batch} and --batch-size {self.batch_size}: "
                "a micro-batch is either a token budget or a number of examples; pass only one"
            )
        check_int("--batch-size", self.batch_size, 1, allow_none=True)
        if self.static_shapes and self.padded:
            raise ValueError(
                "--static-shapes buckets packed rows; --padded batches are [B, L_max] with an "
                "attention mask, where it means nothing. Drop one of the two"
            )
        if self.static_shapes and self.pad_to_multiple_of is not None:
            raise ValueError(
                f"--static-shapes and --pad-to-multiple-of {self.pad_to_multiple_of} both set the "
                "padded length of a micro-batch; pass only one"
            )
        for name in (
            "grad_accum", "log_every", "lora_r", "lora_alpha", "builtin_examples", "ddp_timeout",
        ):  # fmt: skip
            check_int(f"--{_flag(name)}", getattr(self, name), 1)
        for name in (
            "max_steps", "max_examples", "pad_to_multiple_of", "tokens_per_batch", "profile_step",
        ):  # fmt: skip
            check_int(f"--{_flag(name)}", getattr(self, name), 1, allow_none=True)
        for name in ("save_every", "eval_every", "seed"):
            check_int(f"--{_flag(name)}", getattr(self, name), 0)
        check_int("--save-total-limit", self.save_total_limit, 1, allow_none=True)
        if self.save_total_limit is not None and not self.save_every:
            raise ValueError(
                f"--save-total-limit {self.save_total_limit} keeps the newest checkpoints, but "
                "--save-every is 0 (no checkpoints are saved); pass --save-every N too, or drop "
                "--save-total-limit"
            )
        _check_names(self.model, self.dataset)
        check_int("--warmup-steps", self.warmup_steps, 0, allow_none=True)
        if self.token_budget < self.max_length:
            raise ValueError(
                f"--tokens-per-batch: expected >= --max-length ({self.max_length}) so that the "
                f"longest example fits one micro-batch, got {self.token_budget}; raise "
                "--tokens-per-batch or lower --max-length"
            )
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
        if self.peak_tflops is not None and not 0 < self.peak_tflops < math.inf:
            raise ValueError(
                f"--peak-tflops: expected the accelerator's peak TFLOP/s, a finite number > 0, got "
                f"{self.peak_tflops}; leave it out to use the known GPUs' table"
            )
        if self.run_name is not None:
            _check_run_name(self.run_name)
        if not 0.0 <= self.eval_split < 1.0:
            raise ValueError(f"--eval-split: expected a fraction in [0, 1), got {self.eval_split}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout: expected a value in [0, 1), got {self.lora_dropout}")
        for name, choices in (
            ("format", FORMATS),
            ("precision", PRECISIONS),
            ("lr_schedule", SCHEDULES),
            ("optim", OPTIMIZERS),
            ("fused_kernels", TOGGLES),
            ("fused_loss", TOGGLES),
            ("cuda_graphs", TOGGLES),
            ("on_nonfinite", NONFINITE),
            ("report_to", REPORT_TO),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"--{_flag(name)}: expected one of {choices}, got {getattr(self, name)!r}"
                )
        if self.lora and importlib.util.find_spec("peft") is None:
            raise ImportError(
                "--lora needs the `peft` package, which is not installed; "
                "`pip install 'hf_varlen[peft]'` or drop --lora"
            )
        self._validate_lora()
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

    @property
    def token_budget(self) -> int:
        """Tokens one micro-batch may hold: --tokens-per-batch, or batch_size x max_length."""
        if self.batch_size is not None:
            return self.batch_size * self.max_length
        return DEFAULT_TOKENS_PER_BATCH if self.tokens_per_batch is None else self.tokens_per_batch

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save_yaml(self, path: str) -> None:
        """Write the options as a ``--config`` file (``hf-varlen train --config PATH`` re-runs)."""
        import yaml

        header = "# hf-varlen train --config this file (flags given with it override its keys)\n"
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(header + yaml.safe_dump(self.to_dict(), sort_keys=False))


def _check_names(model: str, dataset: str) -> None:
    """A --model / --dataset that is no local path, has no '/' and is close to a built-in name is a
    typo (``tiny-lama``), not a Hub id: say so before anything goes to the Hub."""
    import difflib

    from .builtin import PRESETS

    for flag, value, names in (
        ("--model", model, tuple(PRESETS)),
        ("--dataset", dataset, ("builtin",)),
    ):
        if value in names or "/" in value or os.path.exists(os.path.expanduser(value)):
            continue
        close = difflib.get_close_matches(value.lower(), names, n=1, cutoff=0.75)
        if close:
            raise ValueError(
                f"{flag} {value!r}: not a built-in name, a local path or a Hub id with an "
                f"organisation; did you mean {close[0]!r}?"
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


def _check_value(source: str, key: str, value: Any, hint: str) -> Any:
    """``value`` for the field ``key`` (annotation ``hint``), or a ValueError naming both."""
    if value is None and "None" in hint:
        return None
    kind = hint.split(" ")[0]
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        want = {"bool": "true or false", "int": "an integer", "float": "a number"}
        raise ValueError(
            f"--config {source}: {key}: expected {want.get(kind, 'a string')}"
            f"{' or null' if 'None' in hint else ''}, got {value!r}"
        )
    return float(value) if kind == "float" else value


def load_config_file(path: str) -> dict[str, Any]:
    """The options of a YAML ``--config`` file: a mapping whose keys are TrainConfig field names
    (the flags with underscores: ``max_steps`` for ``--max-steps``). Unknown keys, wrong types and
    non-mappings are ValueErrors naming the key (and the closest valid one)."""
    import difflib

    import yaml

    if not os.path.isfile(path):
        from .sources import closest_existing

        guess = closest_existing(path)
        raise FileNotFoundError(
            f"--config {path!r}: no such file" + (f"; did you mean {guess!r}?" if guess else "")
        )
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML: {' '.join(str(exc).split())}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path}: expected a mapping of options (max_steps: 10, ...), got a "
            f"{type(data).__name__}"
        )
    hints = {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in data.items():
        if key not in hints:
            name = str(key)
            close = name.replace("-", "_")
            close = (
                close
                if close in hints
                else next(iter(difflib.get_close_matches(close, hints, n=1, cutoff=0.6)), None)
            )
            raise ValueError(
                f"--config {path}: unknown key {name!r}"
                + (f"; did you mean {close!r}?" if close else "")
                + " (keys are the flag names with underscores: max_steps for --max-steps)"
            )
        values[key] = _check_value(path, key, value, hints[key])
    return values


def parse_train_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; a ``--config FILE`` supplies the defaults, so flags override its keys."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        values = load_config_file(known.config)
        # Deleting a run is for this command line to ask, never a file: every run records its
        # options in OUTPUT_DIR/config.yaml, and re-running that file (as --config is meant to)
        # must not wipe the run it describes.
        if values.pop("overwrite_output_dir", False):
            import logging

            logging.getLogger("hf_varlen.training").warning(
                "--config %s: ignoring overwrite_output_dir: true (only --overwrite-output-dir "
                "on the command line deletes a run)",
                known.config,
            )
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _parse_optional(kind: type):
    def parse(text: str):
        if text.lower() in ("none", ""):
            return None
        return kind(text)

    parse.__name__ = kind.__name__
    return parse


# --help: the options a first run needs, then one headed group per topic. Every TrainConfig field
# is in exactly one of them (add_train_arguments refuses a field without a group).
COMMON = (
    "model", "dataset", "max_length", "tokens_per_batch", "batch_size", "max_steps", "epochs",
    "lr", "output_dir", "save_every", "resume",
)  # fmt: skip
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "data": (
        "dataset_config", "dataset_split", "format", "text_field", "messages_field",
        "completion_only", "skip_bad_records", "max_examples", "builtin_examples", "shuffle",
        "pad_to_multiple_of",
    ),
    "model and attention": (
        "tokenizer", "config_overrides", "padded", "attn_implementation", "attn_backend",
        "precision", "gradient_checkpointing",
    ),
    "kernels and loss": ("fused_kernels", "fused_loss"),
    "LoRA (needs the peft extra: pip install 'hf_varlen[peft]')": (
        "lora", "lora_r", "lora_alpha", "lora_dropout", "lora_target", "fused_lora",
        "load_in_4bit",
    ),
    "optimisation": (
        "grad_accum", "optim", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm",
        "on_nonfinite", "seed",
    ),
    "compile and CUDA graphs (speed on a GPU)": (
        "compile", "compile_backend", "compile_mode", "cuda_graphs", "static_shapes",
    ),
    "evaluation": ("eval_split", "eval_dataset", "eval_every"),
    "checkpointing and output": (
        "save_final", "save_total_limit", "overwrite_output_dir", "resume_without_rng",
    ),
    "logging and metrics": (
        "log_every", "report_to", "run_name", "plot", "progress", "peak_tflops", "profile_step",
    ),
    "multi-GPU (accelerate launch -m hf_varlen.cli train ...)": ("ddp_timeout",),
}  # fmt: skip
LOGGING_GROUP = "logging and metrics"


def _default_text(default: Any) -> str:
    """How --help shows a default: booleans as on/off (the flag / its --no- form)."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None:  # a boolean left unset: decided by the run (e.g. with the captured step)
        return "auto"
    return str(default).replace("%", "%%")


def add_train_arguments(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Add one flag per TrainConfig field (booleans get ``--x`` / ``--no-x``), and ``--config``,
    in the help groups above. Returns the argument groups by title (the CLI adds --debug to
    logging)."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    grouped = [*COMMON, *(n for names in HELP_GROUPS.values() for n in names)]
    missing = sorted(set(fields) - set(grouped))
    twice = sorted({n for n in grouped if grouped.count(n) > 1})
    unknown = sorted(set(grouped) - set(fields))
    if missing or twice or unknown:
        raise RuntimeError(
            f"config.HELP_GROUPS: fields in no group {missing}, in several {twice}, unknown "
            f"{unknown}"
        )
    groups = {"common": parser.add_argument_group("common options")}
    groups["common"].add_argument(
        "--config",
        metavar="FILE.yaml",
        default=None,
        help="YAML file of options: the flag names with underscores as keys (max_steps: 10); "
        "flags given with it override its keys. Each run saves its resolved options as "
        "OUTPUT_DIR/config.yaml, which re-runs it",
    )
    for name in COMMON:
        _add_field(groups["common"], fields[name])
    for title, names in HELP_GROUPS.items():
        groups[title] = parser.add_argument_group(title)
        for name in names:
            _add_field(groups[title], fields[name])
    return groups


def _add_field(group, f: dataclasses.Field) -> None:
    flag = "--" + _flag(f.name)
    help_text = f.metadata["help"]
    hint = str(f.type)
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    if hint in ("bool", "bool | None"):  # None: unset (auto)
        help_text += f" (default: {_default_text(f.default)})"
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
        return
    base = {"int": int, "float": float}.get(hint.split(" ")[0], str)
    kwargs["type"] = _parse_optional(base) if "None" in hint else base
    if base is not str and "choices" not in kwargs:
        kwargs["metavar"] = "N" if base is int else "X"
    if f.default is not None and "default" not in help_text:
        help_text += f" (default: {_default_text(f.default)})"
    group.add_argument(flag, help=help_text, **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """``hf-varlen train``'s flags as a TrainConfig (the same parser, without --debug)."""
    from ..cli import Parser

    parser = Parser(
        prog="hf-varlen train",
        description="Packed, padding-free fine-tuning of a Hugging Face causal LM "
        "(launch with `accelerate launch` for several processes).",
    )
    add_train_arguments(parser)
    return config_from_args(parse_train_args(parser, argv))
