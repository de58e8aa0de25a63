"""Registry of varlen attention backends.

A backend is a function over packed tensors with FlashAttention-2 semantics

    fn(q, k, v, metadata: VarlenMetadata, params: AttentionParams) -> out

    q: (T_q, H_q, D)   k, v: (T_k, H_kv, D)   out: (T_q, H_q, D_v)   (T >= 1)
    metadata.cu_seqlens_q/k: (n_docs + 1,) int32 on q's device; metadata.max_seqlen_q/k: ints
    params.window: (left, right) with causality folded in ((-1, 0) = causal, (-1, -1) = full);
    params.softmax_scale (float), .softcap (0 = off), .dropout_p, .deterministic (resolved),
    .sinks ((H_q,) attention-sink logits or None; only for backends whose spec says sinks=True);
    params.causal / params.sliding_window: derived views of the window.

(``hf_varlen.backends.params``), plus a ``BackendSpec`` that says what it supports. The public
entry point validates inputs once, builds ``params`` once, checks the requested features against
the spec *before* any launch, and only then calls ``fn``; so a backend function may assume valid,
supported input (offsets are only checked where they are on the host anyway). Backends register
themselves at import of ``hf_varlen.backends``; ``register_backend`` is public so users can add
their own with the signature above.

Which backend a call gets: an explicit ``backend=`` argument, else the backend scoped to the model
(``set_backend(name, model=model)``, read by the transformers integration), else the process
default (``set_backend(name)`` / ``$HF_VARLEN_BACKEND``), else "auto".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..metadata import VarlenMetadata
from ..ops.common import tracing
from .params import AttentionParams

logger = logging.getLogger("hf_varlen")
# The attribute set_backend(name, model=...) puts on every submodule of that model.
MODEL_BACKEND_ATTR = "hf_varlen_backend"

# fn(q, k, v, metadata, params) -> out (see the module docstring)
BackendFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, VarlenMetadata, AttentionParams], torch.Tensor
]


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
    sinks: bool = False  # per-head attention sinks (params.sinks; gpt-oss's s_aux), with gradient
    non_causal: bool = True
    deterministic: bool = True  # a bitwise-repeatable backward is available on request
    head_dim_multiple: int = 1
    # device type -> the smallest head dim served there (compiled FlexAttention's CUDA kernels
    # need >= 16; its CPU path takes any)
    min_head_dim: Mapping[str, int] = field(default_factory=dict)
    backward_devices: frozenset[str] | None = None  # None: backward wherever forward runs
    # False: torch.compile cannot trace ``fn`` (host offsets, Python-side JIT); while compiling it
    # runs as one opaque op with a recompute backward (backends/opaque.py)
    traceable: bool = True
    probe: Callable[[], str | None] = field(default=lambda: None)


_REGISTRY: dict[str, BackendSpec] = {}
# "auto" tries these in order per device type (first available that supports the request wins). The
# order comes from our own H200 measurements (docs/BENCHMARKS.md): see hf_varlen/backends/__init__.py.
_AUTO_ORDER: dict[str, list[str]] = {"cuda": [], "cpu": []}
# Tried before _AUTO_ORDER when a call's documents are long enough for them to be faster than
# the backends ahead of them (``LongDocumentsRule``; docs/BENCHMARKS.md: H200, bf16,
# forward+backward). The defaults are FA4's switch against our kernel (32/8/128 heads).
MEAN_DOCUMENT_TOKENS = 448  # lima 64K (mean 489), 64K of 512-token documents: FA4 0.93-0.98x ours
LONG_DOCUMENT_TOKENS = 2048  # a longest document below this never decides alone
LONG_DOCUMENT_WORK = 1600  # max^2 / (T - max): 8K + alpaca 56K 1170 (ours), 32K + 32K 32768 (FA4)


@dataclass(frozen=True)
class LongDocumentsRule:
    """When "auto" tries backend ``name`` first: for calls of head_dim in [min_head_dim,
    max_head_dim] whose pack counts as one of long documents by these thresholds
    (``long_documents``); the backend keeps its usual place in the order for the other calls."""

    name: str
    mean_tokens: int = MEAN_DOCUMENT_TOKENS
    work_ratio: int | None = LONG_DOCUMENT_WORK  # None: the mean length alone decides
    min_head_dim: int = 1
    max_head_dim: int | None = None

    def covers(self, head_dim: int) -> bool:
        return self.min_head_dim <= head_dim and (
            self.max_head_dim is None or head_dim <= self.max_head_dim
        )

    def matches(self, max_seqlen: int, total: int, n_docs: int) -> bool:
        return long_documents(
            max_seqlen, total, n_docs, mean_tokens=self.mean_tokens, work_ratio=self.work_ratio
        )


_AUTO_LONG_FIRST: dict[str, list[LongDocumentsRule]] = {"cuda": [], "cpu": []}
# Tried first for a call of whole rows (``Request.rows``: plain dense attention, no documents
# packed, no padding) unless a deterministic backward is requested, ahead of the long-documents
# rules too; why, with its measurements: the order's docstring in backends/__init__.py.
_AUTO_ROWS_FIRST: dict[str, list[str]] = {"cuda": [], "cpu": []}
_PROBE_CACHE: dict[str, str | None] = {}
_AUTO_LOGGED: set[tuple] = set()
_DEFAULT = {"name": None}


def register_backend(spec: BackendSpec, *, auto_rank: int | None = None) -> None:
    """Add (or replace) a backend. ``auto_rank`` inserts it into the CUDA "auto" order at that index.

    ``spec.fn`` is called as ``fn(q, k, v, metadata, params)`` (module docstring).
    """
    _REGISTRY[spec.name] = spec
    _PROBE_CACHE.pop(spec.name, None)
    if auto_rank is not None:
        order = _AUTO_ORDER["cuda"]
        if spec.name in order:
            order.remove(spec.name)
        order.insert(min(auto_rank, len(order)), spec.name)


def set_auto_order(
    device_type: str,
    names: list[str],
    *,
    long_documents_first: list[str | LongDocumentsRule] | None = None,
    rows_first: list[str] | None = None,
) -> None:
    """Set the order in which backend="auto" tries backends on ``device_type`` ("cuda", "cpu").

    ``long_documents_first`` (optional): rules, in priority order, for backends tried before
    ``names`` when a call's pack counts as one of long documents for them (a bare name: the
    default thresholds at every head dim; ``LongDocumentsRule``).
    ``rows_first`` (optional): backends tried before all of those for a call of whole rows
    (``rows_backends``).
    """
    first = [
        r if isinstance(r, LongDocumentsRule) else LongDocumentsRule(r)
        for r in long_documents_first or []
    ]
    rows_first = list(rows_first or [])
    unknown = [n for n in names + [r.name for r in first] + rows_first if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"set_auto_order: unknown backends {unknown}; known: {sorted(_REGISTRY)}")
    _AUTO_ORDER[device_type] = list(names)
    _AUTO_LONG_FIRST[device_type] = first
    _AUTO_ROWS_FIRST[device_type] = rows_first


def auto_order(device_type: str, *, long_first: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The order "auto" tries on ``device_type``: ``long_first`` (the backends whose long-documents
    rule a call meets, ``long_first_backends``) ahead of the usual order."""
    first = list(dict.fromkeys(long_first))
    return first + [n for n in _AUTO_ORDER.get(device_type, []) if n not in first]


def long_documents(
    max_seqlen: int,
    total: int,
    n_docs: int,
    *,
    mean_tokens: int = MEAN_DOCUMENT_TOKENS,
    work_ratio: int | None = LONG_DOCUMENT_WORK,
) -> bool:
    """Whether a pack counts as one of long documents (only the shapes and the host
    ``max_seqlen``, never the lengths: no device read). Either its documents are long on average
    (T / n_docs >= mean_tokens), or (work_ratio set) its longest one does more attention work than
    the rest (quadratic in max, linear in T - max for short documents) by that ratio. With the
    defaults, on the H200 (docs/BENCHMARKS.md) this matches the faster of triton and FA4 on every
    measured pack: alpaca 16K / 64K, 64K of 256-token documents and alpaca packs with one 1K / 4K /
    8K document are short; lima 64K, 64K of 512-4096-token documents, 128+128+4096, 8 x 8K,
    32K + alpaca 32K, 128K long. A max_seqlen of >= T over several documents is a bound, not a
    length: the captured CUDA-graph step passes T with a fixed count of offsets (empty documents
    at the end), and such a pack never counts as long, so the step keeps our kernel, the
    graph-safe default."""
    if n_docs <= 0 or (max_seqlen >= total and n_docs > 1):
        return False
    if total >= mean_tokens * n_docs:
        return True
    if work_ratio is None:
        return False
    rest = total - max_seqlen
    return max_seqlen >= LONG_DOCUMENT_TOKENS and max_seqlen * max_seqlen >= work_ratio * rest


def get_spec(name: str) -> BackendSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"backend={name!r} is not a known varlen attention backend; known: "
            f"{sorted(_REGISTRY) + ['auto']}"
        ) from None


# Constant for the process, and evaluated in plain Python while torch.compile traces: probing
# writes the cache, a side effect Dynamo refuses inside a HOP (a checkpointed layer under TRL's
# default gradient checkpointing: a graph break on the first compiled call of a process).
@torch.compiler.assume_constant_result
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


def set_backend(name: str | None, *, model: torch.nn.Module | None = None) -> None:
    """Choose the backend: process-wide, or for one model only.

    Without ``model``: the process-wide default ("auto", a registered name, or None to reset).
    With ``model``: only that model's attention uses ``name`` (every submodule carries the choice,
    so the transformers attention function reads it from the module it is called with); the
    process default is untouched. ``None`` or "auto" removes the model's choice (it then follows
    the process default). An explicit name is checked now: a backend that cannot run raises here.
    """
    if name is not None and name != "auto":
        get_spec(name)
        reason = unavailable_reason(name)
        if reason is not None:
            raise RuntimeError(f"set_backend({name!r}): this backend cannot run here: {reason}")
    if model is None:
        _DEFAULT["name"] = name
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"set_backend(model=...) needs a torch.nn.Module, got {type(model).__name__}"
        )
    for module in model.modules():
        if name is None or name == "auto":
            module.__dict__.pop(MODEL_BACKEND_ATTR, None)
        else:
            setattr(module, MODEL_BACKEND_ATTR, name)


def model_backend(model: torch.nn.Module) -> str | None:
    """The backend scoped to ``model`` by ``set_backend(name, model=model)``, or None."""
    return getattr(model, MODEL_BACKEND_ATTR, None)


def default_backend() -> str:
    """The backend used when a call says backend="auto": set_backend(), else $HF_VARLEN_BACKEND, else auto."""
    return _DEFAULT["name"] or os.environ.get("HF_VARLEN_BACKEND", "auto") or "auto"


def long_first_backends(
    device_type: str, head_dim: int, max_seqlen: int, total: int, n_docs: int
) -> tuple[str, ...]:
    """Names of the available backends whose long-documents rule a call meets, in rule order.
    Rules of unavailable backends or other head dims are never evaluated: under torch.compile a
    rule guards on the shapes, which is only worth it where it can change the choice."""
    rules = [
        r
        for r in _AUTO_LONG_FIRST.get(device_type, [])
        if r.covers(head_dim) and unavailable_reason(r.name) is None
    ]
    return tuple(r.name for r in rules if r.matches(max_seqlen, total, n_docs))


def rows_backends(req: Request) -> tuple[str, ...]:
    """The backends of ``set_auto_order(rows_first=)`` when ``req`` is a call of whole rows
    (``Request.rows``) and no deterministic backward is requested (that stays on the order's first
    choice, whose backward is deterministic at no cost); else none."""
    if not req.rows or req.deterministic:
        return ()
    return tuple(_AUTO_ROWS_FIRST.get(req.device, ()))


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
    sinks: bool = False
    # (max_seqlen, total tokens, documents) of the pack: only "auto" reads it (LongDocumentsRule),
    # so an explicitly chosen backend adds no shape guard under torch.compile
    pack: tuple[int, int, int] | None = None
    # every document is one whole row (VarlenMetadata.rows), in eager mode: only "auto" reads it
    # (rows_backends); a traced call keeps the order's traceable first choice
    rows: bool = False

    @classmethod
    def for_call(cls, q, k, v, metadata: VarlenMetadata, params: AttentionParams) -> Request:
        """The features one validated call needs."""
        return cls(
            device=q.device.type,
            dtype=q.dtype,
            head_dim=q.shape[-1],
            causal=params.causal,
            window=params.sliding_window,
            softcap=params.softcap > 0,
            dropout=params.dropout_p > 0,
            deterministic=params.deterministic,
            needs_grad=torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad),
            sinks=params.sinks is not None,
            pack=(
                max(metadata.max_seqlen_q, metadata.max_seqlen_k),
                max(q.shape[0], k.shape[0]),
                metadata.cu_seqlens_q.shape[0] - 1,
            ),
            rows=metadata.rows and not tracing(q),
        )

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
        if self.head_dim < (low := spec.min_head_dim.get(self.device, 1)):
            out.append(f"head_dim {self.head_dim} on {self.device} (supports >= {low})")
        if self.window and not spec.sliding_window:
            out.append("sliding window (window_size / sliding_window)")
        if self.softcap and not spec.softcap:
            out.append("softcap")
        if self.dropout and not spec.dropout:
            out.append("dropout_p > 0")
        if self.sinks and not spec.sinks:
            out.append("attention sinks (sinks / s_aux)")
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
    first = long_first_backends(req.device, req.head_dim, *req.pack) if req.pack else ()
    first = rows_backends(req) + first
    for cand in auto_order(req.device, long_first=first):
        if unavailable_reason(cand) is not None:
            continue
        missing = req.unsupported(_REGISTRY[cand])
        if missing:
            tried.append(f"{cand}: {'; '.join(missing)}")
            continue
        # Logged once per process for each (backend, device, dtype) it picks — not per feature set,
        # so a no-grad trial forward and the training steps do not log the same choice twice —
        # and never from inside a traced region (no side effects there). tracing() comes first:
        # Dynamo would otherwise guard on the set, and the first eager call's entry would make a
        # model compiled before it recompile.
        key = (cand, req.device, req.dtype)
        if not tracing() and key not in _AUTO_LOGGED:
            _AUTO_LOGGED.add(key)
            logger.info("hf_varlen: backend='auto' chose %r for %s %s", cand, req.device, req.dtype)
        return _REGISTRY[cand]
    raise ValueError(
        "backend='auto' found no available backend for this call: "
        + ("; ".join(tried) or f"available: {available_backends()}")
    )
