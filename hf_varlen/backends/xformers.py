"""`xformers`: xformers memory_efficient_attention with a block-diagonal causal bias.

Used only when xformers' CUDA operators load on the installed torch (its wheels are built for one
torch release; the probe runs a tiny real call). GQA uses xformers' 5-D (B, T, G, H, D) layout
with K/V broadcast over the group dimension (no copy). Document lengths are read on the host once
per batch (cached across layers) because xformers' bias is built from Python lists.
"""

from __future__ import annotations

import torch

from ._common import _IdentityCache, host_bounds
from .registry import BackendSpec, register_backend

_BIAS = _IdentityCache()


def _bias(cu_q, cu_k, causal):
    from xformers.ops import fmha

    hit = _BIAS.get(cu_q, extra=(id(cu_k), causal))
    if hit is not None:
        return hit
    bq, bk = host_bounds(cu_q), host_bounds(cu_k)
    lq = [b - a for a, b in zip(bq[:-1], bq[1:])]
    lk = [b - a for a, b in zip(bk[:-1], bk[1:])]
    if causal:
        bias = fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(lq, lk)
    else:
        bias = fmha.attn_bias.BlockDiagonalMask.from_seqlens(lq, lk)
    return _BIAS.put(cu_q, bias, extra=(id(cu_k), causal))


def xformers_backend(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    softmax_scale,
    causal,
    window_size,
    softcap,
    dropout_p,
    deterministic,
):
    from xformers.ops import memory_efficient_attention

    t_q, h_q, d = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    q5 = q.reshape(1, t_q, h_kv, g, d)
    k5 = k.unsqueeze(2).expand(-1, -1, g, -1).unsqueeze(0)
    v5 = v.unsqueeze(2).expand(-1, -1, g, -1).unsqueeze(0)
    out = memory_efficient_attention(
        q5,
        k5,
        v5,
        attn_bias=_bias(cu_seqlens_q, cu_seqlens_k, causal),
        p=dropout_p,
        scale=softmax_scale,
    )
    return out.reshape(t_q, h_q, v.shape[-1])


def _probe() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        from xformers.ops import memory_efficient_attention
    except Exception as exc:
        return f"xformers not importable: {exc}"
    try:  # a real tiny call: xformers imports fine even when its CUDA ops do not match torch
        x = torch.zeros(1, 8, 1, 1, 64, device="cuda", dtype=torch.float16)
        memory_efficient_attention(x, x, x)
    except Exception as exc:
        return f"xformers operators do not run on torch {torch.__version__}: {type(exc).__name__}: {exc}"
    return None


register_backend(
    BackendSpec(
        name="xformers",
        fn=xformers_backend,
        description="xformers memory_efficient_attention, block-diagonal causal bias",
        requires="pip install xformers built for the installed torch; CUDA",
        sliding_window=False,
        softcap=False,
        dropout=True,
        deterministic=False,
        probe=_probe,
    )
)
