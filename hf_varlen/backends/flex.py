"""`flex`: FlexAttention with a document BlockMask.

The BlockMask is built once per batch and cached on the identity of the cu_seqlens tensors, so
every layer of a forward pass shares it. Its block tables and the per-token document ids its
``mask_mod`` reads come from ``cu_seqlens`` alone, in one opaque op that torch.compile never
traces (``flex_blocks``); the ``mask_mod`` decides inside the partial blocks. On CUDA the
attention call is compiled (FlexAttention's fast path); on CPU it runs eagerly.

Layout: flex wants (1, H, T, D); the packed (T, H, D) inputs are viewed as such without copies.
"""

from __future__ import annotations

import torch

from ..ops.common import TensorCache, causal_window, tracing
from .flex_blocks import document_tables
from .registry import BackendSpec, register_backend

_MASKS = TensorCache(size=2)  # a model with sliding and full layers uses two masks per batch
_BLOCK = 128
_COMPILED = {}


def _flex_attention(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if "attn" not in _COMPILED:
        # dynamic=None: the first pack compiles static, later pack sizes reuse one dynamic graph
        _COMPILED["attn"] = torch.compile(flex_attention, dynamic=None)
    return _COMPILED["attn"]


def document_block_mask(cu_q, cu_k, total_q, total_k, *, causal, window_size):
    """BlockMask allowing (q, kv) pairs inside one document, under the FA visibility rules."""
    left, right = causal_window(causal, window_size)

    def build():
        from torch.nn.attention.flex_attention import BlockMask

        doc_q, pos_q, doc_k, pos_k, shift, *tables = document_tables(
            cu_q, cu_k, total_q, total_k, left, right, _BLOCK
        )
        # The window reaches the mask as device tensors, not ints: under the compiled flex call an
        # int captured by mask_mod turns symbolic once a second window value is seen (automatic
        # dynamic), and Inductor cannot lower a symbolic int inside a mask (torch 2.11 / 2.13).
        bounded_right, bounded_left = right >= 0, left >= 0
        hi = torch.full((), max(right, 0), dtype=torch.int32, device=cu_q.device)
        lo = torch.full((), -max(left, 0), dtype=torch.int32, device=cu_q.device)

        def mask_mod(b, h, qi, ki):
            same = doc_q[qi] == doc_k[ki]
            rel = pos_k[ki] - (pos_q[qi] + shift[doc_q[qi]])  # key position relative to diagonal
            ok = same
            if bounded_right:
                ok = ok & (rel <= hi)
            if bounded_left:
                ok = ok & (rel >= lo)
            return ok

        names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
        names += tuple(n.replace("kv", "q") for n in names)
        return BlockMask(
            seq_lengths=(total_q, total_k),
            **{name: t[None, None] for name, t in zip(names, tables, strict=True)},
            BLOCK_SIZE=(_BLOCK, _BLOCK),
            mask_mod=mask_mod,
        )

    return _MASKS.get_or_compute((cu_q, cu_k), build, extra=(total_q, total_k, left, right))


def _non_finite_rows(q, k, v, metadata, params) -> torch.Tensor:
    """(T_q, H_q) bool: query rows that are non-finite or see a non-finite key/value row.

    Each row sees one contiguous key interval [lo, hi] (ops/attention/schedule.py: row_bounds, the
    triton plan's rule), so "sees a bad row" is a difference of two prefix counts: O(T * H) work
    on the device, no sync.
    """
    from ..ops.attention.schedule import row_bounds

    group = q.shape[1] // k.shape[1]
    bad_q = ~torch.isfinite(q).all(-1)
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (T_k, H_kv)
    counts = torch.nn.functional.pad(bad_kv.int().cumsum(0), (0, 0, 1, 0))  # (T_k + 1, H_kv)
    lo, hi, _, _ = row_bounds(
        metadata.cu_seqlens_q, metadata.cu_seqlens_k, q.shape[0], k.shape[0], *params.window
    )
    seen = lo <= hi
    first = torch.where(seen, lo, 0).long()
    last = torch.where(seen, hi + 1, 0).long()
    sees_bad = ((counts[last] - counts[first]) > 0) & seen[:, None]  # (T_q, H_kv)
    return bad_q | sees_bad.repeat_interleave(group, dim=1)


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def flex_backend(q, k, v, metadata, params):
    """FlexAttention over cleaned inputs, plus the NaN of the rows that saw a non-finite value.

    FlexAttention multiplies masked-off probabilities (0) with other documents' V rows, and its
    backward multiplies masked dS with their Q / K rows and exp(s - lse) with a NaN lse: one
    non-finite value would reach every document of the pack. So the kernel gets q, k, v with
    non-finite entries zeroed, and the rows that see one (``_non_finite_rows``) get
    ``NaN * q[..., :1]`` added: NaN in the output, NaN in those rows' dq, an exact 0 everywhere
    else (docs/attention-numerics.md).
    """
    poison = torch.where(_non_finite_rows(q, k, v, metadata, params), float("nan"), 0.0)
    q_clean = _finite(q)
    out = _flex_call(q_clean, _finite(k), _finite(v), metadata, params)
    return out + (poison.to(q.dtype)[..., None] * q_clean[..., :1]).to(out.dtype)


def _flex_call(q, k, v, metadata, params):
    attn = _flex_attention(q.device.type)
    t_q = q.shape[0]
    # Pad the token axis to a multiple of the 128-token block: FlexAttention's compiled kernels have
    # no valid config for some short sequences (torch 2.11: NoValidChoicesError at T=116), and
    # fewer distinct shapes also means fewer recompiles. Pad tokens form their own document.
    pad_q, pad_k = -t_q % _BLOCK, -k.shape[0] % _BLOCK
    traced = tracing()
    if traced:
        # Traced: always 1-128 pad tokens. Whether a pad is 0 would be a guard (an aligned pack
        # compiled a graph of its own: AOT autograd guarded on the padded size != T, H200);
        # 128 - T % 128 is provably nonzero. An aligned pack pays one extra block.
        pad_q, pad_k = _BLOCK - t_q % _BLOCK, _BLOCK - k.shape[0] % _BLOCK
    if traced or pad_q or pad_k:
        q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad_q))
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad_k))
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad_k))
    mask = document_block_mask(
        metadata.cu_seqlens_q,
        metadata.cu_seqlens_k,
        q.shape[0],
        k.shape[0],
        causal=params.causal,
        window_size=params.window,
    )
    score_mod = None
    softcap = params.softcap
    if softcap > 0:

        def score_mod(score, b, h, qi, ki):
            return softcap * torch.tanh(score / softcap)

    sinks = params.sinks
    extra = {}
    if sinks is not None:
        from torch.nn.attention.flex_attention import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    out = attn(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        score_mod=score_mod,
        block_mask=mask,
        scale=params.softmax_scale,
        enable_gqa=q.shape[1] != k.shape[1],
        **extra,
    )
    if sinks is None:
        return out[0, :, :t_q].transpose(0, 1)
    # Sinks from the log-sum-exp (differentiable in FlexAttention): exp(s_h) more in each row's
    # denominator, no value: o' = o * sigmoid(lse - s), as ops/attention.apply_sinks does.
    out, aux = out
    lse = aux.lse[0, :, :t_q].float()  # (H_q, T_q), natural log; -inf where a row sees nothing
    scale = torch.sigmoid(lse - sinks.float()[:, None]).t()[:, :, None]
    return (out[0, :, :t_q].transpose(0, 1).float() * scale).to(out.dtype)


def _probe() -> str | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no FlexAttention ({exc})"
    return None


register_backend(BackendSpec(
    name="flex", fn=flex_backend, probe=_probe,
    description="FlexAttention with a document BlockMask shared by all layers (compiled on CUDA)",
    requires="torch >= 2.5 (CUDA for speed; CPU runs the unfused path)",
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    backward_devices=frozenset({"cuda"}),  # torch's FlexAttention has no CPU backward
    sliding_window=True, softcap=True, sinks=True,
    min_head_dim={"cuda": 16},  # Inductor's flex kernels: "embedding dimension ... at least 16"
))  # fmt: skip
