"""The pieces a ``PackedTrainer`` is built from, one small function each, in the order it builds
them: the accelerator, the run folder, the data, the samplers, the model, the step mode, the
optimizer and schedule, the run state's fingerprint, the resumed state.

Each takes the options it reads and returns what it built, so a custom loop can reuse any one of
them (``loop.py`` holds the trainer that calls them and the training step).
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

import torch
from safetensors import SafetensorError

from ..captured_step import capture_bytes, model_blockers
from ..packing import ExampleCountBatchSampler, TokenBudgetBatchSampler
from . import checkpoint as ckpt
from .config import TrainConfig
from .data import detect_format, load_records
from .examples import Examples, split_eval, tokenize
from .fingerprint import DATA_KEY, MODEL_KEY, data_fingerprint, model_fingerprint
from .graphs import resolve_graphs
from .launch import cpu_requested, release_stale_state
from .model import build_model, scope_backend
from .model_kernels import apply_kernels, apply_lora
from .options import PROFILE_DIR, TENSORBOARD_DIR
from .output_dir import check_output_paths, prepare_output_dir, resolve_resume
from .run_options import OptimOptions

CONFIG_FILE = "config.yaml"  # in --output-dir
METRICS_FILE = "metrics.jsonl"


def build_accelerator(cfg: TrainConfig):
    """The run's ``Accelerator`` and whether it autocasts (bf16-mixed). Scheduler stepping is the
    loop's (one step per optimizer step, not one per process). Without CUDA, cpu=True makes
    torchrun-launched processes (LOCAL_RANK set) use gloo."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    mixed = cfg.precision == "bf16-mixed" or (
        cfg.precision == "auto" and os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16"
    )
    trackers = {}
    if cfg.report_to != "none":  # accelerate's trackers; validate() checked the package
        from accelerate.utils import ProjectConfiguration

        logging_dir = os.path.join(cfg.output_dir, TENSORBOARD_DIR)
        trackers = dict(
            log_with=cfg.report_to,
            project_config=ProjectConfiguration(cfg.output_dir, logging_dir=logging_dir),
        )
    # The process group's timeout applies where this Accelerator creates the group (a
    # launched script that made it earlier keeps its own).
    group = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.ddp_timeout))
    release_stale_state("bf16" if mixed else "no")
    acc = Accelerator(
        mixed_precision="bf16" if mixed else "no",
        step_scheduler_with_optimizer=False,
        cpu=cpu_requested(),
        kwargs_handlers=[group],
        **trackers,
    )
    if trackers and not acc.log_with:
        from accelerate.tracking import get_available_trackers

        # accelerate drops a tracker it did not find when it was imported, with a warning.
        raise ImportError(
            f"--report-to {cfg.report_to}: accelerate found no such tracker installed "
            f"(its list: {[str(t) for t in get_available_trackers()]}); install it in this "
            "environment or drop --report-to"
        )
    return acc, mixed


def prepare_output(cfg: TrainConfig, acc) -> str | None:
    """Check the checkpoint to resume from and the output folder before anything is loaded, then
    record the resolved options there (``hf-varlen train --config`` re-runs them). Returns the
    checkpoint folder to resume from, or None."""
    resumed_from = resolve_resume(
        cfg.resume,
        cfg.output_dir,
        processes=acc.num_processes,
        without_rng=cfg.resume_without_rng,
    )
    check_output_paths(
        cfg.output_dir,
        files=(CONFIG_FILE, METRICS_FILE, "summary.json"),
        folders=(
            *(["final"] if cfg.save_final else []),
            *([TENSORBOARD_DIR] if cfg.report_to == "tensorboard" else []),
            *([PROFILE_DIR] if cfg.profile_step else []),
        ),
    )
    prepare_output_dir(cfg.output_dir, cfg.overwrite_output_dir, resumed_from, acc)
    if acc.is_main_process:
        os.makedirs(cfg.output_dir, exist_ok=True)
        cfg.save_yaml(os.path.join(cfg.output_dir, CONFIG_FILE))
    return resumed_from


def load_train_data(cfg: TrainConfig, tokenizer) -> tuple[str, int, Examples, Examples | None]:
    """(format, skipped records, training examples, held-out eval examples or None)."""
    records = load_records(cfg.dataset, cfg)
    fmt = detect_format(records, cfg, cfg.dataset)
    train, held_out = split_eval(tokenize(records, fmt, tokenizer, cfg), cfg.eval_split, cfg.seed)
    return fmt, records.skipped, train, held_out


def load_eval_data(cfg: TrainConfig, tokenizer) -> tuple[Examples, int]:
    """--eval-dataset's examples and its skipped records."""
    records = load_records(cfg.eval_dataset, cfg, "--eval-dataset")
    fmt = detect_format(records, cfg, cfg.eval_dataset)
    return tokenize(records, fmt, tokenizer, cfg), records.skipped


def make_sampler(examples: Examples, cfg: TrainConfig, acc, shuffle: bool):
    """This rank's batch sampler: by examples (--batch-size) or by token budget."""
    common = dict(
        shuffle=shuffle and cfg.shuffle,
        seed=cfg.seed,
        num_replicas=acc.num_processes,
        rank=acc.process_index,
    )
    if cfg.batch_size is not None:
        return ExampleCountBatchSampler(examples.lengths, cfg.batch_size, **common)
    return TokenBudgetBatchSampler(examples.lengths, cfg.token_budget, **common)


def real_tokens_per_micro_batch(cfg: TrainConfig, train: Examples) -> float:
    """What the auto step-mode rule reads: --batch-size x the mean example length, or the token
    budget (packing fills a micro-batch to within a few percent of it)."""
    if cfg.batch_size is not None and len(train):
        return cfg.batch_size * float(train.lengths.mean())
    return float(cfg.token_budget)


def build_training_model(
    cfg: TrainConfig, tokenizer, precision: str, device, graphs_on: bool, model_hook=None
) -> tuple[Any, str, bool, str]:
    """The model as it trains: built, its attention backend scoped, ``model_hook`` applied,
    gradient checkpointing, LoRA, then hf_varlen's kernels. Returns (model, kernels text, whether
    the fused cross-entropy runs, loss text)."""
    model = build_model(cfg, tokenizer, precision, device)
    scope_backend(model, cfg)
    if model_hook is not None:
        model_hook(model)
    if cfg.gradient_checkpointing:
        checkpointing_kwargs = {"use_reentrant": False}
        if graphs_on:  # a capture cannot save / restore the RNG state (training/graphs.py)
            checkpointing_kwargs["preserve_rng_state"] = False
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name
            model.activation_checkpointing_enable(checkpointing_kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
    if cfg.lora:
        model = apply_lora(model, cfg)
    # Kernels after LoRA: kernelize sees the peft model (its GLU layers call the LoRA-wrapped
    # projections, so the adapters keep running; --fused-lora puts those LoRA layers on the
    # one-op LoRA projection).
    kernels, fused_ce, loss_impl = apply_kernels(model, cfg, device)
    return model, kernels, fused_ce, loss_impl


def graphs_for_model(
    cfg: TrainConfig,
    model,
    device: torch.device,
    processes: int,
    precision: str,
    tokens: float,
    decision: tuple[bool, str],
) -> tuple[bool, str]:
    """The step mode ``decision`` (on, note) revisited with the built model: what in it blocks a
    capture, and on CUDA whether the captures fit in the free memory."""
    from ..integrations.linear_attention import capture_blockers

    graphs_on, note = decision
    if graphs_on and (blockers := model_blockers(model) + capture_blockers(model)):
        if cfg.cuda_graphs == "on":
            raise ValueError("--cuda-graphs on cannot be honoured: " + "; ".join(blockers))
        return False, "eager (auto: " + "; ".join(blockers) + ")"
    if not (graphs_on and device.type == "cuda"):
        return graphs_on, note
    shape = getattr(model, "config", None)
    hidden = getattr(shape, "hidden_size", None)
    layers = getattr(shape, "num_hidden_layers", None)
    if not (hidden and layers):
        return graphs_on, note
    # Still to come besides the captures: each trained parameter's gradient and two AdamW
    # moments, and the weights a loaded model has on the host until prepare().
    later = sum(
        p.numel() * p.element_size() * (3 * p.requires_grad + (p.device.type != "cuda"))
        for p in model.parameters()
    )
    return resolve_graphs(
        cfg,
        device,
        processes,
        precision,
        real_tokens=int(tokens),
        free_bytes=torch.cuda.mem_get_info(device)[0],
        # shapes of the size of real micro-batches (the budget is only a bound)
        need_bytes=capture_bytes(int(tokens), hidden, layers) + later,
    )


def default_lr(cfg: TrainConfig) -> float:
    """--lr, or the default: 1e-3 for random-init presets, 2e-4 for LoRA, else 2e-5."""
    from .builtin import PRESETS

    if cfg.lr is not None:
        return cfg.lr
    if cfg.lora:
        return 2e-4
    return 1e-3 if cfg.model in PRESETS else 2e-5


def make_optimizer(model, cfg: OptimOptions, lr: float, device: torch.device):
    """SGD, or AdamW (fused on CUDA) with no weight decay on norms and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optim == "sgd":
        return torch.optim.SGD(params, lr=lr)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]  # norms and biases are not decayed
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), fused=device.type == "cuda")


def make_scheduler(cfg: OptimOptions, optimizer, total_steps: int):
    """--lr-schedule over ``total_steps``, warming up for --warmup-steps (default: 5% of them)."""
    from transformers import get_scheduler

    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(0.05 * total_steps)
    return get_scheduler(
        cfg.lr_schedule, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps
    )


def run_fingerprint(
    cfg: TrainConfig, processes: int, model_config, train: Examples
) -> dict[str, Any]:
    """What a checkpoint of this run must share with the run that resumes it (fingerprint.py):
    the data-order options, the model config with the LoRA adapters, the tokenized data."""
    return {
        "seed": cfg.seed,
        "tokens_per_batch": cfg.token_budget,
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "processes": processes,
        "train_examples": len(train),
        "shuffle": cfg.shuffle,
        MODEL_KEY: {
            **model_fingerprint(model_config),
            # LoRA adapters are part of what a checkpoint's weights are
            "lora (--lora-r, --lora-alpha, --lora-target)": (
                [cfg.lora_r, cfg.lora_alpha, cfg.lora_target] if cfg.lora else None
            ),
        },
        DATA_KEY: data_fingerprint(train.input_ids, train.labels),
    }


def load_checkpoint(acc, path: str, fingerprint: dict[str, Any]) -> None:
    """Resume the prepared objects from ``path``: the fingerprint first (before any weight), then
    accelerate's state; a load that fails is a ``CheckpointError`` naming the checkpoint."""
    ckpt.check_fingerprint(path, fingerprint)
    try:
        acc.load_state(path)
    except ckpt.ResumeMismatchError:
        raise
    except (
        OSError, RuntimeError, KeyError, EOFError, ValueError, OverflowError, SafetensorError,
    ) as exc:  # fmt: skip
        raise ckpt.CheckpointError(
            f"--resume {path!r}: loading failed ({type(exc).__name__}: {exc}); the checkpoint is "
            "damaged: resume from another one"
        ) from exc


def init_trackers(acc, cfg: TrainConfig, step: int) -> None:
    """Start --report-to's tracker: the project is --run-name (default: the --output-dir folder's
    name), the options its hyperparameters; ``step`` is where a resumed run starts."""
    name = cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir))
    # Trackers take flat str/int/float/bool hyperparameters (tensorboard: no None).
    hparams = {k: "none" if v is None else v for k, v in cfg.to_dict().items()}
    init_kwargs = {}
    if cfg.report_to == "tensorboard" and step:
        # Resumed: events after the checkpoint's step belong to the run's dead branch (it
        # went on past the checkpoint). metrics.jsonl is truncated for them; for the event
        # files, SummaryWriter's purge_step makes TensorBoard drop them.
        init_kwargs = {"tensorboard": {"purge_step": step + 1}}
    acc.init_trackers(name, config=hparams, init_kwargs=init_kwargs)


def start_run_log(trainer):
    """The run's ``metrics.RunLogger`` (progress, metrics.jsonl, MFU), with the peak-memory counter
    reset on CUDA and --report-to's tracker started (``trainer``: a ``PackedTrainer``)."""
    from .metrics import RunLogger, peak_flops

    cfg, acc, device = trainer.cfg, trainer.acc, trainer.device
    run_log = RunLogger(
        cfg.output_dir,
        main=acc.is_main_process,
        total_steps=trainer.total_steps,
        start_step=trainer.state.step,
        progress=cfg.progress,
        flops_per_token=trainer.flops_per_token,
        attn_dims=trainer.attn_dims,
        peak=peak_flops(device, cfg.peak_tflops),
        world=acc.num_processes,
        device=device,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if cfg.report_to != "none":
        init_trackers(acc, cfg, trainer.state.step)
    return run_log


def make_graphed_step(trainer, loss_fn):
    """The captured step (``graphs.GraphedStep``) of a prepared ``trainer``, with ``loss_fn`` as
    its micro-batch loss; built after the resume, as it turns the restored learning rates into
    device tensors."""
    from .graphs import GraphedStep

    return GraphedStep(
        trainer.model,
        trainer.optimizer,
        loss_fn,
        device=trainer.device,
        max_grad_norm=trainer.cfg.max_grad_norm or math.inf,
        autocast_dtype=torch.bfloat16 if trainer.precision == "bf16-mixed" else None,
        # the loop reads a step's result after launching the next (loop.py's run): with
        # --on-nonfinite stop, that next update must not move the parameters of the failed step
        halt_on_nonfinite=trainer.cfg.on_nonfinite == "stop",
        # one micro-batch per step: one graph per shape holds the whole step, its gradients
        # fresh (no zeroing, no accumulation into static buffers); accumulation keeps those
        fresh_grads=trainer.cfg.grad_accum == 1,
    )
