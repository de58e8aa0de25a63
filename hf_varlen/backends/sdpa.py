"""`sdpa`: torch scaled_dot_product_attention run once per document.

The CPU path for users without a GPU: memory stays O(L^2) per document instead of the O(T^2) dense
block-diagonal mask transformers' own `sdpa` builds for packed input. Document bounds are read on
the host once per batch (cached across layers), so they are always fully checked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference.attention import visibility_mask
from ._common import host_offsets_qk
from .registry import BackendSpec, register_backend


def sdpa_backend(q, k, v, metadata, params):
    bq, bk = host_offsets_qk(q, k, metadata)
    gqa = q.shape[1] != k.shape[1]
    scale = params.softmax_scale
    if scale == 0.0:  # torch's CPU flash kernel gives NaN for scale=0; all scores are 0 either way
        q, scale = q * 0.0, 1.0
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
        if params.sliding_window or (params.causal and q1 - q0 != k1 - k0):
            mask = visibility_mask(
                q1 - q0, k1 - k0, causal=params.causal, window_size=params.window, device=q.device
            )
        elif params.causal:
            is_causal = True
        o = F.scaled_dot_product_attention(
            qd,
            kd,
            vd,
            attn_mask=mask,
            dropout_p=params.dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=gqa,
        )
        if mask is not None:  # rows that see no key: SDPA gives NaN, FA semantics give 0
            o = o.masked_fill(~mask.any(-1)[None, None, :, None], 0.0)
        else:
            # torch's fused CPU kernel turns a NaN query row into a finite output row (its
            # gradients stay NaN). Adding 0 * q keeps a non-finite query visible, and adds an
            # exact 0 (no change) everywhere else (docs/attention-numerics.md).
            o = o + qd.mul(0.0).sum(-1, keepdim=True).to(o.dtype)
        pieces.append(o[0].transpose(0, 1))
    if not pieces:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(pieces, dim=0)


register_backend(BackendSpec(
    name="sdpa", fn=sdpa_backend, description="torch SDPA once per document (host loop); the "
    "portable CPU path", requires="nothing (CPU or GPU)", devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    sliding_window=True, dropout=True,  # no softcap: SDPA has no score hook
    traceable=False,  # host offsets: an opaque op under torch.compile
))  # fmt: skip
