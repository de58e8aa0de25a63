"""The ``hf-varlen`` console script.

    hf-varlen train [options]            # train (hf-varlen train --help; hf_varlen.training)
    accelerate launch [--config_file scripts/accelerate/X.yaml] -m hf_varlen.cli train [options]
    hf-varlen plot RUN_DIR [RUN_DIR ...] # overlay loss / throughput curves (--labels, --out)

Errors read like a tool's: one ``hf-varlen: error: ...`` line on stderr. Exit status 2 for usage
and configuration errors (argparse's convention: bad flags, and everything wrong with the options,
the data, the model or the checkpoint found before the first step), 1 for failures while training
(a non-finite step, a failed save, out of memory), 130 when interrupted. ``--debug`` (or
``HF_VARLEN_DEBUG=1``) prints the traceback too. Heavy modules (torch, transformers) are imported
only after the flags parsed, so ``--help`` and flag errors stay quick.
"""

from __future__ import annotations

import argparse
import os
import sys

DEBUG_ENV = "HF_VARLEN_DEBUG"
USAGE = 2
FAILURE = 1
COMMANDS = {"train": "train a model (packed, padding-free)", "plot": "plot finished runs"}


class _Failure(Exception):
    """An error to report as one line with exit status ``code``."""

    def __init__(self, exc: BaseException, code: int):
        super().__init__(str(exc))
        self.exc, self.code = exc, code


def _debug_requested() -> bool:
    # Not ops.common.env_flag: importing hf_varlen.ops pulls in torch before the flags parse.
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _usage_errors() -> tuple[type[BaseException], ...]:
    from .training.checkpoint import CheckpointError

    return (ValueError, TypeError, ImportError, FileNotFoundError, CheckpointError)


def _train_parser() -> argparse.ArgumentParser:
    from .training.config import add_train_arguments

    parser = argparse.ArgumentParser(
        prog="hf-varlen train",
        description="Packed, padding-free fine-tuning of a Hugging Face causal LM "
        "(launch with `accelerate launch -m hf_varlen.cli train` for several processes).",
    )
    add_train_arguments(parser)
    parser.add_argument(
        "--debug", action="store_true", help=f"print tracebacks of errors (or {DEBUG_ENV}=1)"
    )
    return parser


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
    except Exception as exc:
        raise _Failure(exc, FAILURE) from exc


def _plot(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="hf-varlen plot", description="Plot loss and tokens/s of one or more runs."
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
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    here = os.path.dirname(os.path.abspath(__file__))
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(here)


def _message(exc: BaseException) -> str:
    """The error on one line; errors raised inside other libraries keep their type's name."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if _raised_by_us(exc) else f"{type(exc).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = _debug_requested() or "--debug" in argv
    if argv and argv[0] == "--debug":
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: hf-varlen [--debug] {train,plot} [options]\n")
        for name, text in COMMANDS.items():
            print(f"  {name:<6} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"hf-varlen: error: unknown command {argv[0]!r}", file=sys.stderr)
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
    except KeyboardInterrupt:
        print("hf-varlen: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
