"""Varlen attention backends. Importing this package registers every adapter.

"auto" order on CUDA (first available backend that supports the call wins), from our H200
measurements of forward+backward (docs/BENCHMARKS.md): our ``triton`` kernel
leads on packs of short documents (FA4 takes 2.0x our time on real alpaca 64K and 1.5x on alpaca
64K with one 4K document; torch 2.3x), so it comes first. Packs of long documents go to another
backend first where it is faster (``registry.LongDocumentsRule``, evaluated on the shapes and
max_seqlen):

- FA4, at every head dim, for a mean length of >= 448 tokens or a longest document whose work
  outweighs the rest's (we take 1.09x its time on real lima 64K, 1.5-1.7x on 8 x 8K, 1 x 32K +
  32K alpaca and one 128K document at 32/8/128; 1.4-1.8x at head dim 64);
- torch's ``varlen_attn`` at head dim > 128 by FA4's thresholds (16/8/256, no long path of ours:
  we take 1.14x its time on lima 64K, 1.34x on 32K + 32K, 1.64x on 8 x 8K; it takes 1.06x ours
  on 64K of 256-token documents and 1.53x on alpaca 64K with one 8K document).

At head dims <= 128 our kernel is ahead of torch on every measured pack but one: 16/16/64 on
8 x 8K, where torch takes 0.96x our time (the rules do not see head counts, and 32/8/64
there takes torch 1.11x ours). Head dim 64's long path had lost to torch from 2048-token
documents until its launches stopped being persistent (1.5x faster on 8 x 8K, 32K + 32K
and 128K), so the torch rule it had is gone.

Calls of whole rows (no documents packed, no padding: ``VarlenMetadata.rows``) go to SDPA before all
of these, as one batched call that reads nothing back. Whole rows are plain dense attention, SDPA's
own case: on the H100 it took 0.32-0.89x our kernel's time on every measured call (1 and 4 rows of
64-8192 tokens, head dim 80 not causal and 128 causal, forward + backward by wall clock). The short
ones matter most: the vision encoders of Qwen2-VL, Qwen2.5-VL, Qwen3.5, GLM-4V and others call
attention once per window or image in every layer under a name without "flash", hundreds of calls of
a few dozen tokens each per forward, where our kernel's fixed host work per call (six launches
forward and backward, a tile plan per new row length) costs more than the attention. A deterministic
backward keeps them on our kernel. FA4's and torch's long-documents rules were measured against our
kernel only, not against SDPA. Under torch.compile a call is not marked as rows (the traced graph
keeps the order's traceable first choice). Measured by scripts/bench_whole_rows.py
(docs/BENCHMARKS.md, Attention).

Then FA2, torch's bundled FA2 (always present), flex (pays a mask build per batch), xformers,
SDPA. FA2 from ``flash-attn`` is not installed on our H200 and so has no long-documents rule. On
CPU the per-document SDPA loop is the fastest exact path (flex runs an unfused dense path there;
the triton backend needs a GPU).
"""

from __future__ import annotations

from ..metadata import VarlenMetadata  # re-exported (defined in hf_varlen.metadata)
from . import fa4, flash_attn, flex, reference, sdpa, torch_varlen, triton, xformers  # noqa: F401
from .params import AttentionParams
from .registry import (
    MODEL_BACKEND_ATTR,
    BackendSpec,
    LongDocumentsRule,
    Request,
    auto_order,
    available_backends,
    default_backend,
    get_spec,
    model_backend,
    register_backend,
    resolve,
    set_auto_order,
    set_backend,
    unavailable_reason,
)

set_auto_order(
    "cuda",
    ["triton", "fa4", "flash_attn", "torch", "flex", "xformers", "sdpa", "reference"],
    long_documents_first=[
        "fa4",
        LongDocumentsRule("torch", min_head_dim=129),
    ],
    rows_first=["sdpa"],
)
set_auto_order("cpu", ["sdpa", "reference"])

__all__ = [
    "MODEL_BACKEND_ATTR",
    "AttentionParams",
    "BackendSpec",
    "LongDocumentsRule",
    "Request",
    "VarlenMetadata",
    "auto_order",
    "available_backends",
    "default_backend",
    "get_spec",
    "model_backend",
    "register_backend",
    "resolve",
    "set_auto_order",
    "set_backend",
    "unavailable_reason",
]
