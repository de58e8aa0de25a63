"""One micro-batch's loss, as the loop, its eval and the captured step compute it, and the error
of a non-finite step.

``step_loss``: the summed token cross-entropy divided by ``n_items`` -- by the model itself
(``num_items_in_batch``, so fused cross-entropy kernels still apply) when its forward takes loss
kwargs (``accepts_loss_kwargs``), else from its logits [B, T, V] against labels [B, T], shifted.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F


def accepts_loss_kwargs(model) -> bool:
    """Whether ``model.forward`` takes ``num_items_in_batch`` (by name or through ``**kwargs``)."""
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or any(
        p.name == "num_items_in_batch" for p in params
    )


def step_loss(model, inputs: dict[str, Any], n_items, loss_kwargs: bool, **extra) -> torch.Tensor:
    """Summed token CE of ``inputs`` divided by ``n_items`` (tensor or int)."""
    if loss_kwargs:
        return model(**inputs, num_items_in_batch=n_items, **extra).loss
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    ce = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum"
    )
    return ce / n_items


def to_device(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The tensors of ``inputs`` on ``device`` (copies that need not wait for the host)."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
    }


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN/inf (``--on-nonfinite stop``, the default)."""


def nonfinite_message(step: int, loss: float, grad_norm: float, lr: float) -> str:
    """``NonFiniteError``'s text: what was not finite, what is intact, and the ways out."""
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
