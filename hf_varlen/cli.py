"""The ``hf-varlen`` console script.

hf-varlen train [options]            # train (hf-varlen train --help; hf_varlen.training)
accelerate launch [--config_file scripts/accelerate/X.yaml] -m hf_varlen.cli train [options]
hf-varlen plot RUN_DIR [RUN_DIR ...] # overlay loss / throughput curves (--labels, --out)
"""

from __future__ import annotations

import argparse
import sys


def _plot(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="hf-varlen plot", description="Plot loss and tokens/s of one or more runs."
    )
    parser.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--out", default="runs/plots", help="folder for the PNGs")
    parser.add_argument("--labels", default=None, help="comma-separated labels, one per run")
    args = parser.parse_args(argv)
    from .training.metrics import plot_runs

    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        parser.error(f"--labels: expected {len(args.runs)} labels, got {len(labels)}")
    for path in plot_runs(args.runs, args.out, labels):
        print(path)


def _train(argv: list[str]) -> dict:
    """Parse the flags after ``train``, run, and return the summary."""
    import logging

    from .training import parse_args, run

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"train": "train a model (packed, padding-free)", "plot": "plot finished runs"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: hf-varlen {train,plot} [options]\n")
        for name, text in commands.items():
            print(f"  {name:<6} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nhf-varlen: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    if argv[0] == "plot":
        _plot(argv[1:])
        return 0
    _train(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
