"""The accelerate-launched trainer behind ``hf-varlen train`` (see ``hf_varlen.train``).

Modules: ``config`` (options), ``builtin`` (default tokenizer, data, model shapes), ``data``
(loading, formats, tokenization, batches), ``model`` (tokenizer/model construction and checks),
``loop`` (the training loop), ``checkpoint`` (save / exact resume / export), ``metrics`` (progress,
JSONL, summary, MFU, plots).
"""

from __future__ import annotations

from .config import TrainConfig, parse_args
from .loop import Trainer, train
from .metrics import plot_runs

__all__ = ["TrainConfig", "Trainer", "parse_args", "plot_runs", "train"]
