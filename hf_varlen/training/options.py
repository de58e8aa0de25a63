"""The sections of the training options, torchtitan-style: each component owns its options.

    DataOptions        data.py, batching.py      what is read, how it is tokenized and batched
    ModelOptions       model.py                  model, tokenizer, attention, kernels, precision, LoRA
    OptimOptions       loop.py, builders.py      optimizer, schedule, run length, seed
    CompileOptions     compiling.py, graphs.py   torch.compile and the CUDA-graph-captured step
    CheckpointOptions  checkpoint.py             output folder, saves, resume
    LoggingOptions     metrics.py, profiling.py  metrics lines, trackers, eval cadence, profiling

(the last four in ``run_options.py``).
Each section is a dataclass of its fields (flag help in ``metadata``) and a ``validate()`` of the
checks that need only those fields; the functions of the owning module take the section as their
type. ``config.TrainConfig`` is all sections in one flat dataclass (it inherits every section), so
``cfg.lr``, ``TrainConfig(lr=...)``, the flags and the YAML keys stay flat, and a ``TrainConfig``
is itself a valid argument wherever a section is expected.

No torch import here: ``hf-varlen train --help`` builds its parser from these fields.
"""

from __future__ import annotations

import importlib.util
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


def option(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that carries its CLI help (and argparse extras such as ``choices``)."""
    return field(default=default, metadata={"help": help, **extra})


def flag(name: str) -> str:
    """The command-line flag of the field ``name`` (without the leading ``--``)."""
    return name.replace("_", "-")


def check_ints(
    options: Any, minimum: int, names: tuple[str, ...], allow_none: bool = False
) -> None:
    """Each field in ``names`` is an int >= ``minimum`` (or None with ``allow_none``)."""
    from ..ops.common import check_int  # here, not at the top: --help must not load torch

    for name in names:
        check_int(f"--{flag(name)}", getattr(options, name), minimum, allow_none=allow_none)


def check_choices(options: Any, **allowed: tuple[str, ...]) -> None:
    """Each field named in ``allowed`` holds one of its choices (argparse checks the flags; this
    checks the Python API)."""
    for name, choices in allowed.items():
        if getattr(options, name) not in choices:
            raise ValueError(
                f"--{flag(name)}: expected one of {choices}, got {getattr(options, name)!r}"
            )


def _check_name(name_flag: str, value: str, names: tuple[str, ...]) -> None:
    """A --model / --dataset that is no local path, has no '/' and is close to a built-in name is a
    typo (``tiny-lama``), not a Hub id: say so before anything goes to the Hub."""
    import difflib

    if value in names or "/" in value or os.path.exists(os.path.expanduser(value)):
        return
    close = difflib.get_close_matches(value.lower(), names, n=1, cutoff=0.75)
    if close:
        raise ValueError(
            f"{name_flag} {value!r}: not a built-in name, a local path or a Hub id with an "
            f"organisation; did you mean {close[0]!r}?"
        )


def require_package(package: str, needed_by: str, extra: str) -> None:
    """ImportError naming the flag ``needed_by`` and the extra that installs ``package``, when
    ``package`` is missing."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"{needed_by} needs the `{package}` package, which is not installed; "
            f"`pip install 'hf_varlen[{extra}]'` or drop {needed_by}"
        )


@dataclass
class ModelOptions:
    """What is trained and how it computes (consumed by ``model.py``)."""

    model: str = option(
        "tiny-llama",
        "hub id, local directory, or a built-in random-init preset "
        "(tiny-llama, tiny-qwen2, tiny-qwen3, tiny-mistral, llama-1b, qwen3-8b)",
    )
    tokenizer: str | None = option(
        None,
        "hub id or local directory; default: the model's own, or the built-in byte tokenizer "
        "for presets ('bytes')",
    )
    config_overrides: str | None = option(
        None,
        "comma-separated key=value model config overrides for presets, e.g. "
        "'num_hidden_layers=4,hidden_size=256'",
    )
    padded: bool = option(
        False, "padded baseline: same data and order, padded [B, L] batches, attention 'sdpa'"
    )
    attn_implementation: str = option(
        "varlen_packed", "transformers attention implementation for packed batches"
    )
    attn_backend: str = option("auto", "varlen attention backend (hf_varlen.available_backends())")
    fused_kernels: str = option(
        "auto",
        "hf_varlen fused kernels (RoPE, GLU, RMSNorm, CE); auto: on when CUDA is used",
        choices=TOGGLES,
    )
    fused_loss: str = option(
        "auto",
        "fused chunked linear cross-entropy (never materialises the [tokens, vocab] logits); "
        "auto: on with CUDA or on the CPU, elsewhere from a 32K vocabulary on (independent of "
        "--fused-kernels; the summary says which loss ran)",
        choices=TOGGLES,
    )
    precision: str = option(
        "auto",
        "fp32; bf16 (bf16 weights and math); bf16-mixed (fp32 weights, bf16 autocast); "
        "auto: bf16 on a GPU that supports it, else fp32",
        choices=PRECISIONS,
    )
    gradient_checkpointing: bool = option(False, "recompute activations in backward")
    lora: bool = option(False, "train LoRA adapters (needs `peft`)")
    lora_r: int = option(16, "LoRA rank")
    lora_alpha: int = option(32, "LoRA alpha")
    lora_dropout: float = option(0.0, "LoRA dropout")
    lora_target: str = option("all-linear", "LoRA target modules (peft syntax, comma-separated)")
    fused_lora: bool = option(
        False,
        "with --lora: run peft's LoRA Linear layers on hf_varlen's one-op LoRA projection "
        "(base + scale * B(A(x)) with a hand-written backward that keeps only x and the rank-r "
        "intermediate); needs --lora-dropout 0 and a full-precision base; off by default until "
        "measured on the GPU (docs/lora.md)",
    )
    load_in_4bit: bool = option(
        False,
        "QLoRA: load the base model's linear layers in 4-bit NF4 (bitsandbytes through "
        "transformers' BitsAndBytesConfig, double quantisation, bf16 compute); needs --lora, one "
        "CUDA GPU and bf16 precision (pip install 'hf_varlen[qlora]')",
    )

    def validate(self) -> None:
        from .builtin import PRESETS

        check_ints(self, 1, ("lora_r", "lora_alpha"))
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout: expected a value in [0, 1), got {self.lora_dropout}")
        check_choices(self, precision=PRECISIONS, fused_kernels=TOGGLES, fused_loss=TOGGLES)
        _check_name("--model", self.model, tuple(PRESETS))
        if self.lora:
            require_package("peft", "--lora", "peft")
        self._validate_lora()

    def _validate_lora(self) -> None:
        """--fused-lora and --load-in-4bit: what they need (the device is checked at start)."""
        for name, on in (("--fused-lora", self.fused_lora), ("--load-in-4bit", self.load_in_4bit)):
            if on and not self.lora:
                raise ValueError(f"{name} applies to LoRA training: add --lora or drop {name}")
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
        require_package("bitsandbytes", "--load-in-4bit", "qlora")


@dataclass
class DataOptions:
    """The training and eval data: source, format, tokenization and micro-batches (consumed by
    ``data.py`` and ``batching.py``)."""

    dataset: str = option(
        "builtin",
        "'builtin' (deterministic synthetic instructions), a local .json/.jsonl/.parquet "
        "file, or a hub dataset id (needs `datasets`)",
    )
    dataset_config: str | None = option(None, "hub dataset configuration name")
    dataset_split: str = option("train", "hub dataset split")
    format: str = option(
        "auto",
        "record format: alpaca (instruction/input/output or prompt/completion), chat "
        "(messages, rendered by the tokenizer's chat template), text; auto: from the fields",
        choices=FORMATS,
    )
    text_field: str = option("text", "field holding the text for --format text")
    messages_field: str = option("messages", "field holding the messages for --format chat")
    completion_only: bool = option(
        True, "instruction formats: loss on the response tokens only (prompt labels = -100)"
    )
    skip_bad_records: bool = option(
        False,
        "skip records that are not valid JSON or lack a needed field or have a null / non-string "
        "one (counted in the summary) instead of stopping at the first",
    )
    max_examples: int | None = option(None, "use only the first N examples of the dataset")
    builtin_examples: int = option(
        300,
        "number of examples the built-in dataset generates (300: the main job, about a minute "
        "on 2 CPU cores)",
    )
    max_length: int = option(1024, "truncate each example to this many tokens")
    tokens_per_batch: int | None = option(
        None,
        "token budget of one packed micro-batch per device (>= max_length); default 4096 "
        "unless --batch-size is given",
    )
    batch_size: int | None = option(
        None,
        "examples per micro-batch per device (the classic per-device batch size) instead of a "
        "token budget: consecutive examples of one seeded shuffle, packed into one row (or "
        "padded to [B, L_max] with --padded)",
    )
    shuffle: bool = option(True, "shuffle the order of the packed micro-batches every epoch")
    pad_to_multiple_of: int | None = option(
        None, "pad each packed micro-batch to a multiple of this many tokens (a separate segment)"
    )
    static_shapes: bool | None = option(
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
    eval_split: float = option(0.0, "fraction of the data held out for the eval loss")
    eval_dataset: str | None = option(None, "separate eval dataset (same format)")

    @property
    def token_budget(self) -> int:
        """Tokens one micro-batch may hold: --tokens-per-batch, or batch_size x max_length."""
        if self.batch_size is not None:
            return self.batch_size * self.max_length
        return DEFAULT_TOKENS_PER_BATCH if self.tokens_per_batch is None else self.tokens_per_batch

    def validate(self) -> None:
        from ..ops.common import check_int

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
        if self.static_shapes and self.pad_to_multiple_of is not None:
            raise ValueError(
                f"--static-shapes and --pad-to-multiple-of {self.pad_to_multiple_of} both set the "
                "padded length of a micro-batch; pass only one"
            )
        check_ints(self, 1, ("builtin_examples",))
        check_ints(
            self, 1, ("max_examples", "pad_to_multiple_of", "tokens_per_batch"), allow_none=True
        )
        _check_name("--dataset", self.dataset, ("builtin",))
        if self.token_budget < self.max_length:
            raise ValueError(
                f"--tokens-per-batch: expected >= --max-length ({self.max_length}) so that the "
                f"longest example fits one micro-batch, got {self.token_budget}; raise "
                "--tokens-per-batch or lower --max-length"
            )
        if not 0.0 <= self.eval_split < 1.0:
            raise ValueError(f"--eval-split: expected a fraction in [0, 1), got {self.eval_split}")
        check_choices(self, format=FORMATS)
