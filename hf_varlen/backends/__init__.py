"""Varlen attention backends. Importing this package registers every adapter.

"auto" order on CUDA (first available backend that supports the call wins), from our H200
measurements of forward+backward (docs/BENCHMARKS.md, runs K and L): our ``triton`` kernel leads on
packs of short documents (FA4 takes 2.0x our time on real alpaca 64K and 1.5x on alpaca 64K with
one 4K document; torch 2.3x), so it comes first. Packs of long documents go to another backend
first where it is faster (``registry.LongDocumentsRule``, evaluated on the shapes and max_seqlen):

- FA4, at every head dim, for a mean length of >= 448 tokens or a longest document whose work
  outweighs the rest's (we take 1.08x its time on real lima 64K, 1.6x on 8 x 8K, 1 x 32K + 32K
  alpaca and one 128K document at 32/8/128; 2.3-2.6x at head dim 64 on 8 x 8K and 32K + 32K);
- torch's ``varlen_attn`` at head dim <= 64 for a mean length of >= 1536 tokens (32/8/64: we take
  1.17x its time on 64K of 2048-token documents, 1.38x on 8 x 8K, 1.41x on 128K; it takes 1.30x
  ours on 64K of 1024-token documents, 1.08x on 32K + alpaca 32K), and at head dim > 128 by FA4's
  thresholds (16/8/256: we take 1.15x its time on lima 64K, 1.35x on 32K + 32K, 1.66x on 8 x 8K;
  it takes 1.06x ours on 64K of 256-token documents and 1.53x on alpaca 64K with one 8K document).
  At head dims 65-128 our long-document path is ahead of torch on every measured pack.

Then FA2, torch's bundled FA2 (always present), flex (pays a mask build per batch), xformers,
SDPA. FA2 from ``flash-attn`` is not installed on our H200 and so has no long-documents rule. On
CPU the per-document SDPA loop is the fastest exact path (flex runs an unfused dense path there;
the triton backend needs a GPU).
"""

from __future__ import annotations

from . import fa4, flash_attn, flex, reference, sdpa, torch_varlen, triton, xformers  # noqa: F401
from .params import AttentionParams, VarlenMetadata
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
        LongDocumentsRule("torch", mean_tokens=1536, work_ratio=None, max_head_dim=64),
        LongDocumentsRule("torch", min_head_dim=129),
    ],
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
