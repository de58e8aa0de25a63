"""Host-side helpers shared by every layer of hf_varlen (torch only; no triton import).

They live in ``ops/`` because ``ops/`` must stay self-contained (it is copied into the kernel-hub
package), and everything above ``ops/`` may import from it; so each helper is defined once, here.

``env_flag(name)``: an environment switch (1/true/yes/on, case-insensitive).
``deterministic_requested(arg)``: the deterministic-backward request (argument,
    $FLASH_ATTENTION_DETERMINISTIC, or ``torch.use_deterministic_algorithms(True)``).
``check_int(name, value, minimum)``: an int argument check that names the argument.
``IGNORE_INDEX``: the label value the loss skips (-100, as in transformers and torch).
``TensorCache``: a small cache keyed on tensor identity + version (values derived once per batch).
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from numbers import Integral
from typing import Any

import torch

IGNORE_INDEX = -100

_TRUE = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str, default: bool = False) -> bool:
    """True when ``$name`` is 1/true/yes/on (any case); ``default`` when it is unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    return default if raw == "" else raw in _TRUE


def deterministic_requested(deterministic: bool | None = False) -> bool:
    """The argument, $FLASH_ATTENTION_DETERMINISTIC (env_flag), or torch's deterministic mode."""
    return (
        bool(deterministic)
        or env_flag("FLASH_ATTENTION_DETERMINISTIC")
        or torch.are_deterministic_algorithms_enabled()
    )


def check_int(name: str, value: Any, minimum: int | None = 1, *, allow_none: bool = False) -> Any:
    """Return ``int(value)``; raise naming ``name`` unless it is an int (not bool) >= ``minimum``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral):
        kind = "an int" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class TensorCache:
    """A few values derived from tensors, keyed on the tensors' identity and version counter.

    Every layer of one forward pass (and its backward) receives the *same* tensor objects
    (cu_seqlens, position_ids, the padding mask), so a value derived from them is computed once per
    batch, not once per layer. Contents are never hashed; an in-place edit of a key tensor bumps its
    version and misses. ``size`` entries are kept, least recently used dropped first. Under
    ``torch.compile`` tracing nothing is cached (identity means nothing to a traced graph).

        cache = TensorCache(size=4)
        value = cache.get_or_compute((cu_q, cu_k), lambda: build(cu_q, cu_k), extra=(left, right))
    """

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"TensorCache size must be >= 1, got {size}")
        self.size = size
        self._entries: OrderedDict[tuple, tuple[list, Any]] = OrderedDict()

    @staticmethod
    def _key(tensors: tuple[torch.Tensor, ...], extra: Hashable) -> tuple:
        return (tuple((id(t), t._version) for t in tensors), extra)

    def get(self, tensors: torch.Tensor | tuple[torch.Tensor, ...], extra: Hashable = None):
        """The cached value for these tensors (and ``extra``), or None."""
        tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        key = self._key(tensors, extra)
        hit = self._entries.get(key)
        if hit is None:
            return None
        refs, value = hit
        if any(r() is not t for r, t in zip(refs, tensors)):  # id reused by a new tensor
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, tensors: torch.Tensor | tuple[torch.Tensor, ...], value, extra: Hashable = None):
        """Store ``value`` for these tensors and return it (not stored if they cannot be weakly
        referenced, e.g. under tracing)."""
        tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        try:
            refs = [weakref.ref(t) for t in tensors]
        except TypeError:
            return value
        self._entries[self._key(tensors, extra)] = (refs, value)
        self._entries.move_to_end(self._key(tensors, extra))
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def get_or_compute(
        self,
        tensors: torch.Tensor | tuple[torch.Tensor, ...],
        compute: Callable[[], Any],
        extra: Hashable = None,
    ):
        """The cached value, else ``compute()`` stored for next time (never cached while tracing)."""
        if _tracing():
            return compute()
        hit = self.get(tensors, extra)
        if hit is None:
            hit = self.put(tensors, compute(), extra)
        return hit

    def clear(self) -> None:
        self._entries.clear()


def _tracing() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())
