"""Padding-free log-prob passes for TRL's ``DPOTrainer`` and ``GRPOTrainer``.

    from hf_varlen.integrations.trainers import VarlenDPOTrainer, VarlenGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="varlen_packed")
    trainer = VarlenDPOTrainer(model=model, args=DPOConfig(...), train_dataset=pairs)

``import hf_varlen`` never imports this module (nor trl); importing it needs trl >= 1.16.

Why subclasses. TRL 1.16's preference and RL trainers build padded batches: DPO stacks the chosen
and rejected sequences of every pair into 2B right-padded rows (``DPOConfig.padding_free`` is
accepted but switched off with a warning in 1.16), GRPO stacks left-padded prompts and right-padded
completions. Every padding token then goes through the embeddings, the MLPs and the norms of every
layer; for completions of very different lengths that is most of the batch. Both trainers ask the
model for per-token log-probabilities in one place, ``model(**inputs, labels=labels,
fused_lm_head=True)`` (TRL's own fused LM head, ``trl.trainer.utils.add_fused_lm_head``), and read
``(rows, length - 1)`` fields back. :class:`PackedLogProbs` answers exactly that call from one packed
row: the real tokens of every padded row back to back, ``cu_seq_lens_q/k`` and ``max_length_q/k``
as the collator kwargs ``varlen_packed`` takes, positions restarting per row; then it scatters each
per-token field back into the padded layout TRL expects (zero where no label is scored, as TRL's
head itself returns). Nothing of TRL or transformers is patched; the seams:

- DPO: ``compute_loss`` (Trainer's documented override) hands TRL's own loss a
  :class:`PackedLogProbs` of the policy, and ``compute_ref_log_probs`` (the precomputed reference,
  ``precompute_ref_logps=True``) one of the reference; a separate ``ref_model`` is answered packed
  during the loss too. A PEFT model without a reference model gets its reference from TRL's padded
  call with the adapter disabled (TRL calls ``self.model`` there directly): exact through
  ``varlen_packed``'s padding-mask path, only not packed.
- GRPO: TRL has no public seam for its log-prob pass; the smallest override is its
  ``_get_per_token_logps_and_entropies(model, ...)``, which here calls TRL's own implementation
  with a :class:`PackedLogProbs` of ``model``. It serves the policy, the old policy and the
  reference passes alike. Generation stays TRL's (transformers or vLLM).

Exactness: every row attends only to itself (``varlen_packed`` with the row offsets), with
positions ``0..n-1`` of its real tokens; with relative position encodings (RoPE) that is the padded
computation up to rounding, for left-padded rows too (tests/integrations/test_trl_preference.py checks the
log-probs, entropies and gradients under the numerics rule). Refused with a clear error: vision
inputs (``pixel_values`` and the like: a packed multimodal row needs its own position layout) and
models without ``attn_implementation="varlen_packed"`` (packed rows would attend across rows).

Shapes: padded ``input_ids`` / ``attention_mask`` / ``labels`` (R, L); the packed row (1, T) with
T = attention_mask.sum(); packed fields (1, T - 1); returned fields (R, L - 1).
"""

from __future__ import annotations

from typing import Any

import torch
from trl import DPOTrainer, GRPOTrainer

__all__ = ["PackedLogProbs", "VarlenDPOTrainer", "VarlenGRPOTrainer"]

IGNORE_INDEX = -100
# Keys of TRL's fused-head call that this adapter understands; anything else (vision tensors,
# token_type_ids, ...) is refused by name rather than dropped.
_KNOWN_KEYS = {"input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache"}
_PASSED_THROUGH = {"output_router_logits"}
_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _attn_implementation(model) -> str | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    get_text = getattr(config, "get_text_config", None)
    config = get_text() if get_text is not None else config
    return getattr(config, "_attn_implementation", None)


def _unwrapped(model):
    """The model under DDP / accelerate wrappers (they keep it as ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


class PackedLogProbs:
    """Answers TRL's ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)`` call on
    padded rows from one packed row (module doc). Calls without ``fused_lm_head=True`` go to the
    model unchanged. Attribute reads fall through to the wrapped model."""

    def __init__(self, model):
        impl = _attn_implementation(_unwrapped(model))
        if impl != "varlen_packed":
            raise ValueError(
                f"packed log-prob passes need attn_implementation='varlen_packed' on the model "
                f"(it has {impl!r}): load it with from_pretrained(..., "
                f"attn_implementation='varlen_packed') after `import hf_varlen`"
            )
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        if args or not kwargs.get("fused_lm_head", False):
            return self.model(*args, **kwargs)
        unknown = sorted(
            k for k, v in kwargs.items() if v is not None and k not in _KNOWN_KEYS | _PASSED_THROUGH
        )
        if unknown:
            raise NotImplementedError(
                f"packed log-prob passes take text inputs only; got {unknown}. Vision-language "
                f"preference / RL training: use TRL's DPOTrainer / GRPOTrainer (padded) instead"
            )
        input_ids, labels = kwargs["input_ids"], kwargs["labels"]
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(input_ids)
        packed = pack_rows(input_ids, labels, mask)
        extra = {k: kwargs[k] for k in _PASSED_THROUGH if kwargs.get(k) is not None}
        out = self.model(
            input_ids=packed["input_ids"],
            position_ids=packed["position_ids"],
            labels=packed["labels"],
            cu_seq_lens_q=packed["cu_seq_lens"],
            cu_seq_lens_k=packed["cu_seq_lens"],
            max_length_q=packed["max_length"],
            max_length_k=packed["max_length"],
            fused_lm_head=True,
            use_cache=False,
            **extra,
        )
        for name in _PER_TOKEN_FIELDS:
            value = getattr(out, name, None)
            if value is not None:
                out[name] = unpack_field(value, packed)
        label_mask = getattr(out, "label_mask", None)
        if label_mask is not None:
            out["label_mask"] = unpack_field(label_mask, packed)
        return out


def pack_rows(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """The real tokens of padded rows as one packed row (module doc for the shapes).

    Each row's real tokens (``mask`` true, in order; left, right or both-sided padding) become one
    document. A document's first label is set to -100: in the packed row it would be predicted
    from the previous document's last token. Host work: one read of the row lengths (the max
    length ``varlen_packed`` takes as an int), outside the model."""
    if input_ids.dim() != 2 or mask.shape != input_ids.shape or labels.shape != input_ids.shape:
        raise ValueError(
            f"packed log-prob passes take (rows, length) input_ids, attention_mask and labels; "
            f"got {tuple(input_ids.shape)}, {tuple(mask.shape)}, {tuple(labels.shape)}"
        )
    keep = mask.bool()
    lengths = keep.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("packed log-prob passes need at least one real token in every row")
    device = input_ids.device
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=device)
    cu[1:] = lengths.cumsum(0)
    # within-row rank of every real token: its position in its document
    rank = keep.long().cumsum(dim=1) - 1
    ids = input_ids[keep][None]
    pos = rank[keep][None]
    packed_labels = labels[keep].clone()
    packed_labels[cu[:-1].long()] = IGNORE_INDEX
    # flat packed index of every padded position (valid where keep is true)
    flat = keep.flatten().long().cumsum(0).view_as(keep) - 1
    # padded field column j scores token j + 1 from hidden j: packed index flat[:, j + 1] - 1,
    # defined where token j + 1 is real and is not its row's first real token
    scored = keep[:, 1:] & (rank[:, 1:] > 0)
    source = (flat[:, 1:] - 1).clamp(min=0)
    return dict(
        input_ids=ids,
        position_ids=pos,
        labels=packed_labels[None],
        cu_seq_lens=cu,
        max_length=int(lengths.max()),
        scored=scored,
        source=source,
    )


def unpack_field(value: torch.Tensor, packed: dict[str, Any]) -> torch.Tensor:
    """A packed (1, T - 1) per-token field in the padded (R, L - 1) layout, zero elsewhere
    (differentiable: a gather, then a select)."""
    source, scored = packed["source"], packed["scored"]
    gathered = value[0][source]
    return torch.where(scored, gathered, torch.zeros((), dtype=value.dtype, device=value.device))


class VarlenDPOTrainer(DPOTrainer):
    """``DPOTrainer`` whose policy and reference log-prob passes run packed (module doc).

    ``DPOConfig.padding_free`` is irrelevant here (TRL 1.16 ignores it with a warning): the
    passes are always packed; the collator and the loss are TRL's own."""

    def __init__(self, *args, **kwargs):
        cfg = kwargs.get("args")
        if cfg is not None and getattr(cfg, "padding_free", False):
            # TRL 1.16 would warn that padding-free is disabled and fall back to padding: here the
            # padded batch is packed before the model sees it, so the request is honoured.
            cfg.padding_free = False
        super().__init__(*args, **kwargs)
        PackedLogProbs(self.model)  # refuse a model without varlen_packed now, not at step 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ref = self.ref_model
        if ref is not None:
            self.ref_model = PackedLogProbs(ref)
        try:
            return super().compute_loss(
                PackedLogProbs(model), inputs, return_outputs, num_items_in_batch
            )
        finally:
            self.ref_model = ref

    def compute_ref_log_probs(self, model, inputs):
        return super().compute_ref_log_probs(PackedLogProbs(model), inputs)


class VarlenGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose log-prob passes (policy, old policy, reference) run packed over
    prompt + completion (module doc); generation and rewards are TRL's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        PackedLogProbs(self.model)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ):
        return super()._get_per_token_logps_and_entropies(
            PackedLogProbs(model), input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
