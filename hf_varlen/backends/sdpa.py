"""`sdpa`: torch scaled_dot_product_attention run once per document.

The CPU path for users without a GPU: memory stays O(L^2) per document instead of the O(T^2) dense
block-diagonal mask transformers' own `sdpa` builds for packed input. Document bounds are read on
the host once per batch (cached across layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference.attention import visibility_mask
from ._common import host_bounds
from .registry import BackendSpec, register_backend


def sdpa_backend(
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
    bq = host_bounds(cu_seqlens_q)
    bk = bq if cu_seqlens_k is cu_seqlens_q else host_bounds(cu_seqlens_k)
    gqa = q.shape[1] != k.shape[1]
    windowed = window_size != (-1, -1)
    pieces = []
    for d in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[d], bq[d + 1], bk[d], bk[d + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            pieces.append(q.new_zeros(q1 - q0, q.shape[1], v.shape[-1]))
            continue
        qd = q[q0:q1].transpose(0, 1).unsqueeze(0)  # (1, H_q, L_q, D)
        kd = k[k0:k1].transpose(0, 1).unsqueeze(0)
        vd = v[k0:k1].transpose(0, 1).unsqueeze(0)
        mask, is_causal = None, False
        if windowed or (causal and q1 - q0 != k1 - k0):
            mask = visibility_mask(
                q1 - q0, k1 - k0, causal=causal, window_size=window_size, device=q.device
            )
        elif causal:
            is_causal = True
        o = F.scaled_dot_product_attention(
            qd,
            kd,
            vd,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=softmax_scale,
            enable_gqa=gqa,
        )
        if mask is not None:  # rows that see no key: SDPA gives NaN, FA semantics give 0
            o = o.masked_fill(~mask.any(-1)[None, None, :, None], 0.0)
        pieces.append(o[0].transpose(0, 1))
    if not pieces:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(pieces, dim=0)


register_backend(
    BackendSpec(
        name="sdpa",
        fn=sdpa_backend,
        description="torch SDPA once per document (host loop); the portable CPU path",
        requires="nothing (CPU or GPU)",
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        sliding_window=True,
        softcap=False,
        dropout=True,
    )
)
