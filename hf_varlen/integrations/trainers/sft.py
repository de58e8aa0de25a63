"""TRL's ``SFTTrainer`` with hf_varlen's fused linear cross-entropy as the training loss.

    from hf_varlen.integrations.trainers import VarlenSFTTrainer

    trainer = VarlenSFTTrainer(model=model, args=SFTConfig(padding_free=True), ...)

``import hf_varlen`` never imports this module (nor trl); importing it needs trl >= 1.16.

Why a subclass. TRL 1.16's ``SFTTrainer`` installs its own fused LM head on every model
(``trl.trainer.utils.add_fused_lm_head``) and its ``compute_loss`` asks the model for per-token
log-probabilities with ``fused_lm_head=True``; a loss installed on the model
(``hf_varlen.install_fused_cross_entropy``) is never reached that way. On an H200 (16,384 tokens x
hidden 2048 x vocab 151,936, bf16, forward+backward) hf_varlen's ``fused_linear_cross_entropy``
takes 51.5 ms where TRL's head as SFTTrainer runs it takes 70.8 ms, at the same extra peak memory;
but end to end under TRL's defaults (fp32 weights, bf16 autocast; 1B shape, batch 32) training with
this subclass measured 6-9% slower than plain ``SFTTrainer`` (docs/BENCHMARKS.md, TRL section), so
it is for the fused op's options, not for speed, until that is understood.

The seams used are the documented ones, nothing of TRL is patched or reassigned:

- the constructor runs ``SFTTrainer.__init__`` unchanged, then ``install_fused_cross_entropy`` on the
  trained model (the PEFT base model when PEFT wraps it). TRL's head stays installed but only runs
  when a call passes ``fused_lm_head=True``, which this trainer never does: every other call of
  TRL's forward goes to the model's own forward, where the fused loss is computed;
- ``compute_loss`` (Trainer's documented override) calls ``model(**inputs, fused_loss=True)``.

Kept from TRL: the loss is the sum of per-token NLL over label tokens divided by
``num_items_in_batch`` (the label tokens of the whole accumulated batch, across devices when
``average_tokens_across_devices``; their count in the micro-batch when it is None), then times
``num_processes // tp_size`` exactly where TRL multiplies; completion-only and assistant-only loss
(TRL's collators write them into ``labels`` as -100, which both losses skip); padding-free and bfd
packing (with ``attn_implementation="varlen_packed"`` the packed documents stay separate); the
``num_tokens`` metric (same definition: attention-mask tokens, or the packed row length when the
batch is padding-free, gathered across processes, divided by the tensor-parallel size).

Not logged: ``entropy`` and ``mean_token_accuracy``. Both need every logit of a token (the
distribution's entropy, the arg-max), which the fused cross-entropy never forms; rather than a
wrong value, or a second forward pass per step, they are left out of the logs.

Refused with a clear error (use ``SFTTrainer`` for these): ``loss_type="dft"`` (weights each
token's loss by its probability), ``compute_loss_func``, ``label_smoothing_factor > 0`` (pass
``fused_cross_entropy_kwargs={"label_smoothing": ...}`` if you want the fused op's label smoothing),
a Mixture-of-Experts router aux loss (``router_aux_loss_coef`` != 0), DeepSpeed sequence
parallelism, and every model whose loss ``install_fused_cross_entropy`` cannot reproduce (its
NotImplementedError / TypeError is raised from the constructor).

Precision under bf16 autocast: the fused op follows ``nn.Linear`` (the head's logits in bf16, its
gradients returned in bf16, as transformers' own head computes them); TRL's head accumulates and
returns the head's gradients in fp32, so it tracks an fp32 run more closely (tiny Llama, one SGD
step at lr 1: loss 4.5e-3 from fp32 with ours, 1.2e-3 with TRL's head; within the numerics rule of
transformers' own head, tests/integrations/test_trl_fused_loss.py). In fp32 both agree to rounding: TRL's head
sums the hidden-state gradient over vocabulary tiles in fp32, and so does the fused op in fp32
(``cross_entropy.chunks.DH_VOCAB_BLOCK_FP32``; one GEMM over all 152K columns was ~3x noisier on
the H200).

Evaluation: ``prediction_loss_only`` gets the fused loss (no logits); when ``compute_metrics``
needs logits (``return_outputs=True``), one ordinary forward returns the logits and HF's loss.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import SFTTrainer

from ...metadata import checkpointed_side_effects, mark_dynamic_pack, symbolic_batch_ints
from ..fused_loss import install_fused_cross_entropy, is_fused_cross_entropy_installed
from .callbacks import OffsetsCheckCallback
from .captured import CapturedStepMixin

__all__ = ["VarlenSFTTrainer"]


def _parallel_flags(accelerator) -> tuple[bool, bool]:
    """(DeepSpeed sequence parallelism on, context parallelism on) of the accelerator."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None:
        return False, False
    sp = bool(getattr(pc, "sp_enabled", False)) and getattr(pc, "sp_backend", None) == "deepspeed"
    return sp, bool(getattr(pc, "cp_enabled", False))


class VarlenSFTTrainer(CapturedStepMixin, SFTTrainer):
    """``trl.SFTTrainer`` whose training loss is hf_varlen's fused linear cross-entropy.

    Takes every ``SFTTrainer`` argument, plus:

        fused_cross_entropy_kwargs: keyword arguments of ``hf_varlen.install_fused_cross_entropy``
            (``chunk_size``, ``z_loss``, ``label_smoothing``, ``backend``,
            ``drop_ignored_tokens``). None: the defaults, or, when the model already has the fused
            loss installed (``hf_varlen.kernelize`` installs it), the options it was installed
            with.
        cuda_graphs: "auto" (default), "on" or "off": the captured step
            (``hf_varlen.integrations.trainers.captured``: padding-free batches padded to a bucket,
            forward + backward replayed per bucket shape; ``num_tokens`` and the loss as eager).
        max_tokens_per_batch: the top of the bucket ladder (default: per-device batch size x
            ``max_length``, the longest padding-free row TRL's collator builds).

    See the module docstring for what is kept from TRL, what is not logged and what is refused.
    """

    def __init__(
        self,
        *args: Any,
        fused_cross_entropy_kwargs: dict[str, Any] | None = None,
        cuda_graphs: str = "auto",
        max_tokens_per_batch: int | None = None,
        **kwargs: Any,
    ):
        if fused_cross_entropy_kwargs is not None and not isinstance(
            fused_cross_entropy_kwargs, dict
        ):
            raise TypeError(
                "fused_cross_entropy_kwargs: expected a dict of install_fused_cross_entropy "
                f"options, got {type(fused_cross_entropy_kwargs).__name__}"
            )
        super().__init__(*args, **kwargs)
        self._dynamo_patches: dict[str, bool] | None = None  # compute_loss sets it once
        self._check_supported()
        lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if fused_cross_entropy_kwargs is not None or not is_fused_cross_entropy_installed(lm):
            # Raises NotImplementedError / TypeError for losses it cannot reproduce.
            install_fused_cross_entropy(lm, **(fused_cross_entropy_kwargs or {}))
        self.add_callback(OffsetsCheckCallback())  # free: num_tokens reads back every step
        for name in ("_metrics", "_total_train_tokens", "_tp_size"):
            if not hasattr(self, name):  # SFTTrainer's metric state, which log() reads
                raise RuntimeError(
                    f"VarlenSFTTrainer: SFTTrainer has no {name!r} (a TRL release other than 1.16); "
                    "the num_tokens metric cannot be kept"
                )
        self.configure_captured_step(cuda_graphs, max_tokens_per_batch)

    def _default_max_tokens(self) -> int:
        length = getattr(self.args, "max_length", None)
        if isinstance(length, int) and length > 0:
            return self.args.per_device_train_batch_size * length
        return super()._default_max_tokens()

    def _check_supported(self) -> None:
        args = self.args
        reasons = []
        if args.loss_type != "nll":
            reasons.append(f"loss_type={args.loss_type!r} weights each token by its probability")
        if self.compute_loss_func is not None:
            reasons.append("compute_loss_func replaces the loss with one computed from logits")
        if args.label_smoothing_factor > 0:
            reasons.append(
                f"label_smoothing_factor={args.label_smoothing_factor} is computed from logits "
                '(for the fused op\'s own, pass fused_cross_entropy_kwargs={"label_smoothing": x})'
            )
        if self.aux_loss_enabled:
            reasons.append(
                f"the MoE router aux loss (router_aux_loss_coef={self.router_aux_loss_coef}) is "
                "added by TRL per micro-batch; set router_aux_loss_coef=0.0 to train without it"
            )
        if _parallel_flags(self.accelerator)[0]:
            reasons.append("DeepSpeed sequence parallelism reduces TRL's own head loss")
        if reasons:
            raise NotImplementedError(
                "VarlenSFTTrainer computes the loss with hf_varlen's fused cross-entropy, which "
                "does not support: " + "; ".join(reasons) + ". Use trl.SFTTrainer for this run."
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The fused cross-entropy loss of ``inputs`` (see the module docstring).

        ``inputs`` is one collated micro-batch (``input_ids`` [B, T] and ``labels`` [B, T],
        padding-free: B = 1 with ``position_ids`` / ``cu_seq_lens_*``); ``num_items_in_batch``
        the label tokens of the accumulated batch (Trainer's count), or None."""
        mode = "train" if self.model.training else "eval"
        loss, outputs = self._fused_loss(model, inputs, num_items_in_batch, return_outputs)
        if mode == "train":
            self._total_train_tokens += self._count_tokens(inputs) // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, outputs) if return_outputs else loss

    def _captured_loss(self, model, inputs, n_items):
        """The captured step's loss: ``compute_loss``'s, without the host-side token count
        (done from the unpadded batch after the replay: ``_after_captured_micro_batch``)."""
        return self._fused_loss(model, {**inputs, "use_cache": False}, n_items, False)[0]

    def _after_captured_micro_batch(self, inputs) -> None:
        self._total_train_tokens += self._count_tokens(inputs) // self._tp_size
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    def _fused_loss(self, model, inputs, num_items_in_batch, return_outputs):
        """(loss, outputs) of one micro-batch; no host work."""
        inputs["use_cache"] = False
        if "labels" not in inputs:
            raise ValueError(
                "inputs: VarlenSFTTrainer needs `labels` in every batch (TRL's collators add them)"
            )
        call = dict(inputs)
        if num_items_in_batch is not None:
            call["num_items_in_batch"] = num_items_in_batch
        # With return_outputs (eval metrics on logits) one ordinary forward gives logits and loss.
        if self.args.torch_compile:  # no recompile per pack: tensors marked, ints symbolic
            mark_dynamic_pack(call)
            if self._dynamo_patches is None:  # the model is fixed once training starts
                self._dynamo_patches = checkpointed_side_effects(model)
            with symbolic_batch_ints(), torch._dynamo.config.patch(**self._dynamo_patches):
                outputs = model(**call, fused_loss=not return_outputs)
        else:
            outputs = model(**call, fused_loss=not return_outputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As TRL and Trainer do: num_items_in_batch counts every rank's tokens, DDP averages.
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return loss, outputs

    def _count_tokens(self, inputs) -> int:
        """TRL's num_tokens of one micro-batch: attention-mask tokens, or the packed row length
        of a padding-free batch, summed over processes."""
        if inputs.get("attention_mask") is not None:
            local = inputs["attention_mask"].sum()
        elif inputs.get("position_ids") is not None:
            pos = inputs["position_ids"]
            local = torch.tensor(pos.size(1), device=pos.device)
        else:
            raise ValueError("inputs: expected 'attention_mask' or 'position_ids' in the batch")
        # Host read, intended: one per micro-batch for TRL's num_tokens metric, in compute_loss,
        # outside the model's (compilable) forward and backward; TRL's own trainer reads it too.
        return int(self.accelerator.gather_for_metrics(local).sum().item())
