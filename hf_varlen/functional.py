"""The public functional API: ``hf_varlen.varlen_attention``, FlashAttention-2 semantics and names.

    q: (T_q, H_q, D)    k, v: (T_k, H_kv, D)    cu_seqlens_q/k: (n_docs + 1,) int32    -> (T_q, H_q, D)

Validation happens here, once, on the host, before any kernel launch: cheap checks always (types,
dtypes, devices, shapes, head counts), full checks that need a device sync (monotonic cu_seqlens,
cu[-1] == T, max_seqlen >= the true maximum) with ``validate=True`` or ``HF_VARLEN_VALIDATE=1``
(backends that copy the offsets to the host anyway, sdpa / reference / xformers, always run them).
The call is then described once, as ``VarlenMetadata`` + ``AttentionParams``, and handed to the
backend by ``dispatch(q, k, v, metadata, params, backend)`` (hf_varlen/backends/registry.py has the
backend signature). The transformers integration enters at ``dispatch`` too, with the metadata
``metadata.py`` built and checked once per batch and the params ``batch_call`` built once per batch
and kind of layer: no per-layer validation on that route.

Under torch.compile (and for fake tensors): the sync-needing checks are skipped (validate / HF_VARLEN_VALIDATE are for
eager debugging), max_seqlen_q/k may be SymInts, and a backend torch.compile cannot trace
(``BackendSpec.traceable = False``: sdpa, reference, xformers, fa4) runs as the opaque op of
backends/opaque.py, so the graph never breaks.
"""

from __future__ import annotations

from numbers import Integral

import torch

from .backends import AttentionParams, Request, resolve
from .backends.opaque import call_opaque
from .metadata import BatchState, VarlenMetadata
from .ops.common import (
    attention_scale,
    attention_softcap,
    check_offsets,
    check_sinks,
    deterministic_requested,
    env_flag,
    max_length_int,
    tracing,
)


def _check_cu(name: str, cu, device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(
            f"{name} must have dtype torch.int32, got {cu.dtype} (use .to(torch.int32))"
        )
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with n_docs + 1 >= 2 entries, got shape {tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {cu.device}")


def _check_qkv(q, k, v) -> None:
    """q, k, v: packed (T, H, D) tensors of one floating dtype and device, GQA-compatible heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be packed (total_tokens, heads, head_dim), got shape {tuple(t.shape)}"
            )
    if not q.dtype.is_floating_point or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must have the same tokens and heads, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[2] == 0 or v.shape[2] == 0:
        raise ValueError(f"head_dim must be >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the number of "
            f"key/value heads ({k.shape[1]})"
        )


def _check_keywords(head_dim: int, softmax_scale, window_size, softcap, dropout_p):
    """The FA-2 keywords of one call; returns the normalised (softmax_scale, softcap)
    (ops/common.py: attention_scale and attention_softcap, the one policy of every backend)."""
    softmax_scale = attention_scale(softmax_scale, head_dim)
    softcap = attention_softcap(softcap)
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, Integral) and w >= -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size must be a pair of ints >= -1 (left, right), got {window_size!r}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return softmax_scale, softcap


def validate_inputs(q, k, v, cu_q, cu_k, max_q, max_k, keywords: tuple, full: bool):
    """Host-side checks; raises TypeError/ValueError naming the argument. ``keywords``: the call's
    (softmax_scale, window_size, softcap, dropout_p). Returns the normalised
    (max_seqlen_q, max_seqlen_k, softmax_scale, softcap) (ops/common.py: attention_scale and
    attention_softcap, the one policy of every backend)."""
    _check_qkv(q, k, v)
    _check_cu("cu_seqlens_q", cu_q, q.device)
    _check_cu("cu_seqlens_k", cu_k, q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
            f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
        )
    max_q = max_length_int("max_seqlen_q", max_q)
    max_k = max_length_int("max_seqlen_k", max_k)
    softmax_scale, softcap = _check_keywords(q.shape[2], *keywords)
    if full:
        check_offsets("cu_seqlens_q", cu_q.tolist(), q.shape[0], max_q)
        check_offsets("cu_seqlens_k", cu_k.tolist(), k.shape[0], max_k)
    return max_q, max_k, softmax_scale, softcap


def _params(q, causal, window_size, scale, cap, dropout_p, deterministic, sinks) -> AttentionParams:
    """The ``AttentionParams`` of checked keywords (``scale``/``cap`` normalised, ``sinks``
    checked, ``deterministic`` resolved): one constructor call for both public routes."""
    return AttentionParams.create(
        head_dim=q.shape[-1],
        causal=bool(causal),
        window_size=window_size,
        softmax_scale=scale,
        softcap=cap,
        dropout_p=float(dropout_p),
        deterministic=bool(deterministic),
        sinks=sinks,
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    backend: str = "auto",
    validate: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention inside each packed document (FlashAttention-2 ``flash_attn_varlen_func`` semantics).

    Args:
        q: (T_q, H_q, D) packed queries. k, v: (T_k, H_kv, D); H_q must be a multiple of H_kv (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: int32 (n_docs + 1,) document offsets, on q's device.
        max_seqlen_q, max_seqlen_k: Python ints, the longest document (an upper bound is fine).
        softmax_scale: defaults to D ** -0.5; a finite number >= 0 (NaN, inf and negative values
            raise ValueError; docs/attention-numerics.md).
        causal: bottom-right aligned causal mask inside each document.
        window_size: (left, right) sliding window, -1 = unbounded (FA semantics: a query sees keys
            in [i - left, i + right]; with causal the right side is 0).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (Gemma2); 0 or inf = no
            softcap (the formula's limit); NaN or negative raise ValueError.
        dropout_p: attention dropout probability (only backends that implement it accept > 0).
        deterministic: request a bitwise-repeatable backward (also FLASH_ATTENTION_DETERMINISTIC=1
            or torch.use_deterministic_algorithms(True)).
        backend: "auto" or a name from ``hf_varlen.available_backends()``. An explicit backend that
            cannot serve the call raises; it never falls back silently. "auto" means the model's
            scoped backend (inside a model, ``set_backend(name, model=...)``), else the process
            default (``set_backend`` / $HF_VARLEN_BACKEND), else the first capable backend.
        sinks: (H_q,) per-head attention-sink logits (gpt-oss's ``s_aux``; differentiable), or
            None: each row's softmax denominator gets exp(sinks[h]) more, with no value. Served
            by the backends whose spec says ``sinks`` (docs/attention-numerics.md).
        validate: run the checks that need a device sync; default from HF_VARLEN_VALIDATE (eager
            only: under torch.compile the variable is skipped and validate=True raises).
    Returns:
        (T_q, H_q, D) attention output; an empty pack (T = 0) gives an empty output, and queries
        that see no key give zeros.
    """
    symbolic = tracing(q)  # compiling, or fake tensors: nothing is read back from the device
    if symbolic:  # the full checks read offsets on the host: eager only
        if validate:
            raise ValueError(
                "validate=True reads cu_seqlens on the host (a sync and a graph break); it is not "
                "available under torch.compile: validate in eager mode (HF_VARLEN_VALIDATE=1 is "
                "skipped while compiling)"
            )
        full = False
    else:
        full = env_flag("HF_VARLEN_VALIDATE") if validate is None else bool(validate)
    keywords = (softmax_scale, window_size, softcap, dropout_p)
    max_q, max_k, softmax_scale, softcap = validate_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, keywords, full
    )
    sinks = check_sinks(sinks, q)
    metadata = VarlenMetadata(cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    deterministic = deterministic_requested(deterministic)
    params = _params(
        q, causal, window_size, softmax_scale, softcap, dropout_p, deterministic, sinks
    )
    return dispatch(q, k, v, metadata, params, backend)


def dispatch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: VarlenMetadata,
    params: AttentionParams,
    backend: str = "auto",
    *,
    request: Request | None = None,
) -> torch.Tensor:
    """Internal: run one already checked call on its backend (no validation here).

    ``metadata`` and ``params`` are handed to the backend as they are; the callers checked them:
    ``varlen_attention`` (the public arguments, per call) or the transformers integration
    (``metadata.py`` per batch, ``batch_call`` per batch and kind of layer). ``request``: the
    call's ``Request`` when the caller has it already (``batch_call``'s plan), else built here.
    The backend is resolved on every call (a few dict lookups): ``set_backend`` and
    ``$HF_VARLEN_BACKEND`` may change between any two calls.
    """
    if request is None:
        request = Request.for_call(q, k, v, metadata, params)
    spec = resolve(backend, request)
    if q.shape[0] == 0 or k.shape[0] == 0:
        # An empty pack (or no keys): every query sees nothing, so the output is zeros (FA rule).
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    if q.stride(-1) != 1:  # every kernel needs a unit-stride head dim; other strides are fine
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if not spec.traceable and tracing(q):
        return call_opaque(spec.name, q, k, v, metadata, params)  # backends/opaque.py
    return spec.fn(q, k, v, metadata, params)


_PLANS = BatchState()  # (params, request) per kind of call of the current batch


def batch_call(
    q, k, v, metadata, *, softmax_scale, causal, window_size, softcap, dropout_p, sinks=None
) -> tuple[AttentionParams, Request]:
    """The ``AttentionParams`` and ``Request`` of a call on metadata that ``metadata.py`` built and
    checked, checked and built once per batch and kind of call, not once per layer.

    Every layer of a forward pass gets the same ``metadata`` object (``metadata.py`` caches it on
    the batch's tensors), and the layers of one model differ in at most a few ways (sliding or
    full window, the grad mode, their own sinks): so layer 1 checks q, k, v and the keywords and
    builds the pair, and layers 2..N of that batch find it in ``_PLANS`` (keyed on the metadata
    object's identity plus everything the pair is derived from; nothing is read from a tensor's
    values, and a batch whose offsets change in place gets a new metadata object from
    ``metadata.py``). Under torch.compile nothing is cached (``BatchState``).

    q, k, v: (T_q, H_q, D), (T_k, H_kv, D), (T_k, H_kv, D_v); the keywords as ``varlen_attention``
    takes them (the deterministic backward as requested by the environment only).
    """
    deterministic = deterministic_requested(False)  # the environment may change between calls

    def build() -> tuple[AttentionParams, Request]:
        _check_qkv(q, k, v)
        scale, cap = _check_keywords(q.shape[2], softmax_scale, window_size, softcap, dropout_p)
        sinks_checked = check_sinks(sinks, q)
        params = _params(
            q, causal, window_size, scale, cap, dropout_p, deterministic, sinks_checked
        )
        return params, Request.for_call(q, k, v, metadata, params)

    if tracing(q):  # traced once per graph: no key (id() of a traced tensor means nothing)
        return build()
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        needs_grad,
        softmax_scale,
        bool(causal),
        tuple(window_size),
        softcap,
        dropout_p,
        deterministic,
        None if sinks is None else id(sinks),  # held by the plan's params: the id stays its own
    )
    return _PLANS.get_or_compute(metadata, key, build)
