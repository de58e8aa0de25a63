"""Registry of varlen attention backends.

A backend is a function over packed tensors with FlashAttention-2 semantics

    fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale, causal,
       window_size, softcap, dropout_p, deterministic) -> out

    q: (T_q, H_q, D)   k, v: (T_k, H_kv, D)   cu_seqlens_*: (n_docs + 1,) int32   out: (T_q, H_q, D)

plus a ``BackendSpec`` that says what it supports. The public entry point validates inputs, checks
the requested features against the spec *before* any launch, and only then calls ``fn``; so a
backend function may assume valid, supported input. Backends register themselves at import of
``hf_varlen.backends``; ``register_backend`` is public so users can add their own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("hf_varlen")

BackendFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class BackendSpec:
    """What a backend can do. ``probe`` returns None when usable, else the reason it is not."""

    name: str
    fn: BackendFn
    description: str
    requires: str  # what to install / which hardware, for error messages and the README table
    devices: frozenset[str] = frozenset({"cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
    head_dims: frozenset[int] | None = None  # None: any head dim
    max_head_dim: int | None = None
    sliding_window: bool = False
    softcap: bool = False
    dropout: bool = False
    non_causal: bool = True
    deterministic: bool = True  # a bitwise-repeatable backward is available on request
    head_dim_multiple: int = 1
    backward_devices: frozenset[str] | None = None  # None: backward wherever forward runs
    probe: Callable[[], str | None] = field(default=lambda: None)


_REGISTRY: dict[str, BackendSpec] = {}
# "auto" tries these in order per device type (first available that supports the request wins). The
# order comes from our own H200 measurements (docs/BENCHMARKS.md): see hf_varlen/backends/__init__.py.
_AUTO_ORDER: dict[str, list[str]] = {"cuda": [], "cpu": []}
# Tried before _AUTO_ORDER when a call holds a document of >= LONG_DOCUMENT_TOKENS tokens: on long
# documents FA4's backward beats our short-document schedule (docs/BENCHMARKS.md, 1 x 32K case).
LONG_DOCUMENT_TOKENS = 8192
_AUTO_LONG_FIRST: dict[str, list[str]] = {"cuda": [], "cpu": []}
_PROBE_CACHE: dict[str, str | None] = {}
_AUTO_LOGGED: set[tuple] = set()
_DEFAULT = {"name": None}


def register_backend(spec: BackendSpec, *, auto_rank: int | None = None) -> None:
    """Add (or replace) a backend. ``auto_rank`` inserts it into the CUDA "auto" order at that index."""
    _REGISTRY[spec.name] = spec
    _PROBE_CACHE.pop(spec.name, None)
    if auto_rank is not None:
        order = _AUTO_ORDER["cuda"]
        if spec.name in order:
            order.remove(spec.name)
        order.insert(min(auto_rank, len(order)), spec.name)


def set_auto_order(
    device_type: str, names: list[str], *, long_documents_first: list[str] | None = None
) -> None:
    """Set the order in which backend="auto" tries backends on ``device_type`` ("cuda", "cpu").

    ``long_documents_first`` (optional) are tried before ``names`` when a call's longest document
    has at least ``LONG_DOCUMENT_TOKENS`` tokens.
    """
    first = list(long_documents_first or [])
    unknown = [n for n in names + first if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"set_auto_order: unknown backends {unknown}; known: {sorted(_REGISTRY)}")
    _AUTO_ORDER[device_type] = list(names)
    _AUTO_LONG_FIRST[device_type] = first


def auto_order(device_type: str, *, long_documents: bool = False) -> list[str]:
    """The order "auto" tries on ``device_type`` (for a call with long documents if asked)."""
    order = _AUTO_ORDER.get(device_type, [])
    if long_documents:
        first = _AUTO_LONG_FIRST.get(device_type, [])
        order = first + [n for n in order if n not in first]
    return list(order)


def get_spec(name: str) -> BackendSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"backend={name!r} is not a known varlen attention backend; known: "
            f"{sorted(_REGISTRY) + ['auto']}"
        ) from None


def unavailable_reason(name: str) -> str | None:
    """None if backend ``name`` can run in this process, else why not (cached)."""
    if name not in _PROBE_CACHE:
        try:
            _PROBE_CACHE[name] = get_spec(name).probe()
        except Exception as exc:  # a probe that crashes means "not usable", with the reason
            _PROBE_CACHE[name] = f"probe failed: {type(exc).__name__}: {exc}"
    return _PROBE_CACHE[name]


def available_backends() -> list[str]:
    """Names of the backends that can run in this process (installed + hardware present)."""
    return [n for n in _REGISTRY if unavailable_reason(n) is None]


def set_backend(name: str | None) -> None:
    """Set the process-wide default backend ("auto", a registered name, or None to reset).

    An explicit name is checked now: asking for a backend that cannot run raises immediately.
    """
    if name is None or name == "auto":
        _DEFAULT["name"] = None if name is None else "auto"
        return
    get_spec(name)
    reason = unavailable_reason(name)
    if reason is not None:
        raise RuntimeError(f"set_backend({name!r}): this backend cannot run here: {reason}")
    _DEFAULT["name"] = name


def default_backend() -> str:
    """The backend used when a call says backend="auto": set_backend(), else $HF_VARLEN_BACKEND, else auto."""
    return _DEFAULT["name"] or os.environ.get("HF_VARLEN_BACKEND", "auto") or "auto"


@dataclass(frozen=True)
class Request:
    """The features one attention call needs; compared against a BackendSpec."""

    device: str
    dtype: torch.dtype
    head_dim: int
    causal: bool
    window: bool
    softcap: bool
    dropout: bool
    deterministic: bool = False
    needs_grad: bool = False
    long_documents: bool = False  # a document of >= LONG_DOCUMENT_TOKENS (only steers "auto")

    def unsupported(self, spec: BackendSpec) -> list[str]:
        """Names of the requested features ``spec`` cannot provide (empty = supported)."""
        out = []
        if self.device not in spec.devices:
            out.append(f"device {self.device!r} (supports {sorted(spec.devices)})")
        elif (
            self.needs_grad
            and spec.backward_devices is not None
            and self.device not in spec.backward_devices
        ):
            out.append(
                f"backward on device {self.device!r} (backward runs on {sorted(spec.backward_devices)})"
            )
        if self.dtype not in spec.dtypes:
            out.append(f"dtype {self.dtype} (supports {sorted(str(d) for d in spec.dtypes)})")
        if spec.head_dims is not None and self.head_dim not in spec.head_dims:
            out.append(f"head_dim {self.head_dim} (supports {sorted(spec.head_dims)})")
        if spec.max_head_dim is not None and self.head_dim > spec.max_head_dim:
            out.append(f"head_dim {self.head_dim} (supports <= {spec.max_head_dim})")
        if self.window and not spec.sliding_window:
            out.append("sliding window (window_size / sliding_window)")
        if self.softcap and not spec.softcap:
            out.append("softcap")
        if self.dropout and not spec.dropout:
            out.append("dropout_p > 0")
        if not self.causal and not spec.non_causal:
            out.append("causal=False")
        if self.head_dim % spec.head_dim_multiple:
            out.append(f"head_dim {self.head_dim} (must be a multiple of {spec.head_dim_multiple})")
        if self.deterministic and not spec.deterministic:
            out.append("deterministic backward")
        return out


def _who_can(req: Request) -> list[str]:
    return [n for n, s in _REGISTRY.items() if not req.unsupported(s)]


def resolve(name: str, req: Request) -> BackendSpec:
    """Pick the backend for one call. Explicit names raise when they cannot serve ``req``."""
    if name == "auto":
        name = default_backend()
    if name != "auto":
        spec = get_spec(name)
        reason = unavailable_reason(name)
        if reason is not None:
            raise RuntimeError(
                f"backend={name!r} was requested but cannot run here: {reason}. "
                f"Available: {available_backends()}; or pass backend='auto'."
            )
        missing = req.unsupported(spec)
        if missing:
            raise ValueError(
                f"backend={name!r} does not support: {'; '.join(missing)}. Backends that do: "
                f"{_who_can(req) or 'none'}."
            )
        return spec
    tried = []
    for cand in auto_order(req.device, long_documents=req.long_documents):
        if unavailable_reason(cand) is not None:
            continue
        missing = req.unsupported(_REGISTRY[cand])
        if missing:
            tried.append(f"{cand}: {'; '.join(missing)}")
            continue
        key = (cand, req)
        if key not in _AUTO_LOGGED:
            _AUTO_LOGGED.add(key)
            logger.info("hf_varlen: backend='auto' chose %r for %s %s", cand, req.device, req.dtype)
        return _REGISTRY[cand]
    raise ValueError(
        "backend='auto' found no available backend for this call: "
        + ("; ".join(tried) or f"available: {available_backends()}")
    )
