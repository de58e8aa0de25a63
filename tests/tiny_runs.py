"""A few-step ``hf-varlen train`` configuration for the trainer tests (CPU, built-in data).

tiny_train_config(tmp_path, name, **overrides)   TrainConfig writing to tmp_path / name: 64
                                                 built-in examples, max_length 128, 384-token
                                                 micro-batches, 5 steps, no progress bar, no export
epoch_train_config(tmp_path, **overrides)        to tmp_path / "run": 48 built-in examples,
                                                 max_length 256, 512-token micro-batches, whole
                                                 epochs (no max_steps)
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
        # The eager step these tests were written for (the default, auto, captures on CUDA);
        # tests of the captured step or of auto ask for it by name.
        cuda_graphs="off",
    )
    return TrainConfig(**{**base, **overrides})


def epoch_train_config(tmp_path, **overrides) -> TrainConfig:
    base = dict(builtin_examples=48, max_length=256, tokens_per_batch=512, max_steps=None)
    return tiny_train_config(tmp_path, "run", **{**base, **overrides})
