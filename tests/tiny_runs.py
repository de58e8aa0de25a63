"""A few-step ``hf-varlen train`` configuration for the trainer tests (CPU, built-in data).

tiny_train_config(tmp_path, name, **overrides)   TrainConfig writing to tmp_path / name: 64
                                                 built-in examples, max_length 128, 384-token
                                                 micro-batches, 5 steps, no progress bar, no export
epoch_train_config(tmp_path, **overrides)        to tmp_path / "run": 48 built-in examples,
                                                 max_length 256, 512-token micro-batches, whole
                                                 epochs (no max_steps)
HF_CPU_STEPS                                     TrainingArguments / SFTConfig keys of a few
                                                 logged CPU steps: batch 4, lr 1e-3, a loss per
                                                 step, nothing saved or reported, seeded
"""

from __future__ import annotations

from hf_varlen.training import TrainConfig

HF_CPU_STEPS = dict(
    use_cpu=True,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    seed=0,
    data_seed=0,
)


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


def eager_capture(fn, pool):
    """What the captured-step tests use instead of a CUDA capture on the CPU: the "replay" runs
    the function again on the same static buffers."""
    return fn
