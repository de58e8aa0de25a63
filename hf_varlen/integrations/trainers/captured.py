"""The captured training step inside ``transformers.Trainer``: ``VarlenTrainer`` and the mixin
``VarlenSFTTrainer`` shares.

    from hf_varlen.integrations.trainers import VarlenTrainer

    trainer = VarlenTrainer(model=model, args=args, train_dataset=ds,
                            data_collator=hf_varlen.PackingCollator(), cuda_graphs="auto")

What changes, through Trainer's documented seams only (nothing of transformers or TRL patched):
``training_step`` is overridden. Each padding-free micro-batch (``input_ids`` [1, T] with
``cu_seq_lens_q/k``: ``PackingCollator``, or TRL's collator with ``padding_free=True`` / bfd
packing) is padded on the device to a static shape (``pad_to_bucket``: the first rung of
``hf_varlen.bucket_ladder`` >= T, one extra segment of pad tokens with label -100, ``cu_seq_lens``
extended to a power-of-two length with zero-length documents), and its forward + backward is
replayed from a CUDA graph captured the first time that shape is seen
(``hf_varlen.captured_step.GraphedStep.forward_backward``). The loss the graph computes is the
one the eager step computes (``compute_loss`` without its host-side metric work; the label count
``num_items_in_batch`` and Trainer's gradient-accumulation scale are device tensors filled per
call), so the returned loss and the gradients are the eager step's; padding adds no label.

The optimizer step stays eager, in Trainer's own loop (it calls clip, ``optimizer.step()``,
the scheduler and ``zero_grad`` itself: capturing them would mean replacing that loop); said
once in the log. With a fused AdamW (``optim="adamw_torch_fused"``) that is a few launches.

Modes (``cuda_graphs``): ``"on"`` raises where capture cannot work, naming the reason; ``"auto"``
(default) decides at the first micro-batch by the rule of ``hf_varlen.captured_step.auto_mode``
(real tokens per micro-batch, free memory) and otherwise falls back to Trainer's eager step with one
logged line saying why; ``"off"`` is Trainer's step. Cannot work: no CUDA device, DeepSpeed (its
engine owns backward and the gradient partitions), FSDP (per-layer all-gathers and host
bookkeeping), several processes (DDP's all-reduce is eager) or ``DataParallel`` (``n_gpu > 1``),
activation offloading (host copies), an attention implementation other than ``varlen_packed``
(padding-free batches on ``sdpa`` / ``flash_attention_2`` derive documents from ``position_ids``
with host syncs), a hybrid model's installed linear-attention layers (they split the row per
document from the offsets' values on the host), a batch that is not padding-free, gradient
checkpointing with dropout (the recompute must restore the RNG state on the host), a forward that
synchronises with the host (the capture fails; reported with that reason). Gradient checkpointing
without dropout is re-enabled with ``preserve_rng_state=False`` (nothing random to replay), said
once.

Mixed precision (``bf16=True`` over fp32 weights, TRL's default): the captured forward opens its
own autocast region with the weight-cast cache off (``captured_step/graphs.py`` explains why).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers import Trainer

from ...captured_step import GraphedStep, StepMode, capture_bytes, choose_step_mode, model_blockers
from ...packing import bucket_ladder
from ..linear_attention import capture_blockers

__all__ = ["CaptureError", "CapturedStepMixin", "VarlenTrainer", "pad_to_bucket"]

logger = logging.getLogger("hf_varlen")
_PACKED_KEYS = ("input_ids", "labels", "position_ids", "seq_idx")
_DEFAULT_MAX_TOKENS = 1 << 20  # ladder top when the micro-batch size is unknown


def checkpointing_kwargs(args) -> dict[str, Any]:
    """The user's recomputation options from TrainingArguments, a copy: transformers 5.25 names
    them ``activation_checkpointing_kwargs`` (``gradient_checkpointing_kwargs`` its deprecated
    alias); earlier releases have only the old name, which must not be ignored there."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = getattr(args, name, None)
        if value:
            return dict(value)
    return {}


class CaptureError(RuntimeError):
    """``cuda_graphs="on"`` asked for a captured step that cannot work here (reason inside)."""


def pad_to_bucket(inputs: dict[str, Any], buckets: tuple[int, ...]) -> dict[str, Any]:
    """A padding-free micro-batch padded to a static shape, on its own device without a sync.

    ``inputs``: ``input_ids`` / ``labels`` / ``position_ids`` [1, T] (``seq_idx`` [1, T] too if
    present), ``cu_seq_lens_q/k`` [D + 1]. Returns them at T_b = the first bucket >= T, the pad
    tokens one extra segment (input: the batch's first token, an id the model certainly embeds;
    label -100; positions 0..P-1; ``seq_idx`` D)
    and ``cu_seq_lens`` of S = max(8, next power of two >= D + 2) entries, the slots after the pad
    segment repeating T_b (zero-length documents). ``max_length_q/k`` become T_b (an upper bound).
    Other keys pass through. Raises ValueError when T exceeds the largest bucket."""
    ids = inputs["input_ids"]
    t = ids.shape[1]
    tb = next((b for b in buckets if b >= t), None)
    if tb is None:
        raise ValueError(
            f"max_tokens_per_batch: a micro-batch of {t} tokens exceeds the largest bucket "
            f"{buckets[-1]}; pass a larger max_tokens_per_batch"
        )
    p, dev = tb - t, ids.device
    out = dict(inputs)
    cu = inputs["cu_seq_lens_q"]
    docs = cu.shape[0] - 1
    for key in _PACKED_KEYS:
        x = inputs.get(key)
        if not isinstance(x, torch.Tensor):
            continue
        if key == "position_ids":
            tail = torch.arange(p, device=dev, dtype=x.dtype).view(1, p)
        elif key == "seq_idx":
            tail = torch.full((1, p), docs, device=dev, dtype=x.dtype)
        elif key == "labels":
            tail = torch.full((1, p), -100, device=dev, dtype=x.dtype)
        else:  # input_ids: no host read of the value, so no sync
            tail = x[:, :1].expand(1, p)
        out[key] = torch.cat([x, tail], dim=1)
    slots = max(8, 1 << math.ceil(math.log2(docs + 2)))
    extra = torch.full((slots - cu.shape[0],), tb, device=cu.device, dtype=cu.dtype)
    out["cu_seq_lens_q"] = torch.cat([cu, extra])
    cu_k = inputs.get("cu_seq_lens_k", cu)
    out["cu_seq_lens_k"] = out["cu_seq_lens_q"] if cu_k is cu else torch.cat([cu_k, extra])
    for key in ("max_length_q", "max_length_k"):
        out[key] = tb
    return out


class CapturedStepMixin:
    """The captured ``training_step`` (module docstring). Put it before ``Trainer`` in the bases;
    call ``configure_captured_step`` at the end of ``__init__`` (callable again before training
    to change the mode). A subclass may override ``_captured_loss``
    (the loss without host work) and ``_after_captured_micro_batch`` (metrics from the unpadded
    inputs)."""

    def configure_captured_step(
        self, cuda_graphs: str, max_tokens_per_batch: int | None = None
    ) -> None:
        """Set the step mode (``"auto"``, ``"on"``, ``"off"``) and the bucket ladder's top; ``on``
        raises ``CaptureError`` for what is already known to block a capture."""
        if cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs: expected 'auto', 'on' or 'off', got {cuda_graphs!r}")
        if max_tokens_per_batch is not None and (
            not isinstance(max_tokens_per_batch, int) or max_tokens_per_batch < 1
        ):
            raise ValueError(
                f"max_tokens_per_batch: expected a positive int, got {max_tokens_per_batch!r}"
            )
        self.cuda_graphs = cuda_graphs
        self._buckets = bucket_ladder(max_tokens_per_batch or self._default_max_tokens())
        self._graphed: GraphedStep | None = None
        self._step_mode: StepMode | None = None  # decided at the first micro-batch
        if cuda_graphs == "off":
            self._step_mode = StepMode(False, "off: requested")
        elif cuda_graphs == "on":  # what is known now is refused now, before any training
            static = self._static_blockers()
            if static:
                raise CaptureError("cuda_graphs='on' cannot be honoured: " + "; ".join(static))

    def _default_max_tokens(self) -> int:
        return _DEFAULT_MAX_TOKENS

    # -- what blocks a capture -----------------------------------------------------------------

    def _static_blockers(self) -> list[str]:
        """Reasons known from the arguments, the accelerator and the model (module docstring)."""
        from accelerate.utils import DistributedType

        reasons = []
        acc, args = self.accelerator, self.args
        if acc.distributed_type == DistributedType.DEEPSPEED:
            reasons.append("DeepSpeed's engine runs backward and partitions gradients itself")
        if getattr(self, "is_fsdp_enabled", False):
            reasons.append("FSDP all-gathers parameters per layer with host-side bookkeeping")
        if acc.num_processes > 1:
            reasons.append(
                f"one process only (this run has {acc.num_processes}): DDP's all-reduce is eager"
            )
        if args.n_gpu > 1:
            reasons.append(f"DataParallel over {args.n_gpu} GPUs replicates the model per step")
        if getattr(args, "activation_offloading", False):
            reasons.append("activation offloading copies activations to host memory")
        offload = checkpointing_kwargs(args).get("offload")
        if offload:
            reasons.append("activation_checkpointing_kwargs offload copies to host memory")
        if getattr(args, "torch_compile_mode", None) == "reduce-overhead":
            reasons.append("torch_compile_mode='reduce-overhead' captures with Inductor's graphs")
        model = self.accelerator.unwrap_model(self.model)
        reasons += capture_blockers(model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        attn = getattr(getattr(base, "config", None), "_attn_implementation", None)
        if attn != "varlen_packed":
            reasons.append(
                f"attn_implementation {attn!r}: only 'varlen_packed' runs padding-free batches "
                "without host syncs"
            )
        return reasons

    def _batch_blockers(self, inputs: dict[str, Any]) -> list[str]:
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
            return [
                f"batches must be padding-free [1, T] rows (got input_ids {shape}): "
                "SFTConfig(padding_free=True) or hf_varlen.PackingCollator"
            ]
        if not isinstance(inputs.get("cu_seq_lens_q"), torch.Tensor) or "labels" not in inputs:
            return ["batches need labels and cu_seq_lens_q/k (TRL's padding-free collator and "
                    "PackingCollator add them)"]  # fmt: skip
        if _device_type(ids) != "cuda":
            return [f"CUDA graphs need a CUDA device (this run uses {ids.device.type})"]
        return []

    # -- the step ------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._step_mode is not None and not self._step_mode.captured:
            return super().training_step(model, inputs, num_items_in_batch)
        inputs = self._prepare_inputs(inputs)
        if self._step_mode is None:
            self._decide(model, inputs)
            if not self._step_mode.captured:
                return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if "use_cache" in inputs:
            inputs = {k: v for k, v in inputs.items() if k != "use_cache"}
        blockers = self._batch_blockers(inputs)
        if blockers:  # a later batch of another kind: never silently eager
            raise CaptureError("captured step: " + "; ".join(blockers))
        static = pad_to_bucket(inputs, self._buckets)
        scaled = self._loss_scaled(num_items_in_batch)
        n_items = num_items_in_batch
        if n_items is None:  # the micro-batch's own label count: the model's mean loss
            n_items = (inputs["labels"][:, 1:] != -100).sum()
        self._ga_scale.fill_(1.0 if scaled else 1.0 / self.current_gradient_accumulation_steps)
        try:
            loss = self._graphed.forward_backward(static, n_items)
        except RuntimeError as exc:
            if "captur" not in str(exc):
                raise
            self._capture_failed(exc)
            return super().training_step(model, inputs, num_items_in_batch)
        self._after_captured_micro_batch(inputs)
        return loss

    def _loss_scaled(self, num_items_in_batch) -> bool:
        """Trainer's own rule (``training_step``): is the loss already scaled for accumulation?"""
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (
            self.model_accepts_loss_kwargs and num_items_in_batch is not None
        ) or self.compute_loss_func is not None

    def _captured_loss(self, model, inputs: dict[str, Any], n_items: torch.Tensor):
        """The loss as ``compute_loss`` computes it, with no host work (it is captured)."""
        return self.compute_loss(model, inputs, num_items_in_batch=n_items)

    def _after_captured_micro_batch(self, inputs: dict[str, Any]) -> None:
        """Host-side bookkeeping of one micro-batch (unpadded ``inputs``), after its replay."""

    # -- the decision --------------------------------------------------------------------------

    def _decide(self, model, inputs: dict[str, Any]) -> None:
        """Decide the mode at the first micro-batch (its real tokens are known now); build the
        captured step when it is on. Logs one line either way."""
        blockers = self._static_blockers() + self._batch_blockers(inputs)
        unwrapped = self.accelerator.unwrap_model(model)
        checkpoint_note = ""
        if not blockers:
            blockers, checkpoint_note = self._checkpointing(unwrapped)
        ids = inputs.get("input_ids")
        device = _device_type(ids) if isinstance(ids, torch.Tensor) else "cpu"
        free = need = None
        if device == "cuda" and torch.cuda.is_available() and not blockers:
            free = torch.cuda.mem_get_info(inputs["input_ids"].device)[0]
            cfg = getattr(unwrapped, "config", None)
            hidden = getattr(cfg, "hidden_size", None)
            layers = getattr(cfg, "num_hidden_layers", None)
            if hidden and layers:  # shapes of this first batch's size (the ladder top is a bound)
                tokens = int(inputs["input_ids"].shape[-1])
                # plus what the first step still allocates: gradients and two AdamW moments
                state = sum(
                    3 * p.numel() * p.element_size()
                    for p in unwrapped.parameters()
                    if p.requires_grad
                )
                need = capture_bytes(tokens, hidden, layers) + state
        lora = hasattr(unwrapped, "peft_config")
        try:
            mode = choose_step_mode(
                self.cuda_graphs,
                device=device,
                real_tokens=int(inputs["input_ids"].shape[-1]) if not blockers else None,
                processes=self.accelerator.num_processes,
                blockers=blockers,
                free_bytes=free,
                need_bytes=need,
                lora=lora,
            )
        except ValueError as exc:
            raise CaptureError(str(exc)) from exc
        self._step_mode = mode
        if not mode.captured:
            logger.warning("hf_varlen training step: %s", mode.text)
            return
        self._ga_scale = torch.ones((), device=inputs["input_ids"].device)
        bf16_over_fp32 = self.args.bf16 and any(
            p.dtype == torch.float32 for p in unwrapped.parameters() if p.requires_grad
        )

        def loss_fn(m, batch, n_items):
            return self._captured_loss(m, batch, n_items) * self._ga_scale

        self._graphed = GraphedStep(
            model,
            self.optimizer,
            loss_fn,
            device=inputs["input_ids"].device,
            max_grad_norm=math.inf,
            autocast_dtype=torch.bfloat16 if bf16_over_fp32 else None,
            update=False,
        )
        logger.warning(
            "hf_varlen training step: %s; forward + backward replayed per bucket shape, the "
            "optimizer step eager in Trainer's loop (it clips and steps itself)%s",
            mode.text,
            checkpoint_note,
        )

    def _checkpointing(self, unwrapped) -> tuple[list[str], str]:
        """Gradient checkpointing without the RNG stash (re-enabled so where the model has no
        dropout); returns (blockers, a note for the log)."""
        reasons = model_blockers(unwrapped)
        if not reasons:
            return [], ""
        if any("dropout" in r for r in reasons):
            return reasons, ""
        user = checkpointing_kwargs(self.args)
        if user.get("preserve_rng_state") is True:
            return reasons, ""
        every = user.pop("every_n_layers", 1)
        user.pop("offload", None)
        user.setdefault("use_reentrant", False)
        user["preserve_rng_state"] = False
        if hasattr(unwrapped, "activation_checkpointing_enable"):  # transformers >= 5.25
            unwrapped.activation_checkpointing_enable(
                activation_checkpointing_kwargs=user, every_n_layers=every
            )
        else:
            unwrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs=user)
        left = model_blockers(unwrapped)
        note = "; gradient checkpointing re-enabled with preserve_rng_state=False (no dropout)"
        return left, note if not left else ""

    def _capture_failed(self, exc: RuntimeError) -> None:
        reason = (
            "the model's forward or loss synchronises with the host (a .item(), a nonzero, a "
            f"data-dependent shape), which a CUDA graph cannot capture: {exc}"
        )
        if self.cuda_graphs == "on":
            raise CaptureError("cuda_graphs='on': " + reason) from exc
        self._step_mode = StepMode(False, "auto: " + reason)
        self._graphed = None
        logger.warning("hf_varlen training step: %s", self._step_mode.text)

    def captured_step_summary(self) -> dict[str, Any]:
        """Which step ran and why, and what was captured (None before the first step)."""
        mode = self._step_mode
        out: dict[str, Any] = {"mode": None if mode is None else mode.text}
        if self._graphed is not None:
            out.update(self._graphed.summary())
        return out


def _device_type(t: torch.Tensor) -> str:
    """The device type a batch trains on (the CPU tests simulate capture by replacing it)."""
    return t.device.type


class VarlenTrainer(CapturedStepMixin, Trainer):
    """``transformers.Trainer`` with the captured step (module docstring).

    Takes every ``Trainer`` argument, plus ``cuda_graphs`` ("auto", "on", "off") and
    ``max_tokens_per_batch`` (the largest micro-batch, the top of the bucket ladder; default
    2^20, which gives the same rungs below it)."""

    def __init__(
        self,
        *args: Any,
        cuda_graphs: str = "auto",
        max_tokens_per_batch: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.configure_captured_step(cuda_graphs, max_tokens_per_batch)
