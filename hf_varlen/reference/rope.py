"""Pure-PyTorch oracle for rotary position embeddings (RoPE) on q and k.

Math (per token at position p, per head, on the first ``R = rotary_dim`` features of ``x``)::

    out = x * cos[p] + rotate(x) * sin[p]            (features R..D-1 pass through unchanged)

    half layout (HF ``rotate_half``):  rotate([x1, x2]) = [-x2, x1]   x1 = x[:R/2], x2 = x[R/2:R]
    interleaved layout (GPT-J style): (rotate(x)[2i], rotate(x)[2i+1]) = (-x[2i+1], x[2i])

The arithmetic follows ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``:
``(x * cos) + (rotate(x) * sin)`` evaluated with torch's type promotion, so running it on bf16
inputs reproduces HF's bf16 rounding (each product rounded, then the sum) and running it on
fp64 copies gives the high-precision reference.

Positions come from one of:
- already-gathered cos/sin of shape (B, T, R), (1, T, R) or (T, R) (HF's rotary module output);
- a table (P, R) indexed by ``position_ids`` (B, T) or (1, T);
- a table (P, R) indexed by positions that restart at 0 at every packed document, derived from
  ``cu_seqlens`` (N + 1,) over the B * T tokens flattened batch-major.

Shape legend: B batch, T tokens per row, Hq / Hkv query / key heads, D head dim, R rotary dim,
P table rows, N documents. q is (B, Hq, T, D) (HF layout) or (T, Hq, D) (packed); k likewise.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF ``rotate_half``: [x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]) over the last dim."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token inside its document: ``t - cu_seqlens[doc(t)]``, shape (total,)."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    # doc(t) = last i < N with cu[i] <= t; empty documents are skipped naturally.
    doc = torch.searchsorted(cu[1:-1], t, right=True)
    return t - cu[doc]


def gather_cos_sin(
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch: int,
    seqlen: int,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return per-token cos/sin of shape (B, T, R) from any of the accepted forms."""
    if position_ids is None and cu_seqlens is None:
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        return cos.expand(batch, seqlen, -1), sin.expand(batch, seqlen, -1)
    if cu_seqlens is not None:
        pos = positions_from_cu_seqlens(cu_seqlens, batch * seqlen).view(batch, seqlen)
    else:
        pos = position_ids.to(torch.int64).expand(batch, seqlen)
    return cos[pos], sin[pos]


def apply_rotary_qk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    interleaved: bool = False,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place RoPE on q and k (autograd-capable); same arguments as ``apply_rotary_qk``."""
    packed = q.dim() == 3
    if packed:  # (T, H, D) -> (1, H, T, D)
        q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    batch, _, seqlen, _ = q.shape
    rotary_dim = cos.shape[-1] if rotary_dim is None else rotary_dim
    cos_t, sin_t = gather_cos_sin(
        cos, sin, batch, seqlen, position_ids=position_ids, cu_seqlens=cu_seqlens
    )
    cos_t, sin_t = cos_t[:, None], sin_t[:, None]  # broadcast over heads
    rotate = rotate_interleaved if interleaved else rotate_half

    def one(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        out = (x_rot * cos_t) + (rotate(x_rot) * sin_t)
        return torch.cat((out, x_pass.to(out.dtype)), dim=-1) if x_pass.shape[-1] else out

    q_out, k_out = one(q), one(k)
    if packed:
        q_out, k_out = q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)
    return q_out, k_out
