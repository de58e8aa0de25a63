"""FlashAttention-2-compatible entry points backed by ``hf_varlen.varlen_attention``.

transformers' hub-kernel loader (``attn_implementation="<org>/<name>"``) registers its own
``flash_attention_forward`` wrapper for any kernel module that exports ``flash_attn_varlen_func``,
and reads that function's signature to decide which keyword arguments to pass (``dropout_p``,
``softmax_scale``, ``causal``, ``window_size``, ``softcap``, ``deterministic``, ``s_aux``, ...).
So the names and defaults below are FA2's, and every feature we cannot honour raises instead of
being dropped.

    flash_attn_varlen_func: q (T_q, Hq, D), k/v (T_k, Hk, D), cu_seqlens_* (n+1,) -> (T_q, Hq, D)
    flash_attn_func:        q (B, T_q, Hq, D), k/v (B, T_k, Hk, D)              -> (B, T_q, Hq, D)

transformers passes a sliding window W as ``window_size=(W - 1, W - 1)`` together with
``causal=True``; causality is folded into the window (the right edge becomes 0) by hf_varlen's one
definition, ``hf_varlen.ops.common.causal_window``, as on every route. ``max_seqlen_*`` may arrive as a 0-d tensor (transformers' position_ids path);
it is converted to ``int`` once here (``ops.common.max_length_int``, the one conversion).

This file is copied into the generated hub kernel package. Unlike the layers, attention goes through
the installed ``hf_varlen`` (imported when first called), so the hub route and
``attn_implementation="varlen_packed"`` share one backend choice (``backend="auto"``,
``HF_VARLEN_BACKEND``, ``hf_varlen.set_backend``).
"""

from __future__ import annotations

import torch


def _unsupported(alibi_slopes, return_attn_probs) -> None:
    if alibi_slopes is not None:
        raise NotImplementedError(
            "hf_varlen attention does not support alibi_slopes (got a tensor)"
        )
    if return_attn_probs:
        raise NotImplementedError("hf_varlen attention does not return attention probabilities")


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """Packed attention with FA2's ``flash_attn_varlen_func`` signature (see the module doc)."""
    from hf_varlen import varlen_attention
    from hf_varlen.ops.common import causal_window, max_length_int

    _unsupported(alibi_slopes, return_attn_probs)
    return varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        # Host read, intended: transformers' flash_attention_forward hands max_seqlen over as a
        # 0-d tensor on this eager route, read once per call; varlen_packed and the compiled
        # path never come here (they take the collator's ints).
        max_length_int("max_seqlen_q", max_seqlen_q, host_read=True),
        max_length_int("max_seqlen_k", max_seqlen_k, host_read=True),
        softmax_scale=softmax_scale,
        causal=bool(causal),
        window_size=causal_window(bool(causal), window_size),
        softcap=float(softcap or 0.0),
        dropout_p=float(dropout_p),
        deterministic=bool(deterministic),
        sinks=s_aux,  # attention sinks, (H_q,) (gpt-oss): hf_varlen.varlen_attention(sinks=...)
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """Dense batched attention with FA2's ``flash_attn_func`` signature: one document per row."""
    # The FA2 keywords, passed on by name to the varlen entry point (whose signature they share).
    keywords = dict(locals())
    del keywords["q"], keywords["k"], keywords["v"]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"flash_attn_func expects q, k, v of shape (B, T, H, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, t_q, t_k = q.shape[0], q.shape[1], k.shape[1]
    arange = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q.reshape(batch * t_q, *q.shape[2:]),
        k.reshape(batch * t_k, *k.shape[2:]),
        v.reshape(batch * t_k, *v.shape[2:]),
        arange * t_q,
        arange * t_k,
        t_q,
        t_k,
        **keywords,
    )
    return out.view(batch, t_q, *out.shape[1:])
