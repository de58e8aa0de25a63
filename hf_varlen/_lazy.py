"""Public names resolved on first use (a PEP 562 module ``__getattr__``), shared by ``hf_varlen``
and ``hf_varlen.training``: importing every module up front would pull in torch, transformers or
accelerate, which ``hf-varlen --help`` and the packing helpers do not need."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(
    package: str,
    table: Mapping[str, str],
    namespace: dict[str, Any] | None = None,
    submodules: bool = False,
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table`` maps a public name to the submodule
    (relative to ``package``) that defines it. ``namespace``: the package's ``globals()`` to keep
    a resolved name in (later lookups skip this function), or None to look it up every time.
    ``submodules``: any other name that is a submodule is imported (``hf_varlen.ops``)."""

    def module_getattr(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(f".{table[name]}", package), name)
            if namespace is not None:
                namespace[name] = value
            return value
        if submodules and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return module_getattr
