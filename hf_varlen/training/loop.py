"""The training loop: accelerate, gradient accumulation, exact per-token loss, eval, checkpoints.

Loss. One optimizer step runs ``G`` micro-batches on each of ``R`` ranks. With ``s_{r,g}`` the
summed token cross-entropy of micro-batch ``g`` on rank ``r`` and ``N = sum_{r,g} n_{r,g}`` its
label-token count over the whole step (one all-reduce before the first forward), every micro-batch
back-propagates

    loss_{r,g} = R * s_{r,g} / N

DDP/FSDP average gradients over ranks (the ``1/R`` cancels the ``R``) and accumulation sums over
micro-batches, so the step's gradient is exactly that of ``sum s / N``: the per-token mean over the
full global batch, whatever the split into micro-batches, ranks and packs. The model computes
``s / N`` itself (``num_items_in_batch=N``, so fused cross-entropy kernels still apply); models
whose forward takes no loss kwargs get the same quantity from their logits. Gradient sync runs only
on the last micro-batch (``no_sync`` before).

Ranks. ``TokenBudgetBatchSampler`` gives every rank the same number of micro-batches, balanced by
tokens; an empty slot runs a one-token dummy batch whose loss is multiplied by 0, so every rank
joins every collective (no hang on uneven data) and adds an exact zero.

Failures. A step whose (all-reduced) loss or gradient norm is NaN/inf stops the run with
``NonFiniteError`` before the optimizer update (``--on-nonfinite skip``: the update is skipped,
the schedule still advances, and the summary counts it). A failed save raises ``CheckpointError``.
A new run in an ``--output-dir`` that holds one is refused unless ``--resume`` or
``--overwrite-output-dir`` says what to do with the old one.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import math
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError

from ..captured_step import capture_bytes
from ..coverage import check_pending_offsets
from ..packing import ExampleCountBatchSampler, TokenBudgetBatchSampler, rank_imbalance
from . import checkpoint as ckpt
from .compiling import ModelCompiler, check_compile
from .config import PROFILE_DIR, TENSORBOARD_DIR, TrainConfig
from .data import (
    Batcher,
    Examples,
    MicroBatch,
    detect_format,
    load_records,
    split_eval,
    tokenize,
)
from .graphs import GraphedStep, model_blockers, resolve_graphs
from .launch import cpu_requested, distribution, release_stale_state
from .metrics import (
    RunLogger,
    environment,
    finite_or_none,
    format_summary,
    peak_flops,
    plot_runs,
    summarize,
)
from .model import (
    apply_kernels,
    apply_lora,
    attention_dims,
    attn_implementation,
    build_model,
    check_backend,
    check_load_in_4bit,
    load_tokenizer,
    matmul_flops_per_token,
    pad_id,
    resolve_precision,
    scope_backend,
)
from .profiling import StepProfiler
from .run_summary import data_text, padded_alternative, ranks_summary, static_shapes_summary

logger = logging.getLogger("hf_varlen.training")
CONFIG_FILE = "config.yaml"  # in --output-dir
METRICS_FILE = "metrics.jsonl"
# What goes to --report-to each logged step (names as in metrics.jsonl).
TRACKED = ("loss", "tokens_per_s", "packing_efficiency", "peak_mem_gib", "lr", "grad_norm")


def _accepts_loss_kwargs(model) -> bool:
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or any(
        p.name == "num_items_in_batch" for p in params
    )


def _step_loss(model, inputs: dict[str, Any], n_items, loss_kwargs: bool, **extra) -> torch.Tensor:
    """Summed token CE of ``inputs`` divided by ``n_items`` (tensor or int)."""
    if loss_kwargs:
        return model(**inputs, num_items_in_batch=n_items, **extra).loss
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    ce = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum"
    )
    return ce / n_items


def _read_loss_and_norm(loss: torch.Tensor, grad_norm: Any) -> tuple[float, Any]:
    """(loss, grad norm) as Python floats in one device read instead of two syncs (fp64 holds
    either dtype exactly). A norm that is not a plain tensor on the loss's device (None, a
    DTensor) is returned as it is."""
    if type(grad_norm) is torch.Tensor and grad_norm.device == loss.device:
        loss_value, norm = torch.stack([loss.double(), grad_norm.double().reshape(())]).tolist()
        return loss_value, norm
    return float(loss), grad_norm


def _to_device(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
    }


def _make_optimizer(model, cfg: TrainConfig, lr: float, device: torch.device):
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


def _default_lr(cfg: TrainConfig) -> float:
    from .builtin import PRESETS

    if cfg.lr is not None:
        return cfg.lr
    if cfg.lora:
        return 2e-4
    return 1e-3 if cfg.model in PRESETS else 2e-5


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN/inf (``--on-nonfinite stop``, the default)."""


def _nonfinite_message(step: int, loss: float, grad_norm: float, lr: float) -> str:
    what = (
        f"non-finite loss {loss} (gradient norm {grad_norm})"
        if not math.isfinite(loss)
        else f"non-finite gradient norm {grad_norm} (loss {loss:.4f})"
    )
    return (
        f"step {step}: {what} at lr {lr:.3g}; stopped before the optimizer update (the weights "
        f"after step {step - 1} are intact; nothing more was saved). Hint: lower --lr, keep "
        "--max-grad-norm > 0, try --precision fp32 or bf16-mixed, check the data of this step, "
        "or pass --on-nonfinite skip to skip such steps (counted in the summary)"
    )


class PackedTrainer:
    """One run. ``PackedTrainer(cfg).run()`` returns the summary dict (also written to summary.json).

    ``model_hook`` (Python API only) is called with the freshly built model, before hf_varlen's
    kernels, gradient checkpointing and LoRA: the place for a comparator's own patching (the e2e
    benchmark applies Liger there). What it changes is the user's responsibility.
    """

    def __init__(self, cfg: TrainConfig, *, model_hook=None):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, set_seed

        cfg.validate()
        check_backend(cfg)
        check_compile(cfg)
        self.cfg = cfg
        mixed = cfg.precision == "bf16-mixed" or (
            cfg.precision == "auto" and os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16"
        )
        # Scheduler stepping is ours (one step per optimizer step, not one per process). Without
        # CUDA, cpu=True makes torchrun-launched processes (LOCAL_RANK set) use gloo.
        trackers = {}
        if cfg.report_to != "none":  # accelerate's trackers; validate() checked the package
            from accelerate.tracking import get_available_trackers
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
        self.acc = Accelerator(
            mixed_precision="bf16" if mixed else "no",
            step_scheduler_with_optimizer=False,
            cpu=cpu_requested(),
            kwargs_handlers=[group],
            **trackers,
        )
        if trackers and not self.acc.log_with:
            # accelerate drops a tracker it did not find when it was imported, with a warning.
            raise ImportError(
                f"--report-to {cfg.report_to}: accelerate found no such tracker installed "
                f"(its list: {[str(t) for t in get_available_trackers()]}); install it in this "
                "environment or drop --report-to"
            )
        self.distribution = distribution(self.acc)
        self.device = self.acc.device
        self.precision = "bf16-mixed" if mixed else resolve_precision(cfg, self.device)
        # --cuda-graphs on that cannot be honoured raises here, before anything is loaded.
        graphs_on, self.graphs_note = resolve_graphs(
            cfg, self.device, self.acc.num_processes, self.precision
        )
        check_load_in_4bit(cfg, self.device, self.acc.num_processes)
        set_seed(cfg.seed)
        # The checkpoint and the output folder are checked before anything is loaded.
        self.resumed_from = ckpt.resolve_resume(
            cfg.resume,
            cfg.output_dir,
            processes=self.acc.num_processes,
            without_rng=cfg.resume_without_rng,
        )
        ckpt.check_output_paths(
            cfg.output_dir,
            files=(CONFIG_FILE, METRICS_FILE, "summary.json"),
            folders=(
                *(["final"] if cfg.save_final else []),
                *([TENSORBOARD_DIR] if cfg.report_to == "tensorboard" else []),
                *([PROFILE_DIR] if cfg.profile_step else []),
            ),
        )
        ckpt.prepare_output_dir(
            cfg.output_dir, cfg.overwrite_output_dir, self.resumed_from, self.acc
        )
        if self.acc.is_main_process:  # the resolved options: `hf-varlen train --config` re-runs
            os.makedirs(cfg.output_dir, exist_ok=True)
            cfg.save_yaml(os.path.join(cfg.output_dir, CONFIG_FILE))

        # Data first: its errors are cheaper than loading a model.
        self.tokenizer = load_tokenizer(cfg)
        records = load_records(cfg.dataset, cfg)
        self.format = detect_format(records, cfg, cfg.dataset)
        self.skipped_records = records.skipped
        self.rank_real_tokens = 0  # this rank's real tokens trained in this process (the summary)
        examples = tokenize(records, self.format, self.tokenizer, cfg)
        self.train_ex, self.eval_ex = split_eval(examples, cfg.eval_split, cfg.seed)
        # The step mode by the auto rule, now that the real tokens per micro-batch are known;
        # --static-shapes unset (auto) follows it. The memory check comes once the model is built.
        graphs_on, self.graphs_note = resolve_graphs(
            cfg,
            self.device,
            self.acc.num_processes,
            self.precision,
            real_tokens=self._real_tokens_per_micro_batch(),
        )
        if cfg.static_shapes is None:
            cfg.static_shapes = graphs_on
        if cfg.eval_dataset:
            eval_records = load_records(cfg.eval_dataset, cfg, "--eval-dataset")
            fmt = detect_format(eval_records, cfg, cfg.eval_dataset)
            self.skipped_records += eval_records.skipped
            self.eval_ex = tokenize(eval_records, fmt, self.tokenizer, cfg)
        self.sampler = self._sampler(self.train_ex, shuffle=True)
        self.eval_sampler = self._sampler(self.eval_ex, shuffle=False) if self.eval_ex else None
        self.batcher = Batcher(
            self.train_ex, cfg, pad_id(self.tokenizer), self.sampler.max_documents
        )
        self._collated = None  # (group, micro-batches): the next step's, collated during this one
        self.eval_batcher = (
            Batcher(self.eval_ex, cfg, pad_id(self.tokenizer), self.eval_sampler.max_documents)
            if self.eval_ex
            else None
        )
        # --static-shapes: training micro-batches per bucket on this rank (summed at the end).
        self.bucket_counts = dict.fromkeys(self.batcher.buckets or (), 0)
        per_epoch = math.ceil(len(self.sampler) / cfg.grad_accum)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
        self.profiler = StepProfiler(
            cfg.profile_step, self.total_steps, cfg.output_dir, self.acc.process_index, self.device
        )

        # Model.
        model = build_model(cfg, self.tokenizer, self.precision, self.device)
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
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs=checkpointing_kwargs
                )
        if cfg.lora:
            model = apply_lora(model, cfg)
        # Kernels after LoRA: kernelize sees the peft model (its GLU layers call the LoRA-wrapped
        # projections, so the adapters keep running; --fused-lora puts those LoRA layers on the
        # one-op LoRA projection).
        self.kernels, fused_ce, self.loss_impl = apply_kernels(model, cfg, self.device)
        # The fused CE skips the logits in training; eval asks for it with the wrapped forward's
        # public per-call keyword (hf_varlen.integrations.loss).
        self.eval_kwargs = {"fused_loss": True} if fused_ce else {}
        if graphs_on and (blockers := model_blockers(model)):
            if cfg.cuda_graphs == "on":
                raise ValueError("--cuda-graphs on cannot be honoured: " + "; ".join(blockers))
            graphs_on, self.graphs_note = False, "eager (auto: " + "; ".join(blockers) + ")"
        if graphs_on and self.device.type == "cuda":  # memory headroom before any capture
            shape = getattr(model, "config", None)
            hidden = getattr(shape, "hidden_size", None)
            layers = getattr(shape, "num_hidden_layers", None)
            if hidden and layers:
                # Still to come besides the captures: each trained parameter's gradient and two
                # AdamW moments, and the weights a loaded model has on the host until prepare().
                later = sum(
                    p.numel() * p.element_size() * (3 * p.requires_grad + (p.device.type != "cuda"))
                    for p in model.parameters()
                )
                tokens = int(self._real_tokens_per_micro_batch())
                graphs_on, self.graphs_note = resolve_graphs(
                    cfg,
                    self.device,
                    self.acc.num_processes,
                    self.precision,
                    real_tokens=tokens,
                    free_bytes=torch.cuda.mem_get_info(self.device)[0],
                    # shapes of the size of real micro-batches (the budget is only a bound)
                    need_bytes=capture_bytes(tokens, hidden, layers) + later,
                )
        self.params = sum(p.numel() for p in model.parameters())
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.flops_per_token = matmul_flops_per_token(model)
        self.attn_dims = attention_dims(model)
        self.loss_kwargs = _accepts_loss_kwargs(model)
        self.lr = _default_lr(cfg)
        optimizer = _make_optimizer(model, cfg, self.lr, self.device)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        # Listed once: walking a 1B model's ~200 modules for parameters() costs ~1 ms of host
        # time, every step, where small steps are host-bound (accelerate's FSDP check compares
        # this list with model.parameters(), which holds the same tensors).
        self.clip_params = list(self.model.parameters())
        warmup = (
            cfg.warmup_steps if cfg.warmup_steps is not None else round(0.05 * self.total_steps)
        )
        from transformers import get_scheduler

        self.scheduler = get_scheduler(
            cfg.lr_schedule,
            self.optimizer,
            num_warmup_steps=warmup,
            num_training_steps=self.total_steps,
        )
        self.state = ckpt.RunState(
            fingerprint={
                "seed": cfg.seed,
                "tokens_per_batch": cfg.token_budget,
                "batch_size": cfg.batch_size,
                "grad_accum": cfg.grad_accum,
                "processes": self.acc.num_processes,
                "train_examples": len(self.train_ex),
                "shuffle": cfg.shuffle,
                ckpt.MODEL_KEY: {
                    **ckpt.model_fingerprint(self.acc.unwrap_model(self.model).config),
                    # LoRA adapters are part of what a checkpoint's weights are
                    "lora (--lora-r, --lora-alpha, --lora-target)": (
                        [cfg.lora_r, cfg.lora_alpha, cfg.lora_target] if cfg.lora else None
                    ),
                },
                ckpt.DATA_KEY: ckpt.data_fingerprint(self.train_ex.input_ids, self.train_ex.labels),
            }
        )
        self.acc.register_for_checkpointing(self.scheduler, self.state)
        self._preflight()  # eager: model errors before any compile
        self.compiler = ModelCompiler(cfg)
        self.compiler.compile(self.acc.unwrap_model(self.model))
        if self.resumed_from:
            ckpt.check_fingerprint(self.resumed_from, self.state.fingerprint)
            try:
                self.acc.load_state(self.resumed_from)
            except ckpt.ResumeMismatchError:
                raise
            except (
                OSError, RuntimeError, KeyError, EOFError, ValueError, OverflowError,
                SafetensorError,
            ) as exc:  # fmt: skip
                raise ckpt.CheckpointError(
                    f"--resume {self.resumed_from!r}: loading failed ({type(exc).__name__}: "
                    f"{exc}); the checkpoint is damaged: resume from another one"
                ) from exc
            self._log(f"resumed from {self.resumed_from} at step {self.state.step}")
            self.profiler.check_resume(self.state.step)
        # Built after the resume: it turns the restored learning rates into device tensors.
        self.graphed = (
            GraphedStep(
                self.model,
                self.optimizer,
                self._graph_loss,
                device=self.device,
                max_grad_norm=cfg.max_grad_norm or math.inf,
                autocast_dtype=torch.bfloat16 if self.precision == "bf16-mixed" else None,
            )
            if graphs_on
            else None
        )

    # ------------------------------------------------------------------------------------------ #

    def _real_tokens_per_micro_batch(self) -> float:
        """What the auto rule reads: --batch-size x the mean example length, or the token budget
        (packing fills a micro-batch to within a few percent of it)."""
        if self.cfg.batch_size is not None and len(self.train_ex):
            return self.cfg.batch_size * float(self.train_ex.lengths.mean())
        return float(self.cfg.token_budget)

    def _sampler(self, examples: Examples, shuffle: bool):
        common = dict(
            shuffle=shuffle and self.cfg.shuffle,
            seed=self.cfg.seed,
            num_replicas=self.acc.num_processes,
            rank=self.acc.process_index,
        )
        if self.cfg.batch_size is not None:
            return ExampleCountBatchSampler(examples.lengths, self.cfg.batch_size, **common)
        return TokenBudgetBatchSampler(examples.lengths, self.cfg.token_budget, **common)

    @torch.no_grad()
    def _preflight(self) -> None:
        """A one-token forward on every rank: model/attention errors surface before step 1."""
        self.model.eval()
        try:
            inputs = _to_device(self.batcher.dummy().inputs, self.device)
            _step_loss(self.model, inputs, 1, self.loss_kwargs)
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
            raise ValueError(
                f"--model {self.cfg.model!r} failed a one-token trial forward with "
                f"attn_implementation={attn_implementation(self.cfg)!r}: {str(exc).rstrip('.')}. "
                "Hint: --padded (sdpa baseline), --attn-implementation sdpa, or another "
                "--attn-backend"
            ) from exc
        finally:
            self.model.train()

    def _track(self, values: dict[str, Any], step: int) -> None:
        """Send finite numbers to the --report-to tracker (main process; accelerate skips others)."""
        if self.cfg.report_to != "none":
            values = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
            self.acc.log(values, step=step)

    def _log(self, text: str) -> None:
        if self.acc.is_main_process:
            logger.info(text)

    def _reduce(self, values: list[float]) -> list[float]:
        """``values`` summed over the processes (one process: as given, with no device round trip,
        which would wait for the queued GPU work: a sync the step does not need)."""
        if self.acc.num_processes == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.acc.reduce(t, reduction="sum").tolist()

    def _micro_step(self, mb: MicroBatch, n_items, sync: bool) -> torch.Tensor:
        inputs = self.compiler.mark(_to_device(mb.inputs, self.device))
        ctx = contextlib.nullcontext() if sync else self.acc.no_sync(self.model)
        with ctx, self.compiler.guard():
            loss = _step_loss(self.model, inputs, n_items, self.loss_kwargs)
            if mb.dummy:
                loss = loss * 0.0
            self.acc.backward(loss * self.acc.num_processes)
        return loss.detach()

    def _graph_loss(self, model, inputs: dict[str, Any], n_items: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss as the captured step computes it (--cuda-graphs)."""
        with self.compiler.guard():
            return _step_loss(model, self.compiler.mark(inputs), n_items, self.loss_kwargs)

    def train_step(
        self, group: list[list[int]], next_group: list[list[int]] | None = None
    ) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches ``group``; returns global counts.
        ``next_group`` (the next step's, if known) is collated while the GPU runs this step, after
        the last launch and before the step's read-back, instead of after it with the GPU idle."""
        t0 = time.perf_counter()
        compiled_before = self.compiler.compilations
        captured_before = self.graphed.captures if self.graphed is not None else 0
        ready, self._collated = self._collated, None
        batches = ready[1] if ready and ready[0] == group else [self.batcher(i) for i in group]

        def collate_next():
            if next_group:
                self._collated = (next_group, [self.batcher(i) for i in next_group])

        local = sum(b.label_tokens for b in batches)
        if self.acc.num_processes > 1:
            n_items = self.acc.reduce(torch.tensor(local, device=self.device), reduction="sum")
        else:
            n_items = local
        if self.bucket_counts:
            for mb in batches:
                self.bucket_counts[mb.tensor_tokens] += 1
        # With --cuda-graphs the learning rates are device tensors: a host read, intended, before
        # the replays (the previous step's read-back left the GPU idle), outside any capture.
        lr = float(self.scheduler.get_last_lr()[0])
        if self.graphed is not None:  # forward, backward and the update replayed, or skipped
            out = self.graphed.step([mb.inputs for mb in batches], n_items, collate_next)
            loss_value, grad_norm = out["loss"], out["grad_norm"]
        else:
            loss = torch.zeros((), device=self.device)
            for i, mb in enumerate(batches):
                mb_loss = self._micro_step(mb, n_items, sync=i == len(batches) - 1)
                if not mb.dummy:  # a dummy adds exactly zero (its 0/0 may be NaN when N == 0)
                    loss += mb_loss
            max_norm = self.cfg.max_grad_norm or math.inf
            grad_norm = self.acc.clip_grad_norm_(self.clip_params, max_norm)
            collate_next()
            loss_value, grad_norm = _read_loss_and_norm(loss, grad_norm)
        real = [b for b in batches if not b.dummy]
        self.rank_real_tokens += sum(b.real_tokens for b in real)
        # Reduced before the update, so every rank takes the same decision on a non-finite step.
        totals = self._reduce(
            [
                loss_value,
                sum(b.real_tokens for b in real),
                sum(b.tensor_tokens for b in batches),
                sum(b.label_tokens for b in real),
                sum(b.attn_sq for b in real),
                len(real) * self.cfg.token_budget,
                sum(b.padded_tokens for b in real),
            ]
        )
        gn = float(grad_norm) if grad_norm is not None else math.nan
        check_pending_offsets()  # deferred offset checks: free after the reads above
        finite = math.isfinite(totals[0]) and (grad_norm is None or math.isfinite(gn))
        if self.graphed is not None:  # the captured update already applied or skipped it
            if not finite and self.cfg.on_nonfinite == "stop":
                raise NonFiniteError(_nonfinite_message(self.state.step + 1, totals[0], gn, lr))
        elif finite:
            self.optimizer.step()
        elif self.cfg.on_nonfinite == "stop":
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(_nonfinite_message(self.state.step + 1, totals[0], gn, lr))
        # A skipped step still advances the schedule: steps count data consumed, not updates.
        self.scheduler.step()
        if self.graphed is None:  # captured: zeroed in the update graph (static buffers)
            self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": totals[0],
            "lr": lr,
            "grad_norm": gn,
            "skipped": not finite,
            "real_tokens": int(totals[1]),
            "tensor_tokens": int(totals[2]),
            "label_tokens": int(totals[3]),
            "attn_sq": totals[4],
            "budget_tokens": int(totals[5]),
            "padded_tokens": int(totals[6]),
            "micro_batches": len(group),
            "step_time": time.perf_counter() - t0,
            **(
                {"compilations": self.compiler.compilations - compiled_before}
                if self.compiler.enabled
                else {}
            ),
            # Steps that captured CUDA graphs (warm-up + capture inside their step_time).
            **(
                {"captures": self.graphed.captures - captured_before}
                if self.graphed is not None
                else {}
            ),
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Per-token loss over the eval set (all ranks, dummies for empty slots)."""
        if self.eval_sampler is None:
            return None
        self.model.eval()
        ce = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for idx in self.eval_sampler:
            mb = self.eval_batcher(idx)
            inputs = self.compiler.mark(_to_device(mb.inputs, self.device))
            with self.compiler.guard():
                loss = _step_loss(self.model, inputs, 1, self.loss_kwargs, **self.eval_kwargs)
            if not mb.dummy:
                ce += loss.double()
                count += mb.label_tokens
        self.model.train()
        total, n = self._reduce([float(ce), count])
        return {"eval_loss": total / n, "eval_tokens": int(n)}

    def _padded_alternative(self) -> dict[str, Any] | None:
        """Token-budget packed runs: the padding a padded trainer would compute on the same data
        (run_summary.padded_alternative); --batch-size and --padded runs say it already."""
        if self.cfg.padded or self.cfg.batch_size is not None or not len(self.train_ex):
            return None
        batches = len(self.sampler) * self.acc.num_processes
        return padded_alternative(self.train_ex.lengths, batches, self.cfg.seed)

    def run(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        stats = self.sampler.stats
        vs_padded = self._padded_alternative()
        self._log(
            f"{len(self.train_ex)} train examples in {len(self.sampler)} micro-batches per rank "
            f"and epoch ({stats.real_tokens / max(stats.padded_tokens, 1):.1%} real tokens if "
            f"padded to the longest example of each"
            + (f"; {vs_padded['text']}" if vs_padded else "")
            + f"); {self.total_steps} steps of "
            f"{cfg.grad_accum} x {self.acc.num_processes} micro-batches; kernels: {self.kernels}; "
            f"loss: {self.loss_impl}"
        )
        run_log = RunLogger(
            cfg.output_dir,
            main=self.acc.is_main_process,
            total_steps=self.total_steps,
            start_step=st.step,
            progress=cfg.progress,
            flops_per_token=self.flops_per_token,
            attn_dims=self.attn_dims,
            peak=peak_flops(self.device, cfg.peak_tflops),
            world=self.acc.num_processes,
            device=self.device,
        )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if cfg.report_to != "none":
            name = cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir))
            # Trackers take flat str/int/float/bool hyperparameters (tensorboard: no None).
            hparams = {k: "none" if v is None else v for k, v in cfg.to_dict().items()}
            init_kwargs = {}
            if cfg.report_to == "tensorboard" and st.step:
                # Resumed: events after the checkpoint's step belong to the run's dead branch (it
                # went on past the checkpoint). metrics.jsonl is truncated for them; for the event
                # files, SummaryWriter's purge_step makes TensorBoard drop them.
                init_kwargs = {"tensorboard": {"purge_step": st.step + 1}}
            self.acc.init_trackers(name, config=hparams, init_kwargs=init_kwargs)
        self.model.train()
        evals: list[dict[str, Any]] = []
        t_origin = time.perf_counter() - st.elapsed
        try:
            while st.step < self.total_steps:
                self.sampler.set_epoch(st.epoch)
                slots = list(self.sampler)
                # Every rank's tokens per slot (the sampler is the same on all ranks): the step's
                # balance without communication.
                per_rank = self.sampler.rank_tokens() if self.acc.num_processes > 1 else None
                while st.micro < len(slots) and st.step < self.total_steps:
                    group = slots[st.micro : st.micro + cfg.grad_accum]
                    last = st.step + 1 >= self.total_steps
                    nxt = st.micro + len(group)
                    ahead = None if last else slots[nxt : nxt + cfg.grad_accum]
                    with self.profiler.around(st.step + 1):
                        counts = self.train_step(group, ahead)
                    if st.step + 1 == self.profiler.step:  # its time includes the profiler's
                        counts["profiled"] = True
                    if per_rank is not None:
                        rows = per_rank[st.micro : st.micro + len(group)]
                        counts["rank_imbalance"] = rank_imbalance(rows.sum(axis=0))
                    st.micro += len(group)
                    st.step += 1
                    if counts["skipped"]:
                        st.skipped += 1
                        run_log.message(
                            f"step {st.step}: non-finite loss {counts['loss']} / gradient norm "
                            f"{counts['grad_norm']}: update skipped (--on-nonfinite skip)"
                        )
                    st.tokens += counts["real_tokens"]
                    st.elapsed = time.perf_counter() - t_origin
                    record = run_log.step(
                        step=st.step,
                        epoch=st.epoch + st.micro / len(slots),
                        elapsed=st.elapsed,
                        **counts,
                    )
                    if st.step % cfg.log_every == 0 or st.step == self.total_steps:
                        run_log.write(record)
                        self._track({f"train/{k}": record[k] for k in TRACKED}, st.step)
                    if cfg.eval_every and st.step % cfg.eval_every == 0:
                        evals.append(self._eval_record(run_log, st))
                    if cfg.save_every and st.step % cfg.save_every == 0:
                        self._save(run_log, st)
                if st.micro >= len(slots):
                    st.epoch, st.micro = st.epoch + 1, 0
            if self.eval_sampler is not None and (not evals or evals[-1]["step"] != st.step):
                evals.append(self._eval_record(run_log, st))
            if cfg.save_every and st.step % cfg.save_every != 0:
                self._save(run_log, st)
        finally:
            run_log.close()
            # Only the trackers stop here: the export and the summary's gather still need the
            # process group (accelerate's end_training would destroy it).
            for tracker in self.acc.trackers:
                tracker.finish()
        if cfg.save_final:
            ckpt.export_model(
                self.acc, self.model, self.tokenizer, os.path.join(cfg.output_dir, "final")
            )
        return self._finish(run_log, evals)

    def _save(self, run_log: RunLogger, st: ckpt.RunState) -> None:
        """A checkpoint, then --save-total-limit's pruning; one line for both."""
        path = ckpt.save_checkpoint(self.acc, self.cfg.output_dir, st)
        removed = ckpt.prune_checkpoints(self.acc, self.cfg.output_dir, self.cfg.save_total_limit)
        gone = [os.path.basename(p) for p in removed]
        run_log.message(
            f"saved {path}"
            + (f" (removed {', '.join(gone)}: --save-total-limit keeps the newest)" if gone else "")
        )

    def close(self) -> None:
        """End the process group of a multi-process run once every rank is through its summary;
        for the owner of the process (``hf-varlen train`` calls it), when nothing will train in
        this process again: a later trainer here would find no group. A gloo/NCCL group left for
        interpreter exit to tear down can abort a rank after a run that succeeded ("terminate
        called without an active exception", SIGABRT). A no-op for one process. Afterwards
        ``self.model`` is the unwrapped model: the DDP / FSDP wrapper is released with the group."""
        if self.acc.num_processes > 1 and torch.distributed.is_initialized():
            self.acc.wait_for_everyone()
            # The order matters. DDP's C++ Reducer holds the group, and when Python frees it the
            # group's destructor runs with the GIL held: ~ProcessGroupGloo joins gloo's worker
            # threads, one of which may still be freeing the last collective's tensors, which
            # takes the GIL -- a deadlock (2 of 46 two-process CPU launches hung so after their
            # summary, py-spy: ~Reducer -> ~ProcessGroupGloo -> thread::join). So the wrapper goes
            # while `world` still holds the group, and the last reference to the group goes
            # through ProcessGroup's Python binding, which releases the GIL while the threads join.
            world = torch.distributed.group.WORLD
            self.acc.state.destroy_process_group()
            self.model = self.acc.unwrap_model(self.model)
            self.acc.free_memory()  # accelerate's own references to the wrapper, then gc
            del world

    def _eval_record(self, run_log: RunLogger, st: ckpt.RunState) -> dict[str, Any]:
        result = self.evaluate()
        record = {"step": st.step, "elapsed": st.elapsed, **result}
        run_log.write(record)
        self._track({"eval/loss": result["eval_loss"]}, st.step)
        run_log.message(f"step {st.step}: eval loss {result['eval_loss']:.4f}")
        return record

    def graphs_summary(self) -> dict[str, Any] | None:
        """--cuda-graphs in the summary: what was captured, or why auto left graphs off."""
        if self.cfg.cuda_graphs == "off":  # asked for by name: nothing to explain
            return None
        if self.graphed is None:
            return {"on": False, "text": self.graphs_note}
        info = self.graphed.summary()
        return {"on": True, **info, "text": f"{self.graphs_note}: {info['text']}"}

    def _finish(self, run_log: RunLogger, evals: list[dict[str, Any]]) -> dict[str, Any]:
        cfg = self.cfg
        n_eval = len(self.eval_ex) if self.eval_ex else 0
        data = data_text(cfg, self.format, len(self.train_ex), n_eval)
        summary = summarize(
            run_log.records,
            evals,
            model=cfg.model,
            params=self.params,
            trainable=self.trainable,
            mode="padded baseline" if cfg.padded else "packed",
            attention=attn_implementation(cfg)
            + ("" if cfg.padded else f" (backend {cfg.attn_backend})"),
            precision=self.precision,
            kernels=self.kernels,
            loss_impl=self.loss_impl,
            data=data,
            processes=self.acc.num_processes,
            distribution=self.distribution,
            device=str(self.device),
            output_dir=cfg.output_dir,
            resumed_from=self.resumed_from,
            skipped_steps=self.state.skipped,
            skipped_records=self.skipped_records,
            env=environment(self.device),
            compile=self.compiler.summary(run_log.records),
            cuda_graphs=self.graphs_summary(),
            static_shapes=static_shapes_summary(
                self.bucket_counts, self._reduce, run_log.records, self.sampler.max_documents
            ),
            ranks=ranks_summary(self.acc, self.device, self.rank_real_tokens, run_log.records),
            profile=self.profiler.result,
            vs_padded=self._padded_alternative(),
        )
        if self.acc.is_main_process:
            import json

            with open(os.path.join(cfg.output_dir, "summary.json"), "w", encoding="utf-8") as fh:
                json.dump(finite_or_none(summary), fh, indent=2, allow_nan=False)
            if cfg.plot:
                plot_runs([cfg.output_dir], cfg.output_dir)
            print(format_summary(summary), flush=True)
        return summary


def run(cfg: TrainConfig | None = None) -> dict[str, Any]:
    """Run training with ``cfg`` (default: the embedded tiny run). Returns the summary."""
    return PackedTrainer(cfg or TrainConfig()).run()
