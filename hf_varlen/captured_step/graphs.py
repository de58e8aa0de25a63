"""The training step captured in CUDA graphs and replayed (``GraphedStep``): one component for
``hf-varlen train --cuda-graphs`` and the HF Trainer / TRL subclasses (``VarlenTrainer``,
``VarlenSFTTrainer``), so it imports neither.

With static shapes (``--static-shapes``; the trainers pad to a bucket) every packed micro-batch
has one of a few shapes (a rung of the bucket ladder for T, ``max_documents + 2`` offsets). Per
shape, one graph holds the micro-batch's forward and backward; one more graph holds the update.
With ``fresh_grads`` (one micro-batch per step: ``hf-varlen train`` without accumulation), one
graph per shape holds the whole step instead (``_StepGraph``): its backward allocates the
gradients as an eager step after ``zero_grad(set_to_none=True)`` does, rather than adding them
into zeroed static buffers (a zeroing and an addition over every gradient per step saved, and the
buffers' memory), and drops them back to the pool after the update.
Replaying them costs the host a few copies and launches per step instead of thousands of kernel
launches and the Python around them.

What each graph does (all graphs share one memory pool: they never run at the same time):

- micro-batch graph (one per shape, captured the first time the shape is seen, after a warm-up
  of ``WARMUP`` eager forward + backward passes on a side stream that are then undone):
  ``loss = model(**static_inputs, num_items_in_batch=n_items).loss``, ``loss.backward()`` into
  the static ``.grad`` buffers (gradient accumulation adds into them), ``loss_sum += loss``.
- update graph (captured once, on the first step, after one eager optimizer step that changes
  nothing (its ``found_inf`` is set) and only allocates the optimizer state): the gradient-norm
  clip, the non-finite test of loss and norm, the fused AdamW step (``capturable``; a
  non-finite step is skipped on the device through the optimizer's ``found_inf``, exactly as the
  eager step skips it), the loss and norm copied out for the log, gradients and loss sum zeroed.

Host per step: each micro-batch's tensors copied into its shape's static buffers, its offsets
checked on the host (the CPU tensors: no sync), the replays, ``scheduler.step()`` (which fills the
learning-rate tensors the update graph reads), then one read-back of (loss, grad norm, skipped)
for the log and the non-finite policy, as the eager step reads them. ``launch`` / ``read`` split
the two, so that a caller can queue the next step before reading this one (``hf-varlen train``
does: ``training/loop.py``); ``halt_on_nonfinite`` then keeps the updates after a non-finite
step skipped on the device until the caller has read it.

The ints of a batch cannot change between replays, so ``max_length_q/k`` are given as the shape's
token count T (an upper bound of every document in it, which FlashAttention semantics allow and
our attention never sizes anything by; "auto" reads such a bound as no length, so no
long-documents rule moves the step off our kernel: ``backends.registry.long_documents``);
``num_items_in_batch`` is a 0-d tensor filled per step.

Requirements: CUDA, static shapes, one process, AdamW (each driver names what stands in its way:
``hf_varlen.training.graphs.graph_blockers`` for the CLI, ``VarlenTrainer`` for the Trainer's);
with gradient checkpointing, a forward that draws no random numbers (``model_blockers``). Whether
to capture at all is ``auto_mode.choose_step_mode``'s one rule.

Mixed precision (``bf16-mixed``: fp32 master weights, bf16 autocast). Autocast keeps a cache of
the bf16 copy of each fp32 weight for the life of the outermost autocast region (emptied when the
region is left). Inside a capture the cast is a recorded kernel like any other: each replay casts
the weights as they are now, after the last update. What breaks is a region left open across the
capture boundary: the warm-up's casts, cached before the capture, would be read by every replay
(the weights as they were before the first update). So the captured body opens the outermost
autocast region itself, with ``cache_enabled=False``, around the forward only (the backward runs
outside autocast, as in the eager step), and ``step`` refuses to run inside an autocast region that
is already open. Chosen over keeping the bf16 copies as static buffers refreshed by the update
graph: that needs the casts taken out of the model's own forward (a patch), and a second copy of
every weight held for the whole run; without the cache, a weight used twice in one forward (tied
embeddings and head) is cast twice, a few microseconds of device time.

Gradient checkpointing. ``torch.utils.checkpoint`` stashes the RNG state in the forward and
restores it before the recompute (``preserve_rng_state``), so that dropout masks repeat. Reading or
setting the CUDA generator's state while a graph is being captured is not allowed (the graph owns
the generator's offsets), and a forward without randomness has nothing to repeat: captured steps
need checkpointing with ``preserve_rng_state=False`` and no active dropout (``model_blockers``
says which module is in the way; ``hf-varlen train`` turns it on itself). The recompute is
otherwise ordinary device work inside the backward, captured like the rest.

LoRA (peft). Only the parameters that require a gradient (the adapters) get static gradient
buffers and enter the clip and the update; the frozen base weights are read by the graphs as
they are.

Shape legend: T the token count of a bucket, D + 2 the fixed length of ``cu_seq_lens``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from ..coverage import check_now
from .readback import StepResult

WARMUP = 2  # eager passes before a capture: lazy inits, cuBLAS workspaces, autograd streams
_INT_KEYS = ("max_length_q", "max_length_k")


def model_blockers(model: torch.nn.Module) -> list[str]:
    """Why this built model cannot be captured (empty: it can): with gradient checkpointing on, a
    checkpointed layer that restores the RNG state (``preserve_rng_state`` not False) or a dropout
    that draws random numbers (see the module docstring)."""
    checkpointed = [
        (name, m)
        for name, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
        and getattr(m, "_gradient_checkpointing_func", None) is not None
    ]
    if not checkpointed:
        return []
    reasons = []
    name, layer = checkpointed[0]
    keywords = getattr(layer._gradient_checkpointing_func, "keywords", {})
    if keywords.get("preserve_rng_state", True) is not False:
        reasons.append(
            f"gradient checkpointing of {name or 'the model'} restores the RNG state on the host "
            "in backward: enable it with preserve_rng_state=False (gradient_checkpointing_kwargs)"
        )
    dropouts = [
        f"{n} (p={m.p})"
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop"):
        value = getattr(config, key, 0.0)
        if isinstance(value, float | int) and value > 0:
            dropouts.append(f"config.{key}={value}")
    if dropouts:
        reasons.append(
            "gradient checkpointing with dropout (" + ", ".join(dropouts[:3]) + "): the recompute "
            "must redraw the same masks; set the dropout to 0 or turn checkpointing off"
        )
    return reasons


def _capture_cuda(fn: Callable[[], None], pool) -> Callable[[], None]:
    """Capture ``fn`` in a CUDA graph (in ``pool``); returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


class GraphedStep:
    """The captured training step of one run (see the module docstring).

    ``model``: the training model (accelerate's prepared one). ``optimizer``: a torch AdamW, or
    accelerate's wrapper around one (its ``step`` is what an LR scheduler watches). ``loss_fn(model,
    inputs, n_items) -> loss``: the eager loss of one micro-batch. ``max_grad_norm``: the clip (inf:
    none). ``capture``: captures a function and returns its replay (CUDA by default).
    ``autocast_dtype``: mixed precision (bf16 over fp32 weights): the captured forward runs in
    its own autocast region (see the module docstring); None: no autocast.

    Two ways to drive it: ``step`` (the whole optimizer step, update graph included: ``hf-varlen
    train``), or ``forward_backward`` once per micro-batch, the optimizer step left to the caller
    (a ``transformers.Trainer``, whose loop clips and steps itself): gradients accumulate into the
    static buffers, which are re-attached and zeroed when the caller has reset ``.grad``.
    ``halt_on_nonfinite``: once a step is not finite, later updates are skipped on the device too
    (for callers that read a step back after launching the next: ``launch`` / ``read``).

    What it changes of yours, on the first ``step``: every param group of the optimizer becomes
    fused, capturable, non-foreach, with its learning rate a 0-d device tensor (an LR scheduler
    built on it keeps working: it fills the tensor); parameter gradients become persistent
    buffers (zeroed by the update graph, never set to None), or with ``fresh_grads`` (one
    micro-batch per ``step``) are None between steps, each graph allocating and dropping its own.
    Batch ints ``max_length_q/k`` are replaced by the shape's token count (an upper bound);
    other non-tensor batch keys are refused."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, dict[str, Any], torch.Tensor], torch.Tensor],
        *,
        device: torch.device,
        max_grad_norm: float,
        capture: Callable[[Callable[[], None], Any], Callable[[], None]] | None = None,
        autocast_dtype: torch.dtype | None = None,
        update: bool = True,
        halt_on_nonfinite: bool = False,
        fresh_grads: bool = False,
    ):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if update and not isinstance(inner, torch.optim.AdamW):
            raise TypeError(f"optimizer: expected torch.optim.AdamW, got {type(inner).__name__}")
        self.model, self.optimizer, self.inner, self.loss_fn = model, optimizer, inner, loss_fn
        self.device, self.max_grad_norm = device, max_grad_norm
        self.autocast_dtype = autocast_dtype
        self._capture = capture or _capture_cuda
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graphs: dict[tuple, _MicroGraph] = {}
        self.update = None
        self.capture_s = 0.0  # warm-ups + captures, host seconds
        self.graph_bytes = 0  # CUDA memory the captures reserved (0 on other devices)
        f32 = dict(dtype=torch.float32, device=device)
        self.n_items = torch.ones((), **f32)
        self.loss_sum = torch.zeros((), **f32)
        self.out = torch.zeros(3, **f32)  # loss, grad norm, skipped (1.0) of the last update
        self.last_loss = torch.zeros((), **f32)  # the last replayed micro-batch's loss
        self.grads: list[torch.Tensor] | None = None  # the static gradient buffers
        self.accumulating = False  # gradients of replays not yet consumed by an update
        # halt_on_nonfinite: once a step is not finite, every later update is skipped on the
        # device too, so a caller that reads a step's result only after launching the next one
        # (``launch`` / ``read``) stops with the parameters of the last finite step
        self.halt_on_nonfinite = halt_on_nonfinite
        self.halted = torch.zeros((), **f32)
        # fresh_grads: one micro-batch per step, each shape's graph holding the whole step
        # (``_StepGraph``): no static gradient buffers to zero and add into
        if fresh_grads and not update:
            raise ValueError("fresh_grads needs the update in the graphs (update=True)")
        self.fresh_grads = fresh_grads
        self.prepared = False  # the optimizer made capturable (``_prepare_optimizer``)

    # -- setup ---------------------------------------------------------------------------------

    def _prepare_optimizer(self) -> None:
        """Learning rates as device tensors (the scheduler fills them in place; a float would be
        baked into the graph) and capturable fused AdamW; its state allocated by one eager step
        with found_inf set, which changes no parameter and no step count."""
        opt = self.inner
        for group in opt.param_groups:
            lr = group["lr"]
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=self.device)
            group["fused"] = True
            group["foreach"] = False
        if self.fresh_grads:  # zeros only for the state-allocating step below
            for p in self.params:
                p.grad = torch.zeros_like(p)
        else:
            self._attach_grads()
        opt.found_inf = torch.ones((), dtype=torch.float32, device=self.device)
        self.optimizer.step()  # allocates exp_avg / exp_avg_sq / step; the update is skipped
        for group in opt.param_groups:  # after the eager step (capturable warns outside a capture)
            group["capturable"] = True
        for p in self.params:
            if self.fresh_grads:
                p.grad = None
            else:
                p.grad.zero_()
        self.prepared = True

    def _update_body(self) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        bad = (~(torch.isfinite(norm) & torch.isfinite(self.loss_sum))).float()
        if self.halt_on_nonfinite:
            bad = torch.maximum(bad, self.halted)
            self.halted.copy_(bad)
        self.inner.found_inf.copy_(bad)
        self.optimizer.step()
        self.out[0].copy_(self.loss_sum)
        self.out[1].copy_(norm)
        self.out[2].copy_(bad)
        if self.fresh_grads:  # back to the pool: the next graph allocates its own
            for p in self.params:
                p.grad = None
        else:
            torch._foreach_zero_([p.grad for p in self.params])
        self.loss_sum.zero_()

    def _ensure_update(self) -> None:
        """The optimizer made capturable, once; and the update graph, unless each shape's graph
        holds its own update (``fresh_grads``)."""
        if self.prepared:
            return
        t0, reserved = time.perf_counter(), self._reserved()
        self._prepare_optimizer()
        if not self.fresh_grads:
            self.update = self._capture(self._update_body, self.pool)
        self.capture_s += time.perf_counter() - t0
        self.graph_bytes += self._reserved() - reserved

    def _attach_grads(self) -> None:
        """Make the static gradient buffers the parameters' ``.grad`` again; zero them when the
        caller had reset any (``zero_grad(set_to_none=True)``): a new accumulation starts."""
        if self.grads is None:
            self.grads = [
                p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params
            ]
            dirty = True
        else:
            dirty = False
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                p.grad = g
                dirty = True
        if dirty:
            torch._foreach_zero_(self.grads)
            self.loss_sum.zero_()
            self.accumulating = False

    def _check_no_autocast(self) -> None:
        if torch.is_autocast_enabled(self.device.type):
            raise RuntimeError(
                "captured step: called inside an open autocast region, whose weight-cast cache "
                "would hand the warm-up's bf16 copies of the weights to every replay; call it "
                "outside autocast and pass autocast_dtype (the captured forward opens its own)"
            )

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    # -- per step ------------------------------------------------------------------------------

    def step(
        self,
        batches: list[dict[str, Any]],
        n_items: int,
        while_running: Callable[[], Any] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over the micro-batches ``batches`` (CPU tensors, as collated), with
        ``n_items`` the label tokens of the whole step. Returns loss, grad_norm and skipped.
        ``while_running``: host work to do while the GPU runs the replays (called after the last
        launch, before the step's one read-back)."""
        out = self.launch(batches, n_items)
        if while_running is not None:
            while_running()
        return self.read(out)

    def launch(self, batches: list[dict[str, Any]], n_items: int) -> StepResult:
        """``step`` without its read-back: the replays are queued and the step's (loss, grad norm,
        skipped) returned on their way to the host (``StepResult``), for ``read`` once the caller
        has queued more work (the next step's replays keep the GPU busy while the host reads this
        one, and the read waits for this step only)."""
        self._check_no_autocast()
        if self.fresh_grads and len(batches) != 1:
            raise ValueError(
                f"captured step with fresh_grads: one micro-batch per step, got {len(batches)}"
                " (gradient accumulation needs the static gradient buffers: fresh_grads=False)"
            )
        self._ensure_update()
        if self.fresh_grads:
            whole = self._graph_for(batches[0])
            self.n_items.fill_(float(n_items))
            whole.load(batches[0])
            whole.replay()
            return StepResult(self.out)
        # New shapes first: a capture's warm-up zeroes the gradients, which must not drop the
        # accumulation of micro-batches already replayed in this step.
        micros = [self._graph_for(inputs) for inputs in batches]
        self.n_items.fill_(float(n_items))
        for micro, inputs in zip(micros, batches, strict=True):
            micro.load(inputs)
            micro.replay()
        self.update()
        self.accumulating = False  # the update graph zeroed the gradients
        return StepResult(self.out)  # copied now: the next update overwrites self.out

    @staticmethod
    def read(out: StepResult) -> dict[str, float]:
        """The host values of a launched step's result (its one read-back)."""
        # Host read, intended: outside every capture, once per step, after the caller has
        # queued what it could (hf-varlen train: the next step's replays)
        loss, norm, skipped = out.tolist()
        return {"loss": loss, "grad_norm": norm, "skipped": skipped > 0.5}

    def new_shapes(self, batches: list[dict[str, Any]]) -> bool:
        """Whether launching ``batches`` would capture (a shape not seen yet, or the first step)."""
        return not self.prepared or any(_shape_key(b) not in self.graphs for b in batches)

    def forward_backward(
        self, inputs: dict[str, Any], n_items: torch.Tensor | int | float
    ) -> torch.Tensor:
        """Replay one micro-batch's forward + backward (captured the first time its shape is
        seen), its gradients added into the static ``.grad`` buffers; ``n_items`` the label tokens
        the loss is divided by (a device tensor stays on the device). Returns the micro-batch's
        loss (a new 0-d tensor). The optimizer step is the caller's."""
        self._check_no_autocast()
        if self.fresh_grads:
            raise ValueError(
                "forward_backward accumulates into static gradients: fresh_grads=False"
            )
        self._attach_grads()
        micro = self._graph_for(inputs)
        if isinstance(n_items, torch.Tensor):
            self.n_items.copy_(n_items.reshape(()), non_blocking=True)
        else:
            self.n_items.fill_(float(n_items))
        micro.load(inputs)
        micro.replay()
        self.accumulating = True
        return self.last_loss.clone()

    def _graph_for(self, inputs: dict[str, Any]) -> _MicroGraph:
        key = _shape_key(inputs)
        micro = self.graphs.get(key)
        if micro is None:
            t0, reserved = time.perf_counter(), self._reserved()
            micro = (_StepGraph if self.fresh_grads else _MicroGraph)(self, inputs)
            self.graphs[key] = micro
            self.capture_s += time.perf_counter() - t0
            self.graph_bytes += self._reserved() - reserved
        return micro

    @property
    def captures(self) -> int:
        """Graphs captured so far (the update's and one per batch shape)."""
        return len(self.graphs) + (self.update is not None)

    def summary(self) -> dict[str, Any]:
        """Graphs captured, the token counts of their shapes, warm-up + capture seconds, and the
        CUDA memory the captures reserved."""
        shapes = sorted(m.tokens for m in self.graphs.values())
        out = {
            "graphs": self.captures,
            "shapes": shapes,
            "capture_s": self.capture_s,
            "graph_gib": self.graph_bytes / 2**30,
            "whole_step": self.fresh_grads,
        }
        what = (
            "one per batch shape, each a whole step with its update, T = "
            if self.fresh_grads
            else f"update + {len(shapes)} batch shapes, T = "
        )
        out["text"] = (
            f"{out['graphs']} graphs ({what}{', '.join(map(str, shapes)) or '-'}), "
            f"warm-up + capture {self.capture_s:.1f} s, "
            f"{out['graph_gib']:.2f} GiB reserved by the captures"
        )
        return out


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """Run the body on a side stream that starts after, and is waited for by, the current one
    (warm-ups before a capture, as torch.cuda.graphs asks); a no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)


def _shape_key(inputs: dict[str, Any]) -> tuple:
    return tuple(
        sorted(
            (k, tuple(v.shape), v.dtype) for k, v in inputs.items() if isinstance(v, torch.Tensor)
        )
    )


class _MicroGraph:
    """Static input buffers of one batch shape and the replay of its forward + backward."""

    def __init__(self, owner: GraphedStep, inputs: dict[str, Any]):
        self.owner = owner
        tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        ids = tensors.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(
                "--cuda-graphs: expected packed [1, T] micro-batches with input_ids, got "
                f"{ {k: tuple(v.shape) for k, v in tensors.items()} }"
            )
        self.tokens = int(ids.shape[1])
        others = sorted(set(inputs) - set(tensors) - set(_INT_KEYS))
        if others:
            raise ValueError(f"--cuda-graphs: batch keys {others} are neither tensors nor lengths")
        self.static = {k: v.to(owner.device, copy=True) for k, v in tensors.items()}
        # The ints are part of the graph: the bucket's token count bounds every document in it.
        self.ints = {k: self.tokens for k in _INT_KEYS if k in inputs}
        self._check(inputs)
        self._warm_up()
        self.replay = owner._capture(self._body, owner.pool)

    def _warm_up(self) -> None:
        """``WARMUP`` eager passes on a side stream. They run for real: their gradients and loss
        are undone before capturing (zeroed, or restored when micro-batches of this accumulation
        were replayed before this shape)."""
        owner = self.owner
        grads = [p.grad for p in owner.params if p.grad is not None]
        saved = [t.clone() for t in (*grads, owner.loss_sum)] if owner.accumulating else None
        with _side_stream(owner.device):
            for _ in range(WARMUP):
                self._body()
        if saved is None:
            torch._foreach_zero_([*grads, owner.loss_sum])
        else:
            torch._foreach_copy_([*grads, owner.loss_sum], saved)

    def _forward_backward(self) -> None:
        owner = self.owner
        # The forward's autocast region opens and closes inside the captured function (module
        # docstring); the backward runs outside it, as the eager step's does.
        dtype = owner.autocast_dtype
        with (
            torch.autocast(owner.device.type, dtype=dtype, cache_enabled=False)
            if dtype is not None
            else contextlib.nullcontext()
        ):
            loss = owner.loss_fn(owner.model, {**self.static, **self.ints}, owner.n_items)
        loss.backward()
        owner.loss_sum.add_(loss.detach())
        owner.last_loss.copy_(loss.detach())

    def _body(self) -> None:
        self._forward_backward()

    def _check(self, inputs: dict[str, Any]) -> None:
        """The offsets check of the eager path, on the collated CPU tensors (no device sync).
        Batches already on the device (a Trainer's dataloader moves them) are not read back:
        their collator built the offsets on the host (``PackingCollator`` checks them)."""
        cu_q, cu_k = inputs.get("cu_seq_lens_q"), inputs.get("cu_seq_lens_k")
        on_host = all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in (cu_q, cu_k))
        if on_host:
            check_now(cu_q, cu_k, self.tokens, self.tokens, self.tokens, self.tokens)

    def load(self, inputs: dict[str, Any]) -> None:
        """Copy a new batch of this shape into the static buffers (asynchronous H2D)."""
        self._check(inputs)
        for k, buf in self.static.items():
            buf.copy_(inputs[k], non_blocking=True)


class _StepGraph(_MicroGraph):
    """One batch shape's whole step (``fresh_grads``): forward, backward into gradients the graph
    allocates itself (``.grad`` is None before the backward, as after an eager
    ``zero_grad(set_to_none=True)``: autograd hands each parameter its gradient instead of adding
    it into a zeroed buffer), the clip and the update, then the gradients dropped back to the
    graphs' shared pool. That saves a zeroing and an addition over every gradient per step, and
    the persistent gradient buffers. Its warm-ups run forward + backward only and drop their
    gradients; nothing of theirs reaches the parameters."""

    def _warm_up(self) -> None:
        with _side_stream(self.owner.device):
            for _ in range(WARMUP):
                self._drop_grads()
                self._forward_backward()
        self._drop_grads()
        self.owner.loss_sum.zero_()

    def _drop_grads(self) -> None:
        for p in self.owner.params:
            p.grad = None

    def _body(self) -> None:
        self._drop_grads()
        self._forward_backward()
        self.owner._update_body()
