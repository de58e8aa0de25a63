"""`xformers`: xformers memory_efficient_attention with a block-diagonal causal bias.

Used only when xformers' CUDA operators load on the installed torch (its wheels are built for one
torch release; the probe runs a tiny real call). GQA uses xformers' 5-D (B, T, G, H, D) layout
with K/V broadcast over the group dimension (no copy). Document lengths are read on the host once
per batch (cached across layers) because xformers' bias is built from Python lists, so they are
always fully checked.
"""

from __future__ import annotations

import torch

from ..ops.common import TensorCache
from ._common import host_offsets_qk
from .registry import BackendSpec, register_backend

_BIAS = TensorCache()


def _bias(q, k, metadata, causal):
    from xformers.ops import fmha

    def build():
        bq, bk = host_offsets_qk(q, k, metadata)
        lq = [b - a for a, b in zip(bq[:-1], bq[1:])]
        lk = [b - a for a, b in zip(bk[:-1], bk[1:])]
        if causal:
            return fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(lq, lk)
        return fmha.attn_bias.BlockDiagonalMask.from_seqlens(lq, lk)

    cu = (metadata.cu_seqlens_q, metadata.cu_seqlens_k)
    return _BIAS.get_or_compute(cu, build, extra=(q.shape[0], k.shape[0], causal))


def xformers_backend(q, k, v, metadata, params):
    from xformers.ops import memory_efficient_attention

    t_q, h_q, d = q.shape
    g = h_q // k.shape[1]
    # GQA: (1, T, H_kv, G, D) with K/V broadcast over the group (no copy)
    q5 = q.reshape(1, t_q, k.shape[1], g, d)
    k5, v5 = (t.unsqueeze(2).expand(-1, -1, g, -1).unsqueeze(0) for t in (k, v))
    bias = _bias(q, k, metadata, params.causal)
    out = memory_efficient_attention(
        q5, k5, v5, attn_bias=bias, p=params.dropout_p, scale=params.softmax_scale
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


register_backend(BackendSpec(
    name="xformers", fn=xformers_backend, probe=_probe, dropout=True, deterministic=False,
    traceable=False,  # a bias built from host lists: an opaque op under torch.compile
    description="xformers memory_efficient_attention, block-diagonal causal bias",
    requires="pip install xformers built for the installed torch; CUDA",
))  # fmt: skip
