"""Pure-PyTorch varlen attention: the oracle every backend is tested against.

Shapes: q (T_q, H_q, D), k/v (T_k, H_kv, D), cu_seqlens_q/k (n + 1,) int32 with document i at
rows cu[i]:cu[i+1]. Output (T_q, H_q, D_v). Semantics are FlashAttention-2's:

    s = softmax_scale * q_i . k_j                 (softmax_scale defaults to D ** -0.5)
    s = softcap * tanh(s / softcap)               (if softcap > 0)
    query i of a document of lengths (L_q, L_k) may see key j when, with shift = L_k - L_q
    (bottom-right alignment), j <= i + shift (causal) and, for a window (left, right),
    i + shift - left <= j <= i + shift + right (-1 = unbounded on that side)
    o_i = sum_j softmax(s)_ij v_j                 (softmax in at least fp32, as HF eager does)

With attention sinks (``sinks``: (H_q,) one learned logit per query head, gpt-oss style), the
softmax denominator gets one more term exp(sinks[h]) that carries no value:
o_i = sum_j exp(s_ij) v_j / (exp(sinks[h]) + sum_j exp(s_ij)).

Queries that see no key produce zeros. Non-finite input is not cleaned up (docs/attention-numerics.md):
the arithmetic is IEEE inside each document, so a NaN stays a NaN, and it never reaches another
document (each one is computed alone). The computation runs per document in the input dtype (the
"low precision reference"; fp16/bf16 softmax in fp32); pass fp32/fp64 inputs for the
high-precision one (fp64 in, fp64 math throughout). Offsets are checked (they are on the host):
malformed cu_seqlens raise ValueError.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.common import attention_scale, attention_softcap, causal_window, check_offsets


def visibility_mask(
    len_q: int, len_k: int, *, causal: bool, window_size: tuple[int, int], device=None
) -> torch.Tensor:
    """(len_q, len_k) bool: True where query i may attend to key j (FA-2 rules, see module doc)."""
    left, right = causal_window(causal, window_size)
    i = torch.arange(len_q, device=device)[:, None] + (len_k - len_q)
    j = torch.arange(len_k, device=device)[None, :]
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= i + right
    if left >= 0:
        mask &= j >= i - left
    return mask


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-document attention in plain PyTorch (autograd-capable). See the module docstring.

    ``sinks``: (H_q,) per-head sink logits (any float dtype; differentiable), or None."""
    h_q, h_kv = q.shape[1], k.shape[1]
    group = h_q // h_kv
    scale = attention_scale(softmax_scale, q.shape[-1])  # one policy for every backend
    softcap = attention_softcap(softcap)
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    check_offsets("cu_seqlens_q", bounds_q, q.shape[0])
    check_offsets("cu_seqlens_k", bounds_k, k.shape[0])
    if len(bounds_q) != len(bounds_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
            f"{len(bounds_q) - 1} and {len(bounds_k) - 1}"
        )
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape[0], h_q, v.shape[-1])
    pieces = []
    for (q0, q1), (k0, k1) in zip(
        zip(bounds_q[:-1], bounds_q[1:]), zip(bounds_k[:-1], bounds_k[1:])
    ):
        if q1 == q0:
            continue
        if k1 == k0:
            pieces.append((q0, q1, q.new_zeros(q1 - q0, h_q, v.shape[-1])))
            continue
        qd = q[q0:q1].transpose(0, 1)  # (H_q, L_q, D)
        kd = k[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)  # (H_q, L_k, D)
        vd = v[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)
        s = torch.matmul(qd, kd.transpose(1, 2)) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        mask = visibility_mask(
            q1 - q0, k1 - k0, causal=causal, window_size=window_size, device=q.device
        )
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column per head: the sink's logit, dropped after softmax
            sink = sinks.to(s.dtype)[:, None, None].expand(h_q, q1 - q0, 1)
            s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1, dtype=softmax_dtype)
        if sinks is not None:
            p = p[..., :-1]
        # Rows that see no key -> zeros, like FA. Only those: a NaN that comes from the input
        # stays a NaN (a blanket nan_to_num would turn a poisoned row into a finite one).
        p = p.masked_fill(~mask.any(-1)[None, :, None], 0.0)
        p = p.to(q.dtype)
        if dropout_p > 0:
            p = F.dropout(p, p=dropout_p, training=True)
        pieces.append((q0, q1, torch.matmul(p, vd).transpose(0, 1)))
    if not pieces:
        return out
    # Assemble without in-place writes into a tensor autograd must track piecewise.
    rows = [out[: pieces[0][0]]]
    for idx, (_, q1, o) in enumerate(pieces):
        rows.append(o)
        nxt = pieces[idx + 1][0] if idx + 1 < len(pieces) else out.shape[0]
        rows.append(out[q1:nxt])
    return torch.cat(rows, dim=0)
