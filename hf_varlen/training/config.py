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
import os
from dataclasses import dataclass
from typing import Any

from .options import (
    DEFAULT_TOKENS_PER_BATCH,
    FORMATS,
    NONFINITE,
    OPTIMIZERS,
    PRECISIONS,
    PROFILE_DIR,
    REPORT_TO,
    SCHEDULES,
    TENSORBOARD_DIR,
    TOGGLES,
    TRACKERS,
    DataOptions,
    ModelOptions,
    flag,
)
from .run_options import CheckpointOptions, CompileOptions, LoggingOptions, OptimOptions

__all__ = [
    "COMMON", "DEFAULT_TOKENS_PER_BATCH", "FORMATS", "HELP_GROUPS", "LOGGING_GROUP", "NONFINITE",
    "OPTIMIZERS", "PRECISIONS", "PROFILE_DIR", "REPORT_TO", "SCHEDULES", "SECTIONS",
    "TENSORBOARD_DIR", "TOGGLES", "TRACKERS", "TrainConfig", "add_train_arguments",
    "config_from_args", "load_config_file", "parse_args", "parse_train_args",
]  # fmt: skip

# The sections in the order of TrainConfig's fields, by the name a nested YAML ``--config`` file
# may use for each (``optimisation: {lr: 1e-4}``); flat keys (``lr: 1e-4``) work as they always did.
SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "data": DataOptions,
    "optimisation": OptimOptions,
    "compile": CompileOptions,
    "checkpointing": CheckpointOptions,
    "logging": LoggingOptions,
}


@dataclass
class TrainConfig(
    LoggingOptions, CheckpointOptions, CompileOptions, OptimOptions, DataOptions, ModelOptions
):
    """All options of a training run. Defaults train the built-in tiny model on built-in data.

    One flat dataclass made of the sections (options.py / run_options.py), each of which a
    component owns and validates: the flat surface (``cfg.lr``, ``TrainConfig(lr=...)``, the
    ``--lr`` flag, the ``lr:`` YAML key) is what users and saved ``config.yaml`` files know, and a
    ``TrainConfig`` passes for any one section (it inherits them all), so nothing converts between
    the two. ``section(OptimOptions)`` gives one section as its own object."""

    def validate(self) -> None:
        """Checks that need nothing but the options, section by section. Raises
        ValueError/TypeError/ImportError with a hint."""
        for section in SECTIONS.values():
            section.validate(self)
        # The one check across sections: static shapes are a packing choice the padded baseline
        # (a model-side choice of attention) has no use for.
        if self.static_shapes and self.padded:
            raise ValueError(
                "--static-shapes buckets packed rows; --padded batches are [B, L_max] with an "
                "attention mask, where it means nothing. Drop one of the two"
            )

    def section(self, kind: type) -> Any:
        """The options of the section ``kind`` (e.g. ``OptimOptions``) as an object of their own."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save_yaml(self, path: str) -> None:
        """Write the options as a ``--config`` file (``hf-varlen train --config PATH`` re-runs).
        Flat keys, as every earlier run wrote them."""
        import yaml

        header = "# hf-varlen train --config this file (flags given with it override its keys)\n"
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(header + yaml.safe_dump(self.to_dict(), sort_keys=False))


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


def _flat_items(path: str, data: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of a ``--config`` mapping with its sections opened: a section name
    (SECTIONS) whose value is a mapping holds that section's keys. ``model`` and ``compile`` are
    also options: a string or a boolean there is the option itself."""
    items = []
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(SECTIONS[key])}
            for inner, inner_value in value.items():
                if inner not in names:
                    raise ValueError(
                        f"--config {path}: {key}: {inner!r} is not an option of the {key} section "
                        f"(its options: {', '.join(sorted(names))})"
                    )
                items.append((inner, inner_value))
        else:
            items.append((key, value))
    keys = [k for k, _ in items]
    twice = sorted({str(k) for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"--config {path}: {', '.join(twice)} given twice (flat and in a section)")
    return items


def load_config_file(path: str) -> dict[str, Any]:
    """The options of a YAML ``--config`` file: a mapping whose keys are TrainConfig field names
    (the flags with underscores: ``max_steps`` for ``--max-steps``), flat as every run saves them
    or grouped by section (``optimisation: {lr: 1e-4}``, SECTIONS). Unknown keys, wrong types and
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
    for key, value in _flat_items(path, data):
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
    option_flag = "--" + flag(f.name)
    help_text = f.metadata["help"]
    hint = str(f.type)
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    if hint in ("bool", "bool | None"):  # None: unset (auto)
        help_text += f" (default: {_default_text(f.default)})"
        group.add_argument(
            option_flag, action=argparse.BooleanOptionalAction, help=help_text, **kwargs
        )
        return
    base = {"int": int, "float": float}.get(hint.split(" ")[0], str)
    kwargs["type"] = _parse_optional(base) if "None" in hint else base
    if base is not str and "choices" not in kwargs:
        kwargs["metavar"] = "N" if base is int else "X"
    if f.default is not None and "default" not in help_text:
        help_text += f" (default: {_default_text(f.default)})"
    group.add_argument(option_flag, help=help_text, **kwargs)


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
