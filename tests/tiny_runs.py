"""A few-step ``hf-varlen train`` configuration for the trainer tests (CPU, built-in data).

tiny_train_config(tmp_path, name, **overrides)   TrainConfig writing to tmp_path / name: 64
                                                 built-in examples, max_length 128, 384-token
                                                 micro-batches, 5 steps, no progress bar, no export
"""

from __future__ import annotations

from hf_varlen.training import TrainConfig


def tiny_train_config(tmp_path, name, **overrides) -> TrainConfig:
    base = dict(
        output_dir=str(tmp_path / name),
        builtin_examples=64,
        max_length=128,
        tokens_per_batch=384,
        max_steps=5,
        progress=False,
        save_final=False,
    )
    return TrainConfig(**{**base, **overrides})
