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


# What one optimizer step counts, summed over its micro-batches (then over the ranks), in order.
COUNTS = (
    "real_tokens", "tensor_tokens", "label_tokens", "attn_sq", "budget_tokens", "padded_tokens",
)  # fmt: skip


def batch_counts(batches: list[Any], token_budget: int) -> list[int]:
    """This rank's ``COUNTS`` of one step's micro-batches (``batching.MicroBatch``). A dummy
    counts only in the tokens its tensor holds: it trains nothing."""
    real = [b for b in batches if not b.dummy]
    return [
        sum(b.real_tokens for b in real),
        sum(b.tensor_tokens for b in batches),
        sum(b.label_tokens for b in real),
        sum(b.attn_sq for b in real),
        len(real) * token_budget,
        sum(b.padded_tokens for b in real),
    ]


def step_record(
    totals: list[float],
    lr: float,
    grad_norm: float,
    finite: bool,
    micro_batches: int,
    step_time: float,
    **extra: int,
) -> dict[str, Any]:
    """The step's line for the metrics: ``totals`` is the loss then ``COUNTS``, summed over the
    ranks."""
    counts = {k: v if k == "attn_sq" else int(v) for k, v in zip(COUNTS, totals[1:], strict=True)}
    return {
        "loss": totals[0],
        "lr": lr,
        "grad_norm": grad_norm,
        "skipped": not finite,
        **counts,
        "micro_batches": micro_batches,
        "step_time": step_time,
        **extra,
    }


@torch.no_grad()
def trial_forward(model, inputs: dict[str, Any], loss_kwargs: bool, name: str, attn: str) -> None:
    """One forward of ``inputs`` (a one-token batch) in eval mode, so that an error of the model
    ``name`` or its attention ``attn`` surfaces, with the options to try, before step 1."""
    model.eval()
    try:
        step_loss(model, inputs, 1, loss_kwargs)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        raise ValueError(
            f"--model {name!r} failed a one-token trial forward with "
            f"attn_implementation={attn!r}: {str(exc).rstrip('.')}. "
            "Hint: --padded (sdpa baseline), --attn-implementation sdpa, or another "
            "--attn-backend"
        ) from exc
    finally:
        model.train()


@torch.no_grad()
def eval_sums(model, batches, compiler, device, loss_kwargs: bool, eval_kwargs: dict[str, Any]):
    """(summed token cross-entropy as a 0-d fp64 tensor, label tokens) of ``batches`` (this rank's
    ``MicroBatch``es; dummies add nothing) in eval mode; ``compiler`` marks and guards as in
    training (``compiling.ModelCompiler``)."""
    model.eval()
    ce = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for mb in batches:
        inputs = compiler.mark(to_device(mb.inputs, device))
        with compiler.guard():
            loss = step_loss(model, inputs, 1, loss_kwargs, **eval_kwargs)
        if not mb.dummy:
            ce += loss.double()
            count += mb.label_tokens
    model.train()
    return ce, count
