"""Module-level ``__getattr__`` factories (no torch, no triton import).

``lazy_exports(package, exports)``: names resolved from submodules on first access (PEP 562), so
a package imports without triton until an op that needs it is used.
``moved_module(old, new)``: the body of a deprecated deep path (``hf_varlen.ops.attention_fwd``
before the per-op packages): warns once at import, then forwards every attribute to ``new``.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def lazy_exports(package: str, exports: dict[str, str]):
    """``__getattr__`` for ``package``: ``exports`` maps a name to the submodule (relative to
    ``package``) that defines it; a resolved name is stored on the package, so it resolves once."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:  # AttributeError lets `from package import submodule` import it
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def moved_module(old: str, new: str):
    """``__getattr__`` for the deprecated module ``old``, forwarding to the module ``new``
    (imported now, as ``old`` was). Deprecated paths are kept for one release."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; import {new} instead",
        DeprecationWarning,
        stacklevel=2,
    )
    target = importlib.import_module(new)

    def __getattr__(name: str):
        return getattr(target, name)

    return __getattr__
