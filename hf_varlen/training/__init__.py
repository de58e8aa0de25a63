"""``hf-varlen train``: packed, padding-free fine-tuning of a Hugging Face causal LM.

    hf-varlen train                                   # tiny model, built-in data, < 1 min on CPU
    hf-varlen train --model Qwen/Qwen2.5-0.5B --dataset data.jsonl --format chat
    accelerate launch --num_processes 2 -m hf_varlen.cli train ...    # several processes / GPUs
    accelerate launch --config_file scripts/accelerate/fsdp2.yaml -m hf_varlen.cli train ...

Python API: ``run(TrainConfig(...))`` returns the summary dict, or ``PackedTrainer(cfg)`` for the
pieces (``.train_step``, ``.evaluate``, ``.run()``); every CLI flag is a ``TrainConfig`` field.

Modules. Options: ``config`` (``TrainConfig``, the parser, ``--config`` files), made of the
sections in ``options`` (data, model) and ``run_options`` (optimisation, compile, checkpointing,
logging), each validated by itself and read by the module that owns it. Data: ``builtin``
(default tokenizer, data, model shapes), ``sources`` (local or Hub), ``data`` (records and their
format), ``examples`` (tokenized, masked examples), ``batching`` (micro-batches). Model: ``model``
(tokenizer/model construction and checks), ``compiling`` (``--compile``). The run: ``builders``
(the pieces ``PackedTrainer`` is built from), ``loop`` (the trainer and its step), ``step`` (the
loss of one micro-batch, the step's counts), ``graphs`` (whether this run's step is captured:
the CUDA-graph step itself and its ``auto`` rule are ``hf_varlen.captured_step``),
``launch`` (processes). Output: ``checkpoint`` (save / validate / export), ``fingerprint`` (what
a resume must share), ``output_dir`` (the run folder, ``--resume``), ``metrics`` / ``run_summary``
/ ``profiling`` (progress, JSONL, summary, MFU, plots, ``--profile-step``).
"""

from __future__ import annotations

from .._lazy import lazy_getattr
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


__getattr__ = lazy_getattr(__name__, _LAZY)
