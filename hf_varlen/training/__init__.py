"""``hf-varlen train``: packed, padding-free fine-tuning of a Hugging Face causal LM.

    hf-varlen train                                   # tiny model, built-in data, < 1 min on CPU
    hf-varlen train --model Qwen/Qwen2.5-0.5B --dataset data.jsonl --format chat
    accelerate launch --num_processes 2 -m hf_varlen.cli train ...    # several processes / GPUs
    accelerate launch --config_file scripts/accelerate/fsdp2.yaml -m hf_varlen.cli train ...

Python API: ``run(TrainConfig(...))`` returns the summary dict, or ``PackedTrainer(cfg)`` for the
pieces (``.train_step``, ``.evaluate``, ``.run()``); every CLI flag is a ``TrainConfig`` field.

Modules: ``config`` (options), ``builtin`` (default tokenizer, data, model shapes), ``data``
(loading, formats, tokenization, batches), ``model`` (tokenizer/model construction and checks),
``loop`` (the training loop), ``graphs`` (the CUDA-graph-captured step, ``GraphedStep``, also for
your own loop), ``checkpoint`` (save / exact resume / export), ``metrics`` (progress, JSONL,
summary, MFU, plots).
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import TrainConfig, parse_args

__all__ = ["GraphedStep", "PackedTrainer", "TrainConfig", "parse_args", "plot_runs", "run"]

# The loop pulls in torch, accelerate and transformers: loaded on first use, so that parsing the
# command line (``hf-varlen train --help``) stays quick.
_LAZY = {
    "GraphedStep": "graphs",
    "PackedTrainer": "loop",
    "run": "loop",
    "plot_runs": "metrics",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
