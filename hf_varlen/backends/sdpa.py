"""`sdpa`: torch scaled_dot_product_attention run once per document.

The CPU path for users without a GPU: memory stays O(L^2) per document instead of the O(T^2) dense
block-diagonal mask transformers' own `sdpa` builds for packed input. Document bounds are read on
the host once per batch (cached across layers), so they are always fully checked. Whole rows
(``VarlenMetadata.rows``: offsets built from the shapes, nothing packed) need no read: they go to
SDPA as one batch; "auto" picks this backend for them on CUDA (backends/__init__.py says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import host_offsets_qk
from .registry import BackendSpec, register_backend


def sdpa_backend(q, k, v, metadata, params):
    gqa = q.shape[1] != k.shape[1]
    scale = params.softmax_scale
    if scale == 0.0:  # torch's CPU flash kernel gives NaN for scale=0; all scores are 0 either way
        q, scale = q * 0.0, 1.0
    rows = _whole_rows(q, k, metadata)
    if rows is not None:
        # Whole rows of one length each (from the shapes: nothing read back): one batched call.
        n, len_q, len_k = rows
        qd, kd, vd = (t.unflatten(0, (n, -1)).transpose(1, 2) for t in (q, k, v))
        o = _attend(qd, kd, vd, params, scale, gqa)  # (n, H_q, L_q, D_v)
        return o.transpose(1, 2).reshape(n * len_q, q.shape[1], v.shape[-1])
    bq, bk = host_offsets_qk(q, k, metadata)
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
        pieces.append(_attend(qd, kd, vd, params, scale, gqa)[0].transpose(0, 1))
    if not pieces:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(pieces, dim=0)


def _whole_rows(q, k, metadata) -> tuple[int, int, int] | None:
    """(rows, L_q, L_k) when ``metadata`` describes whole rows (``VarlenMetadata.rows``) of
    ``max_seqlen_q/k`` tokens that tile q and k exactly and are not empty, else None."""
    if not metadata.rows:
        return None
    n = metadata.cu_seqlens_q.shape[0] - 1
    len_q, len_k = metadata.max_seqlen_q, metadata.max_seqlen_k
    if n < 1 or len_q < 1 or len_k < 1 or n * len_q != q.shape[0] or n * len_k != k.shape[0]:
        return None
    return n, len_q, len_k


def _attend(qd, kd, vd, params, scale, gqa):
    """Documents of one length each, batched: qd (B, H_q, L_q, D), kd / vd (B, H_kv, L_k, D /
    D_v) -> (B, H_q, L_q, D_v), every document attending within itself by ``params``."""
    if params.sinks is not None:
        return _with_sinks(qd, kd, vd, params, scale)
    len_q, len_k = qd.shape[2], kd.shape[2]
    mask, is_causal = None, False
    if params.sliding_window or (params.causal and len_q != len_k):
        mask = _visible(len_q, len_k, params.window, qd.device)
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
        return o.masked_fill(~mask.any(-1)[None, None, :, None], 0.0)
    # torch's fused CPU kernel turns a NaN query row into a finite output row (its gradients stay
    # NaN). Adding 0 * q keeps a non-finite query visible, and adds an exact 0 (no change)
    # everywhere else (docs/attention-numerics.md).
    return o + qd.mul(0.0).sum(-1, keepdim=True).to(o.dtype)


def _visible(len_q: int, len_k: int, window: tuple[int, int], device) -> torch.Tensor:
    """(len_q, len_k) bool: query i sees key j. FA-2 rules, bottom-right aligned (query i sits at
    key position i + len_k - len_q); ``window`` (left, right) has causality folded in (-1 =
    unbounded). Written here, not taken from the test oracle, so the oracle stays independent."""
    key = torch.arange(len_k, device=device)[None, :]
    query_at = torch.arange(len_q, device=device)[:, None] + (len_k - len_q)
    unbounded = len_q + len_k  # farther than any key is from any query
    left, right = (unbounded if w < 0 else w for w in window)
    return (key >= query_at - left) & (key <= query_at + right)


def _with_sinks(qd, kd, vd, params, scale):
    """Documents of one length with attention sinks, exactly, through SDPA: one more key per head,
    first, whose score is the sink logit and whose value is 0. SDPA has no per-head score bias,
    so the head dim grows by one: q gets a 1 there, real keys a 0, the sink key sinks[h] /
    scale, so q . k_sink * scale = sinks[h] and the real scores are unchanged; the sinks'
    gradient comes through that entry. The sink key is visible to every row (a row that sees no
    real key gets the zero value: zeros, as FA gives). GQA heads are expanded (one sink key per
    query head).

    qd (B, H_q, L_q, D), kd / vd (B, H_kv, L_k, D / D_v) -> (B, H_q, L_q, D_v)."""
    b, h_q, l_q, l_k = qd.shape[0], qd.shape[1], qd.shape[2], kd.shape[2]
    group = h_q // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
    sink = (params.sinks.to(qd.dtype) / scale)[None, :, None, None]  # (1, H_q, 1, 1)
    q1 = torch.cat([qd, qd.new_ones(b, h_q, l_q, 1)], dim=-1)
    k_real = torch.cat([kd, kd.new_zeros(b, h_q, l_k, 1)], dim=-1)
    k_sink = torch.cat([kd.new_zeros(1, h_q, 1, kd.shape[-1]), sink], dim=-1).expand(b, -1, -1, -1)
    k1 = torch.cat([k_sink, k_real], dim=2)
    v1 = torch.cat([vd.new_zeros(b, h_q, 1, vd.shape[-1]), vd], dim=2)
    visible = _visible(l_q, l_k, params.window, qd.device)
    mask = torch.cat([visible.new_ones(l_q, 1), visible], dim=1)
    return F.scaled_dot_product_attention(
        q1, k1, v1, attn_mask=mask, dropout_p=params.dropout_p, scale=scale
    )


register_backend(BackendSpec(
    name="sdpa", fn=sdpa_backend, description="torch SDPA once per document (host loop); the "
    "portable CPU path", requires="nothing (CPU or GPU)", devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    sliding_window=True, dropout=True, sinks=True,  # no softcap: SDPA has no score hook
    traceable=False,  # host offsets: an opaque op under torch.compile
))  # fmt: skip
