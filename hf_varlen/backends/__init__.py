"""Varlen attention backends. Importing this package registers every adapter.

"auto" order on CUDA (first available backend that supports the call wins), from our H200
measurements of forward+backward (docs/BENCHMARKS.md, run K): our ``triton`` kernel leads on packs
of short documents (FA4 takes 2.0x our time on real alpaca 64K and 1.5x on alpaca 64K with one 4K
document; torch 2.3x), so it comes first. For packs of long documents (registry.long_documents: a
mean length of >= 448 tokens, or a longest document whose work outweighs the rest's) FA4 is tried
first: it is faster there (we take 1.08x its time on real lima 64K, 1.6x on 8 x 8K, 1 x 32K + 32K
alpaca and one 128K document). Then FA2, torch's bundled FA2 (always present; slower than ours on
every pack of run K), flex (pays a mask build per batch), xformers, SDPA. On CPU the per-document
SDPA loop is the fastest exact path (flex runs an unfused dense path there; the triton backend
needs a GPU).
"""

from __future__ import annotations

from . import fa4, flash_attn, flex, reference, sdpa, torch_varlen, triton, xformers  # noqa: F401
from .params import AttentionParams, VarlenMetadata
from .registry import (
    MODEL_BACKEND_ATTR,
    BackendSpec,
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
    long_documents_first=["fa4"],
)
set_auto_order("cpu", ["sdpa", "reference"])

__all__ = [
    "MODEL_BACKEND_ATTR",
    "AttentionParams",
    "BackendSpec",
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
