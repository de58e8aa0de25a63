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

The captured step keeps one step in flight: ``stepping.py`` says which steps are read back at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..packing import rank_imbalance
from . import checkpoint as ckpt
from .batching import Batcher, MicroBatch
from .builders import (
    CONFIG_FILE,
    METRICS_FILE,
    build_accelerator,
    build_training_model,
    default_lr,
    graphs_for_model,
    load_checkpoint,
    load_eval_data,
    load_train_data,
    make_graphed_step,
    make_optimizer,
    make_sampler,
    make_scheduler,
    prepare_output,
    real_tokens_per_micro_batch,
    run_fingerprint,
    start_run_log,
)
from .compiling import ModelCompiler, check_compile
from .config import TrainConfig
from .graphs import resolve_graphs
from .launch import distribution, end_process_group
from .metrics import (
    RunLogger,
)
from .model import (
    attention_dims,
    attn_implementation,
    check_backend,
    check_load_in_4bit,
    load_tokenizer,
    matmul_flops_per_token,
    pad_id,
    parameter_count,
    resolve_precision,
)
from .profiling import StepProfiler
from .run_summary import graphs_summary, intro_text, write_summary
from .step import (
    NonFiniteError,
    accepts_loss_kwargs,
    eval_sums,
    step_loss,
    to_device,
    trial_forward,
)
from .stepping import InFlight, Launched, finish_step, launch_step

logger = logging.getLogger("hf_varlen.training")
__all__ = ["CONFIG_FILE", "METRICS_FILE", "TRACKED", "NonFiniteError", "PackedTrainer", "run"]
# What goes to --report-to each logged step (names as in metrics.jsonl).
TRACKED = ("loss", "tokens_per_s", "packing_efficiency", "peak_mem_gib", "lr", "grad_norm")


class PackedTrainer:
    """One run. ``PackedTrainer(cfg).run()`` returns the summary dict (also written to summary.json).

    ``model_hook`` (Python API only) is called with the freshly built model, before hf_varlen's
    kernels, gradient checkpointing and LoRA: the place for a comparator's own patching (the e2e
    benchmark applies Liger there). What it changes is the user's responsibility.
    """

    def __init__(self, cfg: TrainConfig, *, model_hook=None):
        from accelerate.utils import set_seed

        cfg.validate()
        check_backend(cfg)
        check_compile(cfg)
        self.cfg = cfg
        self.acc, mixed = build_accelerator(cfg)
        self.distribution = distribution(self.acc)
        self.device = self.acc.device
        self.precision = "bf16-mixed" if mixed else resolve_precision(cfg, self.device)
        # --cuda-graphs on that cannot be honoured raises here, before anything is loaded.
        resolve_graphs(cfg, self.device, self.acc.num_processes, self.precision)
        check_load_in_4bit(cfg, self.device, self.acc.num_processes)
        set_seed(cfg.seed)
        self.resumed_from = prepare_output(cfg, self.acc)
        graphs_on = self._build_data()  # data first: its errors are cheaper than a model's
        self._build_model(model_hook, graphs_on)
        self._build_state()

    def _build_data(self) -> bool:
        """Tokenizer, examples, samplers and batchers; returns whether the step is captured by the
        auto rule, which reads the real tokens per micro-batch (the memory check comes once the
        model is built). --static-shapes unset (auto) follows it."""
        cfg, acc = self.cfg, self.acc
        self.tokenizer = load_tokenizer(cfg)
        self.format, self.skipped_records, self.train_ex, self.eval_ex = load_train_data(
            cfg, self.tokenizer
        )
        self.rank_real_tokens = 0  # this rank's real tokens trained in this process (the summary)
        graphs_on, self.graphs_note = resolve_graphs(
            cfg,
            self.device,
            acc.num_processes,
            self.precision,
            real_tokens=real_tokens_per_micro_batch(cfg, self.train_ex),
        )
        if cfg.static_shapes is None:
            cfg.static_shapes = graphs_on
        if cfg.eval_dataset:
            self.eval_ex, skipped = load_eval_data(cfg, self.tokenizer)
            self.skipped_records += skipped
        pad = pad_id(self.tokenizer)
        self.sampler = make_sampler(self.train_ex, cfg, acc, shuffle=True)
        self.batcher = Batcher(self.train_ex, cfg, pad, self.sampler.max_documents)
        self.eval_sampler = self.eval_batcher = None
        if self.eval_ex:
            self.eval_sampler = make_sampler(self.eval_ex, cfg, acc, shuffle=False)
            self.eval_batcher = Batcher(self.eval_ex, cfg, pad, self.eval_sampler.max_documents)
        self._collated = None  # (group, micro-batches): the next step's, collated during this one
        # --static-shapes: training micro-batches per bucket on this rank (summed at the end).
        self.bucket_counts = dict.fromkeys(self.batcher.buckets or (), 0)
        per_epoch = math.ceil(len(self.sampler) / cfg.grad_accum)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
        self.profiler = StepProfiler(
            cfg.profile_step, self.total_steps, cfg.output_dir, acc.process_index, self.device
        )
        return graphs_on

    def _build_model(self, model_hook, graphs_on: bool) -> None:
        """The model, the step mode it allows, the optimizer and schedule, prepared by accelerate."""
        cfg, acc = self.cfg, self.acc
        model, self.kernels, fused_ce, self.loss_impl = build_training_model(
            cfg, self.tokenizer, self.precision, self.device, graphs_on, model_hook
        )
        # The fused CE skips the logits in training; eval asks for it with the wrapped forward's
        # public per-call keyword (hf_varlen.integrations.fused_loss).
        self.eval_kwargs = {"fused_loss": True} if fused_ce else {}
        tokens = real_tokens_per_micro_batch(cfg, self.train_ex)
        self.graphs_on, self.graphs_note = graphs_for_model(
            cfg, model, self.device, acc.num_processes, self.precision, tokens,
            (graphs_on, self.graphs_note),
        )  # fmt: skip
        self.params = parameter_count(model)
        self.trainable = parameter_count(model, trainable_only=True)
        self.flops_per_token = matmul_flops_per_token(model)
        self.attn_dims = attention_dims(model)
        self.loss_kwargs = accepts_loss_kwargs(model)
        self.lr = default_lr(cfg)
        optimizer = make_optimizer(model, cfg, self.lr, self.device)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        # Listed once: walking a 1B model's ~200 modules for parameters() costs ~1 ms of host
        # time, every step, where small steps are host-bound (accelerate's FSDP check compares
        # this list with model.parameters(), which holds the same tensors).
        self.clip_params = list(self.model.parameters())
        self.scheduler = make_scheduler(cfg, self.optimizer, self.total_steps)

    def _build_state(self) -> None:
        """The run state (with its fingerprint), the compiled model, the resumed checkpoint, and
        the captured step."""
        cfg, acc = self.cfg, self.acc
        model_config = acc.unwrap_model(self.model).config
        self.state = ckpt.RunState(
            fingerprint=run_fingerprint(cfg, acc.num_processes, model_config, self.train_ex)
        )
        acc.register_for_checkpointing(self.scheduler, self.state)
        self._preflight()  # eager: model errors before any compile
        self.compiler = ModelCompiler(cfg)
        self.compiler.compile(acc.unwrap_model(self.model))
        if self.resumed_from:
            load_checkpoint(acc, self.resumed_from, self.state.fingerprint)
            self._log(f"resumed from {self.resumed_from} at step {self.state.step}")
            self.profiler.check_resume(self.state.step)
        # Built after the resume: it turns the restored learning rates into device tensors.
        self.graphed = make_graphed_step(self, self._graph_loss) if self.graphs_on else None

    # ------------------------------------------------------------------------------------------ #

    def _preflight(self) -> None:
        """A one-token forward on every rank: model/attention errors surface before step 1."""
        inputs = to_device(self.batcher.dummy().inputs, self.device)
        trial_forward(
            self.model, inputs, self.loss_kwargs, self.cfg.model, attn_implementation(self.cfg)
        )

    def _track(self, values: dict[str, Any], step: int) -> None:
        """Send finite numbers to the --report-to tracker (main process; accelerate skips others)."""
        if self.cfg.report_to != "none":
            values = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
            self.acc.log(values, step=step)

    def _log(self, text: str) -> None:
        if self.acc.is_main_process:
            logger.info(text)

    def sum_over_processes(self, values: list[float]) -> list[float]:
        """``values`` summed over the processes (one process: as given, with no device round trip,
        which would wait for the queued GPU work: a sync the step does not need)."""
        if self.acc.num_processes == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.acc.reduce(t, reduction="sum").tolist()

    def _micro_step(self, mb: MicroBatch, n_items, sync: bool) -> torch.Tensor:
        inputs = self.compiler.mark(to_device(mb.inputs, self.device))
        ctx = contextlib.nullcontext() if sync else self.acc.no_sync(self.model)
        with ctx, self.compiler.guard():
            loss = step_loss(self.model, inputs, n_items, self.loss_kwargs)
            if mb.dummy:
                loss = loss * 0.0
            self.acc.backward(loss * self.acc.num_processes)
        return loss.detach()

    def _graph_loss(self, model, inputs: dict[str, Any], n_items: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss as the captured step computes it (--cuda-graphs)."""
        with self.compiler.guard():
            return step_loss(model, self.compiler.mark(inputs), n_items, self.loss_kwargs)

    def train_step(
        self, group: list[list[int]], next_group: list[list[int]] | None = None
    ) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches ``group``; returns global counts.
        ``next_group`` (the next step's, if known) is collated while the GPU runs this step, after
        the last launch and before the step's read-back, instead of after it with the GPU idle."""
        return self.finish_step(self.launch_step(group, next_group))

    def launch_step(
        self,
        group: list[list[int]],
        next_group: list[list[int]] | None = None,
        before_capture: Callable[[], None] | None = None,
    ) -> Launched:
        """The first half of ``train_step`` (``stepping.launch_step``)."""
        return launch_step(self, group, next_group, before_capture)

    def finish_step(self, launched: Launched, since: float | None = None) -> dict[str, Any]:
        """The second half of ``train_step`` (``stepping.finish_step``)."""
        return finish_step(self, launched, since)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Per-token loss over the eval set (all ranks, dummies for empty slots)."""
        if self.eval_sampler is None:
            return None
        ce, count = eval_sums(
            self.model, (self.eval_batcher(idx) for idx in self.eval_sampler), self.compiler,
            self.device, self.loss_kwargs, self.eval_kwargs,
        )  # fmt: skip
        total, n = self.sum_over_processes([float(ce), count])
        return {"eval_loss": total / n, "eval_tokens": int(n)}

    def run(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        self._log(intro_text(self))
        run_log = start_run_log(self)
        self.model.train()
        evals: list[dict[str, Any]] = []
        t_origin = time.perf_counter() - st.elapsed
        # The captured step keeps one step in flight (stepping.py); the eager one never does.
        ahead_ok = self.graphed is not None and self.profiler.step is None
        flight = InFlight(
            self, lambda counts, info: self._after_step(counts, info, run_log, evals, t_origin)
        )
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
                    number = st.step + 1
                    with self.profiler.around(number):
                        launched = self.launch_step(group, ahead, before_capture=flight.flush)
                    launched.number = number
                    extra: dict[str, Any] = {}
                    if number == self.profiler.step:  # its time includes the profiler's
                        extra["profiled"] = True
                    if per_rank is not None:
                        rows = per_rank[st.micro : st.micro + len(group)]
                        extra["rank_imbalance"] = rank_imbalance(rows.sum(axis=0))
                    st.micro += len(group)
                    st.step = number
                    info = {"step": number, "epoch": st.epoch + st.micro / len(slots)}
                    info["extra"] = extra
                    flight.flush()  # the previous step, read while this one runs
                    if ahead_ok and not self._finishes_here(number, st.micro >= len(slots)):
                        flight.hold(launched, info)
                    else:
                        flight.finish(launched, info)
                if st.micro >= len(slots):
                    st.epoch, st.micro = st.epoch + 1, 0
            flight.flush()
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
        return write_summary(self, run_log.records, evals)

    def _finishes_here(self, step: int, epoch_end: bool) -> bool:
        """Whether step ``step`` must be read back before the next launch: it evaluates, saves
        or ends the run or an epoch (those read or write the parameters of exactly this step)."""
        cfg = self.cfg
        return (
            epoch_end
            or step >= self.total_steps
            or bool(cfg.eval_every and step % cfg.eval_every == 0)
            or bool(cfg.save_every and step % cfg.save_every == 0)
        )

    def _after_step(
        self,
        counts: dict[str, Any],
        info: dict[str, Any],
        run_log: RunLogger,
        evals: list[dict[str, Any]],
        t_origin: float,
    ) -> None:
        """A finished step's log line, tracking, eval and checkpoint."""
        cfg, st = self.cfg, self.state
        step = info["step"]
        if counts["skipped"]:
            st.skipped += 1
            run_log.message(
                f"step {step}: non-finite loss {counts['loss']} / gradient norm "
                f"{counts['grad_norm']}: update skipped (--on-nonfinite skip)"
            )
        st.tokens += counts["real_tokens"]
        st.elapsed = time.perf_counter() - t_origin
        record = run_log.step(step=step, epoch=info["epoch"], elapsed=st.elapsed, **counts)
        if step % cfg.log_every == 0 or step == self.total_steps:
            run_log.write(record)
            self._track({f"train/{k}": record[k] for k in TRACKED}, step)
        if cfg.eval_every and step % cfg.eval_every == 0:
            evals.append(self._eval_record(run_log, st))
        if cfg.save_every and step % cfg.save_every == 0:
            self._save(run_log, st)

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

        def release_wrapper():
            self.model = self.acc.unwrap_model(self.model)

        end_process_group(self.acc, release_wrapper)

    def _eval_record(self, run_log: RunLogger, st: ckpt.RunState) -> dict[str, Any]:
        result = self.evaluate()
        record = {"step": st.step, "elapsed": st.elapsed, **result}
        run_log.write(record)
        self._track({"eval/loss": result["eval_loss"]}, st.step)
        run_log.message(f"step {st.step}: eval loss {result['eval_loss']:.4f}")
        return record

    def graphs_summary(self) -> dict[str, Any] | None:
        """--cuda-graphs in the summary: what was captured, or why auto left graphs off."""
        return graphs_summary(self.cfg, self.graphed, self.graphs_note)


def run(cfg: TrainConfig | None = None) -> dict[str, Any]:
    """Run training with ``cfg`` (default: the embedded tiny run). Returns the summary."""
    return PackedTrainer(cfg or TrainConfig()).run()
