"""Pure-PyTorch linear cross-entropy: the oracle for ``hf_varlen.ops.cross_entropy``.

Shapes: hidden (..., H), weight (V, H), bias (V,), labels (...) aligned with hidden (no shift).
It is HF's causal-LM loss path written out with autograd and full logits:

    logits = F.linear(hidden, weight, bias)          # lm_head, in the input dtype
    z      = softcap(logit_scale * upcast(logits))   # ForCausalLMLoss upcasts to fp32
    loss   = F.cross_entropy(z, labels, ignore_index, label_smoothing, reduction="none")
             + z_loss * logsumexp(z)^2 on non-ignored tokens
    "sum": sum over tokens; "mean": sum / max(number of non-ignored tokens, 1); "none": per token.

A batch without label tokens gives 0 for every reduction (F.cross_entropy's "mean" gives NaN there;
its gradients are zero either way), the documented value of the fused op.

Run it on fp64 copies for the high-precision reference and on the input dtype (bf16 logits, fp32
loss, as HF does) for the low-precision one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "sum",
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Loss of ``hidden @ weight.T + bias`` against aligned ``labels`` (autograd-capable)."""
    logits = F.linear(hidden, weight, bias)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.reshape(-1, z.shape[-1])
    y = labels.reshape(-1).long()
    loss = F.cross_entropy(
        z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    kept = y != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(z, dim=-1).square() * kept
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / kept.sum().clamp(min=1)
    raise ValueError(f"reduction: expected 'sum', 'mean' or 'none', got {reduction!r}")
