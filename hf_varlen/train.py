"""``hf-varlen train``: packed, padding-free fine-tuning of a Hugging Face causal LM.

    hf-varlen train                                   # tiny model, built-in data, < 1 min on CPU
    hf-varlen train --model Qwen/Qwen2.5-0.5B --dataset data.jsonl --format chat
    accelerate launch --num_processes 2 -m hf_varlen.cli train ...    # several processes / GPUs
    accelerate launch --config_file scripts/accelerate/fsdp2.yaml scripts/train.py ...

The Python API is ``train(TrainConfig(...))``; every CLI flag is a ``TrainConfig`` field. The
implementation lives in ``hf_varlen.training`` (config, data, model, loop, checkpoint, metrics).
"""

from __future__ import annotations

import logging

from .training import TrainConfig, Trainer, parse_args, plot_runs, train

__all__ = ["TrainConfig", "Trainer", "main", "parse_args", "plot_runs", "train"]


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (the flags after ``train``), run, and return the summary."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return train(parse_args(argv))
