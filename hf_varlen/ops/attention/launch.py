"""Launching the attention kernels over a tile plan, and the attention sinks around them.

``forward_launch`` / ``backward_launch`` pick this shape's configs (``schedule.pick_config`` and
the long-document path) and run the kernels of ``fwd.py`` / ``bwd.py``; ``apply_sinks`` /
``sinks_grad`` add gpt-oss's sinks outside the kernels. Both callers use them: the eager
autograd.Function (``function.py``) and the registered ``torch.library`` ops (``torch_library.py``),
so neither of those two modules imports the other's.
"""

from __future__ import annotations

import torch

from .bwd import attention_backward
from .fwd import attention_forward
from .schedule import launch_passes, pick_config, pick_long_path


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def forward_launch(q, k, v, plan, softmax_scale, softcap, traceable=False):
    """Forward over a plan: (o (T_q, H_q, D), lse (H_q, T_q) fp32). q/k/v: unit last stride.
    With a long path (schedule.LongPath) the long-document tiles run in a second
    launch with bigger blocks, writing its rows of the same o / lse."""
    cfg = pick_config(q.shape[2], q.dtype, q.device)
    long = pick_long_path(q.shape[2], q.dtype, q.device)
    out = None
    for order, c, fold, bound in launch_passes(
        plan, "fwd", cfg, long, q.shape[1] // k.shape[1], q.device
    ):
        out = attention_forward(
            q, k, v, plan.lo_q, plan.hi_q, order, softmax_scale=softmax_scale, softcap=softcap,
            fold=fold, block_m=c.fwd_block_m, block_n=c.fwd_block_n, num_warps=c.fwd_warps,
            num_stages=c.fwd_stages, traceable=traceable, out=out, bound=bound, tma=c.tma,
        )  # fmt: skip
    return out


def backward_launch(
    do, q, k, v, o, lse, plan, softmax_scale, softcap, deterministic, traceable=False
):
    """(dq, dk, dv) over a plan (bwd.attention_backward with this shape's configs)."""
    return attention_backward(
        _last_dim_contiguous(do), q, k, v, o, lse, plan,
        softmax_scale=softmax_scale, softcap=softcap,
        cfg=pick_config(q.shape[2], q.dtype, q.device), deterministic=deterministic,
        traceable=traceable, long=pick_long_path(q.shape[2], q.dtype, q.device),
    )  # fmt: skip


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Attention sinks from the kernel's result, outside the kernel (gpt-oss's ``s_aux``).

    A sink adds exp(s_h) to each row's softmax denominator and no value. With L = exp(lse) the
    row's own denominator: o' = o * L / (L + e^s) = o * sigmoid(lse - s) and
    lse' = log(L + e^s) = logaddexp(lse, s). Rows that see no key (lse = +inf) stay zeros.
    o (T_q, H_q, D), lse (H_q, T_q) fp32, sinks (H_q,) -> (o', lse')."""
    s = sinks.float()[:, None]  # (H_q, 1)
    scale = torch.sigmoid(lse - s)  # (H_q, T_q)
    out = (o.float() * scale.t()[:, :, None]).to(o.dtype)
    return out, torch.logaddexp(lse, s)


def sinks_grad(do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """d loss / d sinks (H_q,) from the sink-adjusted o', lse' (``apply_sinks``).

    The sink is one more softmax column with probability P_i = exp(s_h - lse'_i) and no value, so
    its dP is 0 and its dS = P_i * (0 - delta_i), delta_i = rowsum(dO * o') (the kernels' delta):
    d s_h = -sum_i exp(s_h - lse'_i) * delta_i over the rows of head h."""
    delta = (do.float() * o.float()).sum(-1).t()  # (H_q, T_q)
    p = torch.exp(sinks.float()[:, None] - lse)
    return -(p * delta).sum(-1).to(sinks.dtype)
