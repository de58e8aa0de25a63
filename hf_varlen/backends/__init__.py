"""Varlen attention backends. Importing this package registers every adapter.

"auto" order on CUDA (first available backend that supports the call wins), from our H200
measurements of forward+backward on packs of real alpaca and lima lengths (docs/BENCHMARKS.md):
our ``triton`` kernel leads on packed SFT data (2.2x FA4 on real alpaca 16K, 1.6-2.4x torch's FA2
on alpaca/lima 64K), so it comes first. When a call holds a document of >= LONG_DOCUMENT_TOKENS
(8192) tokens, FA4 is tried first: on a 32K document it is faster than ours, long-document path
included (1 x 32K + 32K alpaca f+b: FA4 53 ms in ANCHORS.md, ours 83 ms, BENCHMARKS.md run G; the
crossover between 3K, where ours still wins on real lima, and 32K was not measured). Then FA2, torch's bundled FA2 (always present), flex (pays a mask
build per batch), xformers, SDPA. On CPU the per-document SDPA loop is the fastest exact path (flex
runs an unfused dense path there; the triton backend needs a GPU).
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
