"""The training step in two halves, so that the captured step can keep one step in flight.

A step is launched (``launch_step``) and read back (``finish_step``: loss and gradient norm to
the host, the non-finite policy, the log line). The eager step does both at once. The captured
step's replays are only queued, so ``PackedTrainer.run`` launches step ``n + 1`` before it reads
step ``n`` (``InFlight``): the GPU runs ``n + 1`` while the host waits for ``n``'s numbers, writes
its log line and loads the next batch, instead of idling from each read-back to the next launch.
What must see exactly step ``n``'s parameters reads it back first: an eval or a save at ``n``,
the last step of the run or of an epoch, a profiled step, and the step before a launch that
captures a new batch shape (whose warm-up runs eagerly). A non-finite step under
``--on-nonfinite stop`` is found one launch late; the captured update then keeps skipping
(``GraphedStep``'s ``halt_on_nonfinite``), so the run stops with the parameters of the last
finite step, as the eager loop does. A step's ``step_time`` counts from the previous step's
read-back when that came after its launch: their sum is the run's wall time.

Shape legend: none (host bookkeeping; the tensors are the collated micro-batches).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..captured_step.readback import StepResult
from ..coverage import check_pending_offsets
from .batching import MicroBatch
from .step import NonFiniteError, batch_counts, nonfinite_message, step_record


def read_loss_and_norm(loss: torch.Tensor, grad_norm: Any) -> tuple[float, Any]:
    """(loss, grad norm) as Python floats in one device read instead of two syncs (fp64 holds
    either dtype exactly). A norm that is not a plain tensor on the loss's device (None, a
    DTensor) is returned as it is."""
    if type(grad_norm) is torch.Tensor and grad_norm.device == loss.device:
        loss_value, norm = torch.stack([loss.double(), grad_norm.double().reshape(())]).tolist()
        return loss_value, norm
    return float(loss), grad_norm


@dataclass
class Launched:
    """A step between ``launch_step`` and ``finish_step``: its batches, learning rate and start;
    ``out`` the captured step's result on its way to the host (None: eager, ``values`` already
    read)."""

    group: list[list[int]]
    batches: list[MicroBatch]
    lr: float
    t0: float
    out: StepResult | None = None
    values: tuple[float, Any] = (math.nan, None)
    compilations: int = 0
    captures: int = 0
    number: int | None = None  # the step's number in the run (None: state.step + 1)


def host_lr(scheduler) -> float:
    """The learning rate of the step about to run, read without waiting on the GPU. With the
    captured step the optimizer's rates are device tensors the scheduler fills; a ``LambdaLR``
    (every schedule ``get_scheduler`` builds) gives the same value from its own rule on the host,
    where reading the tensor would wait for the steps still queued."""
    last = scheduler.get_last_lr()[0]
    lambdas, bases = getattr(scheduler, "lr_lambdas", None), getattr(scheduler, "base_lrs", None)
    if isinstance(last, torch.Tensor) and lambdas and bases and not torch.is_tensor(bases[0]):
        return float(bases[0] * lambdas[0](scheduler.last_epoch))
    # Host read, intended: a float already (eager step), or a schedule without a host rule,
    # where the captured step's rate is read once per step, outside any capture
    return float(last)


def launch_step(
    trainer,
    group: list[list[int]],
    next_group: list[list[int]] | None = None,
    before_capture: Callable[[], None] | None = None,
) -> Launched:
    """The first half of ``PackedTrainer.train_step``. Eager: the whole step. Captured: the
    replays and the update queued, the scheduler advanced (it fills the learning-rate tensors the
    next update reads, in stream order), the next group collated; the read-back is
    ``finish_step``'s, so the caller may queue the next step first. ``before_capture``: called
    before a launch that would capture a new batch shape (its warm-up and capture time then
    belong to this step)."""
    t0 = time.perf_counter()
    compiled_before = trainer.compiler.compilations
    captured_before = trainer.graphed.captures if trainer.graphed is not None else 0
    ready, trainer._collated = trainer._collated, None
    batches = ready[1] if ready and ready[0] == group else [trainer.batcher(i) for i in group]

    def collate_next():
        if next_group:
            trainer._collated = (next_group, [trainer.batcher(i) for i in next_group])

    local = sum(b.label_tokens for b in batches)
    if trainer.acc.num_processes > 1:
        n_items = trainer.acc.reduce(torch.tensor(local, device=trainer.device), reduction="sum")
    else:
        n_items = local
    if trainer.bucket_counts:
        for mb in batches:
            trainer.bucket_counts[mb.tensor_tokens] += 1
    lr = host_lr(trainer.scheduler)
    launched = Launched(group=group, batches=batches, lr=lr, t0=t0)
    if trainer.graphed is not None:  # forward, backward and the update replayed, or skipped
        inputs = [mb.inputs for mb in batches]
        if before_capture is not None and trainer.graphed.new_shapes(inputs):
            before_capture()
            launched.t0 = time.perf_counter()
        launched.out = trainer.graphed.launch(inputs, n_items)
        # A skipped step still advances the schedule: steps count data consumed, not updates.
        trainer.scheduler.step()
        collate_next()
    else:
        loss = torch.zeros((), device=trainer.device)
        for i, mb in enumerate(batches):
            mb_loss = trainer._micro_step(mb, n_items, sync=i == len(batches) - 1)
            if not mb.dummy:  # a dummy adds exactly zero (its 0/0 may be NaN when N == 0)
                loss += mb_loss
        max_norm = trainer.cfg.max_grad_norm or math.inf
        grad_norm = trainer.acc.clip_grad_norm_(trainer.clip_params, max_norm)
        collate_next()
        launched.values = read_loss_and_norm(loss, grad_norm)
    launched.compilations = trainer.compiler.compilations - compiled_before
    if trainer.graphed is not None:
        launched.captures = trainer.graphed.captures - captured_before
    return launched


def finish_step(trainer, launched: Launched, since: float | None = None) -> dict[str, Any]:
    """The second half of ``PackedTrainer.train_step``: the read-back, the non-finite policy,
    the update (eager) and the step's record. ``since``: when the previous step finished, if
    after this one's launch (its ``step_time`` then counts from there: with launches queued
    ahead, the time between finishes is what a step costs)."""
    batches, lr = launched.batches, launched.lr
    if launched.out is not None:
        out = trainer.graphed.read(launched.out)
        loss_value, grad_norm = out["loss"], out["grad_norm"]
    else:
        loss_value, grad_norm = launched.values
    counts = batch_counts(batches, trainer.cfg.token_budget)
    trainer.rank_real_tokens += counts[0]
    # Reduced before the update, so every rank takes the same decision on a non-finite step.
    totals = trainer.sum_over_processes([loss_value, *counts])
    gn = float(grad_norm) if grad_norm is not None else math.nan
    check_pending_offsets()  # deferred offset checks: free after the reads above
    finite = math.isfinite(totals[0]) and (grad_norm is None or math.isfinite(gn))
    number = launched.number or trainer.state.step + 1
    if trainer.graphed is not None:  # the captured update already applied or skipped it
        if not finite and trainer.cfg.on_nonfinite == "stop":
            raise NonFiniteError(nonfinite_message(number, totals[0], gn, lr))
    else:
        if finite:
            trainer.optimizer.step()
        elif trainer.cfg.on_nonfinite == "stop":
            trainer.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(nonfinite_message(number, totals[0], gn, lr))
        # A skipped step still advances the schedule: steps count data consumed, not updates.
        trainer.scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)  # captured: done inside the graphs
    extra = {}
    # A model compiled outside --compile through the trainer's counting backend (the benchmarks'
    # plain torch.compile) counts too: its compiling steps are then told from steady ones.
    if trainer.compiler.enabled or launched.compilations:
        extra["compilations"] = launched.compilations
    if trainer.graphed is not None:  # steps that captured (warm-up + capture in their step_time)
        extra["captures"] = launched.captures
    start = launched.t0 if since is None else max(launched.t0, since)
    seconds = time.perf_counter() - start
    return step_record(totals, lr, gn, finite, len(launched.group), seconds, **extra)


class InFlight:
    """At most one launched step not yet read back (``PackedTrainer.run``): ``finish`` reads a
    step back and hands its record to ``after_step``; ``hold`` keeps it for later; ``flush``
    finishes the held one. A step's ``step_time`` counts from the previous read-back when that
    came after its launch."""

    def __init__(self, trainer, after_step: Callable[[dict[str, Any], dict[str, Any]], None]):
        self.trainer, self.after_step = trainer, after_step
        self.held: tuple[Launched, dict[str, Any]] | None = None
        self.last_finish: float | None = None

    def finish(self, launched: Launched, info: dict[str, Any]) -> None:
        counts = finish_step(self.trainer, launched, since=self.last_finish)
        self.last_finish = time.perf_counter()
        counts.update(info["extra"])
        self.after_step(counts, info)

    def hold(self, launched: Launched, info: dict[str, Any]) -> None:
        self.held = (launched, info)

    def flush(self) -> None:
        if self.held is not None:
            item, self.held = self.held, None
            self.finish(*item)
