"""Triton varlen flash attention (forward + backward) with a compact, heaviest-first tile schedule.

    o_i = sum_j softmax_j(s_ij) v_j,   s_ij = scale * q_i . k_j   (softcap: softcap * tanh(s / softcap))

over packed documents: query i sees key j only inside its own document, and there only when the
FlashAttention-2 rules allow it (causal with bottom-right alignment, sliding window (left, right),
-1 = unbounded). GQA/MQA: query head h uses KV head h // (H_q / H_kv).

Shapes: q (T_q, H_q, D), k/v (T_k, H_kv, D), cu_seqlens_q/k (n_docs + 1,) int32 (document i is rows
cu[i]:cu[i+1]), out (T_q, H_q, D), lse (H_q, T_q) fp32 (natural log; +inf for rows that see no key).

Why it is fast on packs of short documents (details in schedule.py): the grid covers only
real tokens (ceil(T / tile) tiles x head groups, from T alone - no device->host sync), several short
documents share one tile behind a block-diagonal mask, query heads of a KV group are folded into one
tile, heavy tiles are launched first, and configs depend on head_dim/dtype only, so a new pack never
recompiles. ``max_seqlen_*`` are accepted for API compatibility and never used.

Attention sinks (gpt-oss): applied to the kernel's o and lse outside the kernels
(``apply_sinks``); the backward kernels take the adjusted o and lse, and the sinks' gradient is
one reduction (``sinks_grad``).

Backward: by default a dQ kernel and a dK/dV kernel, no atomics, so bitwise deterministic and
``deterministic=True`` (or FLASH_ATTENTION_DETERMINISTIC=1, or torch's deterministic algorithms)
costs nothing. A config with ``bwd_fused`` (schedule.KernelConfig; off in the shipped
configs: slower on the H200 in every tuning sweep so far) takes the FA2-style fused backward
instead (atomic dQ, 5 matmuls per block instead of 7), except where a deterministic backward is
requested. Dropout is not implemented (dropout_p > 0 raises).

Under torch.compile the call goes through the registered ops ``torch.ops.hf_varlen.triton_attention``
/ ``triton_attention_backward`` (torch_library.py: ``triton_op`` + ``wrap_triton``, so Inductor sees
the kernels; fake implementations; autograd via ``register_autograd``). Eager calls skip the
dispatcher (an autograd.Function with the plan cached across layers): same kernels, same numbers.

Module layout: schedule.py (bounds, tile orders, configs), fwd.py (forward kernel), bwd.py
(backward kernels), launch.py (configs picked, kernels launched, sinks), torch_library.py
(torch.library ops), this file (validation, autograd, public function).
"""

from __future__ import annotations

import torch

from ..common import (
    attention_scale,
    attention_softcap,
    causal_window,
    check_sinks,
    deterministic_requested,
)
from ..library import compiling
from .launch import _last_dim_contiguous, apply_sinks, backward_launch, forward_launch, sinks_grad
from .schedule import get_plan
from .torch_library import triton_attention_op

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _window(causal: bool, window_size) -> tuple[int, int]:
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size must be a pair of ints (left, right), got {window_size!r}"
        ) from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    return causal_window(causal, (left, right))


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softcap) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 3-D tensor (tokens, heads, head_dim), got {shape}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q.dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k/v ({k.shape[2]}) must match")
    if not 1 <= q.shape[2] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the number of KV "
            f"heads ({k.shape[1]})"
        )
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(
                f"{name} must be 1-D with n_docs + 1 >= 1 entries, got {tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_seqlens_q.numel()} "
            f"and {cu_seqlens_k.numel()}"
        )
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p > 0 is not supported by the triton backend, got {dropout_p}")


class _TritonVarlenAttention(torch.autograd.Function):
    """The eager path: direct kernel launches, the plan cached on the cu_seqlens objects."""

    @staticmethod
    def forward(
        ctx, q, k, v, cu_q, cu_k, softmax_scale, left, right, softcap, deterministic, sinks
    ):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        plan = get_plan(cu_q, cu_k, q.shape[0], k.shape[0], left, right)
        o, lse = forward_launch(q, k, v, plan, softmax_scale, softcap)
        if sinks is not None:  # the backward kernels then see the sink-adjusted o and lse
            o, lse = apply_sinks(o, lse, sinks)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.plan = plan
        ctx.args = (softmax_scale, softcap, deterministic)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq, dk, dv = backward_launch(do, q, k, v, o, lse, ctx.plan, *ctx.args)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[10]:
            dsinks = sinks_grad(do, o, lse, sinks)
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks


def triton_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    deterministic: bool | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Varlen (packed) attention with FlashAttention-2 semantics, autograd-capable.

    Args:
        q: (T_q, H_q, D) fp16/bf16 (fp32 is accepted and computed in IEEE fp32); strided views
            are fine as long as the last dimension is contiguous (otherwise it is copied).
        k, v: (T_k, H_kv, D), same dtype and device; H_q must be a multiple of H_kv (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: (n_docs + 1,) int32 on q's device, non-decreasing, with
            cu[-1] == T (not checked here: that needs a device sync). Bad offsets are clamped into
            [0, T] on the device, so they never read or write out of bounds; rows past cu[-1]
            give zeros.
        max_seqlen_q, max_seqlen_k: accepted for API compatibility; the kernel never needs them.
        softmax_scale: defaults to D ** -0.5; a finite number >= 0 (else ValueError).
        causal: causal mask, bottom-right aligned when a document's L_q != L_k.
        window_size: (left, right) sliding window, -1 = unbounded; causal forces right = 0.
        softcap: > 0 applies ``softcap * tanh(s / softcap)`` to the scaled scores (Gemma-2); 0 or
            inf = no softcap; NaN or negative raise ValueError (docs/attention-numerics.md).
        dropout_p: must be 0 (dropout is not implemented; > 0 raises ValueError).
        deterministic: request a bitwise-repeatable backward (also $FLASH_ATTENTION_DETERMINISTIC
            or torch's deterministic mode): the atomic-free split backward (the default one, so
            at no cost), never the fused one with atomic dQ.
        return_lse: also return lse (H_q, T_q) fp32.
        sinks: (H_q,) per-head attention-sink logits (gpt-oss ``s_aux``; differentiable), or None:
            each row's softmax denominator gets exp(sinks[h]) more, with no value (lse includes it).

    Returns:
        out (T_q, H_q, D) in q's dtype, or (out, lse) with ``return_lse=True``. Queries that see no
        key (e.g. an empty window) give zeros.
    """
    softcap = attention_softcap(softcap)  # the policy of every backend (ops/common.py)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, float(dropout_p or 0.0), softcap)
    scale = attention_scale(softmax_scale, q.shape[2])
    return triton_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        softmax_scale=scale,
        window=_window(causal, window_size),
        softcap=softcap,
        deterministic=deterministic_requested(deterministic),
        return_lse=return_lse,
        sinks=check_sinks(sinks, q),
    )


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    window: tuple[int, int],
    softcap: float,
    deterministic: bool,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """``triton_varlen_attention`` on input that is already validated (the public
    ``hf_varlen.varlen_attention`` validates once, then its triton backend calls this).

    ``window`` has causality folded in ((-1, 0) = causal); ``softmax_scale`` is resolved;
    ``deterministic`` is the resolved request. Offsets are trusted only as far as memory safety
    goes: the tile plan clamps them into [0, T] on the device (schedule.row_bounds).
    """
    left, right = window
    if compiling():  # traced: the registered op (torch_library.py), which Inductor can see into
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        out, lse = triton_attention_op(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, softcap, deterministic,
            sinks,
        )  # fmt: skip
        lse = lse.detach()  # as in eager: lse carries no gradient
    else:  # eager: no dispatcher round trip, plan cached across layers
        out, lse = _TritonVarlenAttention.apply(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, softcap, deterministic,
            sinks,
        )  # fmt: skip
    return (out, lse) if return_lse else out
