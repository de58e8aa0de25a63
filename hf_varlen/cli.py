"""The ``hf-varlen`` console script.

    hf-varlen train [options]            # train (hf-varlen train --help; hf_varlen.training)
    accelerate launch [--config_file scripts/accelerate/X.yaml] -m hf_varlen.cli train [options]
    hf-varlen plot RUN_DIR [RUN_DIR ...] # overlay loss / throughput curves (--labels, --out)

    hf-varlen --version

Errors read like a tool's: one ``hf-varlen: error: ...`` line on stderr. Exit status 2 for usage
and configuration errors (argparse's convention: bad or misspelled flags -- with the closest flag,
abbreviations refused --, and everything wrong with the options, the data, the model, the Hub or
the network, or the checkpoint, found before the first step), 1 for failures while training (a
non-finite step, a failed save, out of memory), 130 when interrupted (with how to resume when a
checkpoint exists). docs/cli.md lists them. ``--debug`` (or ``HF_VARLEN_DEBUG=1``) prints the
traceback too. Heavy modules (torch, transformers) are imported only after the flags parsed, so
``--help`` and flag errors stay quick.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import sys

from . import __version__

DEBUG_ENV = "HF_VARLEN_DEBUG"
USAGE = 2
FAILURE = 1
INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
PLOT_EXTRA = "hf_varlen[plot]"
COMMANDS = {"train": "train a model (packed, padding-free)", "plot": "plot finished runs"}


class _Failure(Exception):
    """An error to report as one line with exit status ``code``."""

    def __init__(self, exc: BaseException, code: int):
        super().__init__(str(exc))
        self.exc, self.code = exc, code


class Parser(argparse.ArgumentParser):
    """argparse with abbreviations refused (``--max-step`` is not ``--max-steps``) and every error
    one ``hf-varlen: error:`` line, a misspelled flag with the closest one, instead of the usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized(extras[0]))
        return namespace

    def _unrecognized(self, first: str) -> str:
        if not first.startswith("-"):
            return f"unexpected argument {first!r} (see {self.prog} --help)"
        flag = first.split("=", 1)[0]
        known = [s for action in self._actions for s in action.option_strings if len(s) > 2]
        # A prefix (an abbreviation) names its flag first; otherwise the closest spelling.
        pool = [k for k in known if k.startswith(flag)] or known
        close = difflib.get_close_matches(flag, pool, n=1, cutoff=0.6 if pool is known else 0)
        hint = f"did you mean {close[0]}?" if close else f"see {self.prog} --help"
        return f"unrecognized argument {flag} ({hint})"

    def error(self, message: str):
        self.exit(USAGE, f"hf-varlen: error: {message}\n")


def _debug_requested() -> bool:
    # Not ops.common.env_flag: importing hf_varlen.ops pulls in torch before the flags parse.
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _usage_errors() -> tuple[type[BaseException], ...]:
    from .training.checkpoint import CheckpointError

    # ConnectionError: the Hub cannot be reached (or HF_HUB_OFFLINE=1) for a --model, --tokenizer
    # or --dataset id; _hub_errors: the Hub answered that it has no such repository.
    return (
        ValueError, TypeError, ImportError, FileNotFoundError, ConnectionError, CheckpointError,
        *_hub_errors(),
    )  # fmt: skip


def _hub_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub's and datasets' "no such repository / file / revision" errors."""
    errors: list[type[BaseException]] = []
    try:
        from huggingface_hub import errors as hub

        errors += [hub.RepositoryNotFoundError, hub.RevisionNotFoundError, hub.EntryNotFoundError]
        errors += [hub.LocalEntryNotFoundError, hub.GatedRepoError, hub.OfflineModeIsEnabled]
    except (ImportError, AttributeError):  # an older huggingface_hub: the base cases still hold
        pass
    try:
        from datasets.exceptions import DatasetNotFoundError

        errors.append(DatasetNotFoundError)
    except ImportError:  # datasets is optional (the trl extra)
        pass
    return tuple(errors)


class _HelpFormatter(argparse.HelpFormatter):
    """Wider option column, so the grouped --help reads as a table."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=32, width=100)


def _train_parser() -> argparse.ArgumentParser:
    from .training.config import LOGGING_GROUP, add_train_arguments

    parser = Parser(
        prog="hf-varlen train",
        usage="%(prog)s [options]    (common options first, then one group per topic)",
        description="Packed, padding-free fine-tuning of a Hugging Face causal LM. With no "
        "options: a tiny random-init Llama on the built-in demo data, on the CPU (about a "
        "minute). Several processes: `accelerate launch -m hf_varlen.cli train ...`.",
        epilog="Booleans take --x / --no-x. Exit status: 0 done, 2 bad options / data / model / "
        "network (one 'hf-varlen: error:' line), 1 failed while training, 130 interrupted.",
        formatter_class=_HelpFormatter,
    )
    groups = add_train_arguments(parser)
    groups[LOGGING_GROUP].add_argument(
        "--debug", action="store_true", help=f"print tracebacks of errors (or {DEBUG_ENV}=1)"
    )
    parser.add_argument("--version", action="version", version=f"hf-varlen {__version__}")
    return parser


class _Interrupted(Exception):
    """Ctrl-C during a run: exit 130 with how to resume (``hint``), when a checkpoint exists."""

    def __init__(self, hint: str):
        super().__init__(hint)
        self.hint = hint


def _resume_hint(argv: list[str], output_dir: str) -> str:
    """How to continue an interrupted run: the same command with --resume latest, when
    ``output_dir`` holds a checkpoint to continue from; else why there is none."""
    from .training.checkpoint import checkpoints

    saved = checkpoints(output_dir)
    if not saved:
        return (
            f"no checkpoint was saved in {output_dir} (--save-every N saves one every N steps), "
            "so the run cannot be resumed"
        )
    keep, skip = [], False
    for arg in argv:  # drop an earlier --resume X / --resume=X / --overwrite-output-dir
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith(("--resume=", "--overwrite-output-dir")):
            keep.append(arg)
    command = shlex.join(["hf-varlen", "train", *keep, "--resume", "latest"])
    return f"the newest checkpoint is {saved[0]}; to continue from it: {command}"


def _train(argv: list[str]) -> dict:
    """Parse the flags after ``train``, run, and return the summary."""
    from .training.config import config_from_args, parse_train_args

    try:
        args = parse_train_args(_train_parser(), argv)
    except (ValueError, FileNotFoundError) as exc:  # a bad --config file
        raise _Failure(exc, USAGE) from exc
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    try:
        from .training import PackedTrainer

        trainer = PackedTrainer(cfg)
    except _usage_errors() as exc:
        raise _Failure(exc, USAGE) from exc
    except Exception as exc:
        raise _Failure(exc, FAILURE) from exc
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm():  # log lines go above the progress bar, not through it
            summary = trainer.run()
        trainer.close()  # this process trains nothing more: end its process group
        return summary
    except KeyboardInterrupt:
        raise _Interrupted(_resume_hint(argv, cfg.output_dir)) from None
    except Exception as exc:
        raise _Failure(exc, FAILURE) from exc


def _plot(argv: list[str]) -> None:
    parser = Parser(
        prog="hf-varlen plot",
        description="Plot loss and tokens/s of one or more runs (needs matplotlib: "
        f"pip install '{PLOT_EXTRA}').",
    )
    parser.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--out", default="runs/plots", help="folder for the PNGs")
    parser.add_argument("--labels", default=None, help="comma-separated labels, one per run")
    parser.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        parser.error(f"--labels: expected {len(args.runs)} labels, got {len(labels)}")
    missing = [r for r in args.runs if not os.path.isfile(os.path.join(r, "metrics.jsonl"))]
    if missing:
        parser.error(f"no metrics.jsonl in {', '.join(missing)}")
    try:
        import matplotlib  # noqa: F401  (the plot extra)
    except ImportError:
        message = f"hf-varlen plot needs matplotlib: pip install '{PLOT_EXTRA}'"
        raise _Failure(ImportError(message), USAGE) from None
    try:
        from .training.metrics import plot_runs

        paths = plot_runs(args.runs, args.out, labels)
    except ImportError as exc:
        raise _Failure(exc, USAGE) from exc
    except Exception as exc:
        raise _Failure(exc, FAILURE) from exc
    for path in paths:
        print(path)


def _where() -> str:
    """' (rank N)' in a multi-process launch, so interleaved error lines say who failed."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f" (rank {os.environ.get('RANK', '?')})" if world > 1 else ""


def _raised_by_us(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc`` is hf_varlen code (its message is ours)."""
    tb = exc.__traceback__
    if tb is None:  # built here and never raised (a _Failure's message)
        return True
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    here = os.path.dirname(os.path.abspath(__file__))
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(here)


def _message(exc: BaseException) -> str:
    """The error on one line; errors raised inside other libraries keep their type's name."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if _raised_by_us(exc) else f"{type(exc).__name__}: {text}"


def _top_level_usage() -> None:
    print("usage: hf-varlen [--debug] {train,plot} [options]   (hf-varlen train --help)")
    print("       hf-varlen --version\n")
    for name, text in COMMANDS.items():
        print(f"  {name:<6} {text}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = _debug_requested() or "--debug" in argv
    if argv and argv[0] == "--debug":
        argv = argv[1:]
    if argv and argv[0] in ("-V", "--version"):
        print(f"hf-varlen {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        _top_level_usage()
        if argv and argv[0] not in ("-h", "--help"):
            close = difflib.get_close_matches(argv[0], COMMANDS, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            print(f"hf-varlen: error: unknown command {argv[0]!r}{hint}", file=sys.stderr)
            return USAGE
        return 0
    try:
        if argv[0] == "plot":
            _plot(argv[1:])
        else:
            _train(argv[1:])
    except _Failure as failure:
        if debug:
            import traceback

            traceback.print_exception(failure.exc)
        print(f"hf-varlen: error{_where()}: {_message(failure.exc)}", file=sys.stderr, flush=True)
        return failure.code
    except _Interrupted as interrupted:
        print(f"hf-varlen: interrupted{_where()}; {interrupted.hint}", file=sys.stderr, flush=True)
        return INTERRUPTED
    except KeyboardInterrupt:
        print("hf-varlen: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
