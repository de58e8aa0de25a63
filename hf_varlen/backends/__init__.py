"""Varlen attention backends. Importing this package registers every adapter.

"auto" order (first available backend that supports the call wins), from our H200 measurements of
forward+backward on packs of real alpaca and lima lengths (docs/BENCHMARKS.md, ANCHORS.md):
FA4 leads on long documents and ties flex on short ones; flex pays a per-batch mask build; torch's
bundled FA2 is the always-present CUDA fallback. On CPU the per-document SDPA loop is the fastest
exact path (flex runs an unfused dense path there).
"""

from __future__ import annotations

import importlib
import importlib.util

from . import fa4, flash_attn, flex, reference, sdpa, torch_varlen, xformers  # noqa: F401
from .registry import (
    BackendSpec,
    Request,
    auto_order,
    available_backends,
    default_backend,
    get_spec,
    register_backend,
    resolve,
    set_auto_order,
    set_backend,
    unavailable_reason,
)

set_auto_order("cuda", ["fa4", "flash_attn", "torch", "flex", "xformers", "sdpa", "reference"])
set_auto_order("cpu", ["sdpa", "reference"])

if importlib.util.find_spec(__name__ + ".triton") is not None:  # our own Triton kernel (issue 5)
    importlib.import_module(__name__ + ".triton")

__all__ = [
    "BackendSpec",
    "Request",
    "auto_order",
    "available_backends",
    "default_backend",
    "get_spec",
    "register_backend",
    "resolve",
    "set_auto_order",
    "set_backend",
    "unavailable_reason",
]
