"""Host-side helpers shared by every layer of hf_varlen (torch only; no triton import).

They live in ``ops/`` because ``ops/`` must stay self-contained (it is copied into the kernel-hub
package), and everything above ``ops/`` may import from it; so each helper is defined once, here.

``env_flag(name)``: an environment switch (1/true/yes/on, case-insensitive).
``deterministic_requested(arg)``: the deterministic-backward request (argument,
    $FLASH_ATTENTION_DETERMINISTIC, or ``torch.use_deterministic_algorithms(True)``).
``check_int(name, value, minimum)``: an int argument check that names the argument.
``IGNORE_INDEX``: the label value the loss skips (-100, as in transformers and torch).
``causal_window(causal, window_size)``: the FA (left, right) window with causality folded in.
``offsets_violation(first, last, smallest_step, longest, total, max_len)``: the one offsets rule
    (start 0, non-decreasing, end at T, no document past the max length), on summary numbers.
``check_offsets(name, offsets, total, max_len)``: the full cu_seqlens check on a host list.
``max_length_int(name, value, host_read)``: the one conversion of a max document length to an int.
``tracing(t)``: whether torch.compile traces (or ``t`` is a fake tensor): nothing may be read back.
``attention_scale(value, head_dim)`` / ``attention_softcap(value)``: the one policy for
    softmax_scale and softcap on every attention backend (docs/attention-numerics.md).
``check_sinks(sinks, q)``: the attention-sink logits argument checked (None or (H_q,) float).
``clamp_offsets(cu, total)``: cu_seqlens made memory-safe on the device (no sync).
``TensorCache``: a small cache keyed on tensor identity + version (values derived once per batch).
"""

from __future__ import annotations

import math
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


def causal_window(causal: bool, window_size) -> tuple[int, int]:
    """FA-2 (left, right) window with causality folded in: causal means right = 0.

    -1 = unbounded on that side, so (-1, -1) is full attention and (-1, 0) is plain causal. Under
    causal masking every key right of the diagonal is hidden, whatever ``right`` says.
    """
    left, right = (int(w) for w in window_size)
    return (left, 0) if causal else (left, right)


def attention_scale(value, head_dim: int) -> float:
    """softmax_scale as a float: None -> head_dim ** -0.5; else a finite number >= 0 (0 is
    uniform attention over the visible keys). NaN, inf and negative values raise ValueError
    naming the argument: each backend would give them a different meaning (or none)."""
    if value is None:
        return head_dim**-0.5
    if isinstance(value, bool) or not isinstance(value, (Integral, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"softmax_scale must be a finite number >= 0 (None = head_dim ** -0.5), got {value}"
        )
    return value


def attention_softcap(value) -> float:
    """softcap as a float: None or 0 -> 0.0 (off); a finite number > 0 caps the scores at
    +-softcap (softcap * tanh(s / softcap)); +inf -> 0.0, the limit of that formula (no cap).
    NaN and negative values raise ValueError naming the argument."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (Integral, float)):
        raise TypeError(f"softcap must be a float (0 = off), got {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"softcap must be >= 0 (0 or inf = no softcap, as softcap * tanh(s / softcap) -> s), "
            f"got {value}"
        )
    return 0.0 if math.isinf(value) else value


def check_sinks(sinks, q: torch.Tensor) -> torch.Tensor | None:
    """None, or ``sinks`` checked: a floating (H_q,) tensor on q's device (else an error naming
    it, before any launch)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating-point tensor of shape (H_q,), got {sinks!r}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"sinks must have one logit per query head, shape ({q.shape[1]},), got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")
    return sinks


def offsets_violation(
    first: int, last: int, smallest_step: int, longest: int, total: int, max_len: int | None
) -> str | None:
    """The one offsets rule, on the summary numbers of one cu_seqlens: it starts at 0
    (``"start"``), never decreases (``"decreasing"``), ends at the token count ``total``
    (``"end"``) and, if ``max_len`` is given, holds no document longer than it (``"max"``).
    Returns the first rule broken, or None. Callers word the error: ``check_offsets`` for a host
    list (with the offending entry), ``coverage.coverage_error`` for device statistics."""
    if first != 0:
        return "start"
    if smallest_step < 0:
        return "decreasing"
    if last != total:
        return "end"
    if max_len is not None and longest > max_len:
        return "max"
    return None


def check_offsets(name: str, offsets: list[int], total: int, max_len: int | None = None) -> None:
    """Raise ValueError naming ``name`` unless the host list ``offsets`` (cu_seqlens) obeys
    ``offsets_violation``'s rule."""
    if not offsets:
        raise ValueError(f"{name} is empty; it needs n_docs + 1 >= 1 offsets starting at 0")
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    longest = max(lengths, default=0)
    broken = offsets_violation(
        offsets[0], offsets[-1], min(lengths, default=0), longest, total, max_len
    )
    if broken == "start":
        raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
    if broken == "decreasing":
        bad = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(
            f"{name} must be non-decreasing; entry {bad + 1} ({offsets[bad + 1]}) < entry {bad} "
            f"({offsets[bad]})"
        )
    if broken == "end":
        raise ValueError(
            f"{name}[-1] must equal the number of packed tokens {total}, got {offsets[-1]}: the "
            f"documents must cover every token exactly once"
        )
    if broken == "max":
        raise ValueError(
            f"max_seqlen for {name} is {max_len} but the longest document has {longest} tokens"
        )


def max_length_int(name: str, value, *, host_read: bool = False):
    """A max document length (``max_seqlen_q/k``, the collator's ``max_length_q/k``) as an int.

    A SymInt (torch.compile's dynamic shapes) is returned as is: ``int()`` would specialise the
    graph on it. A tensor is read on the host only where the caller says that read is its one per
    batch (``host_read``: a 1-element tensor, one sync); elsewhere it raises TypeError naming the
    argument, since a per-layer read would be a sync per layer. Negative or non-integer values
    raise TypeError naming the argument.
    """
    if isinstance(value, torch.Tensor):
        if not host_read:
            raise TypeError(
                f"{name} must be a Python int, got a tensor; convert it once per batch "
                f"(int({name}.item())) rather than once per layer"
            )
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be an int or a 1-element tensor, got shape {tuple(value.shape)}"
            )
        # Host read, intended: the caller's one read of this batch (see host_read above).
        value = value.item()
    if isinstance(value, torch.SymInt):
        return value
    if not isinstance(value, Integral) or value < 0:
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def clamp_offsets(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Offsets clamped into [0, total] and made non-decreasing, on the device (no host sync).

    Valid offsets come back unchanged (as int64); malformed ones (negative, past ``total``,
    decreasing) become valid ones, so a kernel that trusts them stays inside the packed tensors.
    """
    return torch.cummax(cu_seqlens.to(torch.int64).clamp(0, total), dim=0).values


def capturing(tensors) -> bool:
    """Whether a CUDA graph is being captured on the current stream while these tensors are used.

    A value cached before the capture holds the warm-up batch's data, and replays bring new data
    into the same tensors (same identity, same version): whatever derives from them must be
    computed inside the graph, so caches neither serve nor store then. (Only asked for CUDA
    tensors: CPU-only torch builds cannot answer it.)"""
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()


class TensorCache:
    """A few values derived from tensors, keyed on the tensors' identity and version counter.

    Every layer of one forward pass (and its backward) receives the *same* tensor objects
    (cu_seqlens, position_ids, the padding mask), so a value derived from them is computed once per
    batch, not once per layer. An in-place edit of a key tensor bumps its version and misses. Some
    edits do not bump it: through the numpy array behind ``torch.from_numpy``, or through
    ``t.data[...] = ...`` (``.data`` has a version counter of its own). For CPU key tensors the
    entry therefore also keeps a copy of their values and a hit must match them (``torch.equal``
    on the host: offsets, positions and masks are small next to the work they save); CUDA key
    tensors are not compared (that would be a device sync per layer on the hot path), so there
    a new batch must come in new tensors or through ordinary in-place ops (every collator does). ``size`` entries are kept, least recently used dropped first. Under
    ``torch.compile`` tracing nothing is cached (identity means nothing to a traced graph), nor for
    inference-mode tensors (they have no version counter, so an in-place edit could not be seen),
    nor while a CUDA graph is captured (``capturing``).
    ``tensors`` may be empty: the key is then ``extra`` alone (a value derived from ints).

        cache = TensorCache(size=4)
        value = cache.get_or_compute((cu_q, cu_k), lambda: build(cu_q, cu_k), extra=(left, right))
    """

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"TensorCache size must be >= 1, got {size}")
        self.size = size
        self._entries: OrderedDict[tuple, tuple[list, Any]] = OrderedDict()

    @staticmethod
    def _key(tensors: tuple[torch.Tensor, ...], extra: Hashable) -> tuple | None:
        if any(t.is_inference() for t in tensors) or capturing(tensors):
            return None
        return (tuple((id(t), t._version) for t in tensors), extra)

    def get(self, tensors: torch.Tensor | tuple[torch.Tensor, ...], extra: Hashable = None):
        """The cached value for these tensors (and ``extra``), or None."""
        tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        key = self._key(tensors, extra)
        hit = None if key is None else self._entries.get(key)
        if hit is None:
            return None
        refs, snapshots, value = hit
        if any(r() is not t for r, t in zip(refs, tensors)) or not all(
            s is None or torch.equal(s, t) for s, t in zip(snapshots, tensors)
        ):  # id reused by a new tensor, or a CPU tensor edited behind its version counter
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, tensors: torch.Tensor | tuple[torch.Tensor, ...], value, extra: Hashable = None):
        """Store ``value`` for these tensors and return it (not stored if they cannot be weakly
        referenced, e.g. under tracing)."""
        tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        key = self._key(tensors, extra)
        try:
            refs = [weakref.ref(t) for t in tensors]
        except TypeError:
            return value
        if key is None:
            return value
        snapshots = [
            t.detach().clone() if type(t) is torch.Tensor and t.device.type == "cpu" else None
            for t in tensors
        ]
        self._entries[key] = (refs, snapshots, value)
        self._entries.move_to_end(key)
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
        if tracing():
            return compute()
        hit = self.get(tensors, extra)
        if hit is None:
            hit = self.put(tensors, compute(), extra)
        return hit

    def clear(self) -> None:
        self._entries.clear()


def tracing(t: torch.Tensor | None = None) -> bool:
    """True while torch.compile traces, or when ``t`` is a fake tensor (FakeTensorMode shape
    propagation): nothing may be read back from the device, cached or logged then. The one such
    test of the package; in eager mode one call and one type check."""
    if torch.compiler.is_compiling():
        return True
    if t is None or type(t) is torch.Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
