"""Public functional varlen attention with FlashAttention-2 semantics and argument names.

    q: (T_q, H_q, D)    k, v: (T_k, H_kv, D)    cu_seqlens_q/k: (n_docs + 1,) int32    -> (T_q, H_q, D)

Validation happens here, on the host, before any kernel launch: cheap checks always (types,
dtypes, devices, shapes, head counts), full checks that need a device sync (monotonic cu_seqlens,
cu[-1] == T, max_seqlen >= the true maximum) with ``validate=True`` or ``HF_VARLEN_VALIDATE=1``.
"""

from __future__ import annotations

import os
from numbers import Integral

import torch

from .backends import Request, resolve
from .backends.registry import LONG_DOCUMENT_TOKENS


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def deterministic_requested(deterministic: bool) -> bool:
    """The argument, FLASH_ATTENTION_DETERMINISTIC=1, or torch's global deterministic mode."""
    return (
        bool(deterministic)
        or _env_flag("FLASH_ATTENTION_DETERMINISTIC")
        or torch.are_deterministic_algorithms_enabled()
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


def _check_max(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a Python int, got a tensor; convert it once per batch "
            f"(int({name}.item())) rather than once per layer"
        )
    if not isinstance(value, Integral) or value < 0:
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _full_validation(name: str, cu: torch.Tensor, total: int, max_len: int) -> None:
    host = cu.tolist()
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0]}")
    lengths = [b - a for a, b in zip(host[:-1], host[1:])]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise ValueError(
            f"{name} must be non-decreasing; entry {bad + 1} ({host[bad + 1]}) < entry {bad} ({host[bad]})"
        )
    if host[-1] != total:
        raise ValueError(
            f"{name}[-1] must equal the number of packed tokens {total}, got {host[-1]}"
        )
    if max(lengths) > max_len:
        raise ValueError(
            f"max_seqlen for {name} is {max_len} but the longest document has {max(lengths)} tokens"
        )


def validate_inputs(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    window_size,
    softcap,
    dropout_p,
    full: bool,
):
    """Host-side checks; raises TypeError/ValueError naming the argument. Returns normalised ints."""
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
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the number of "
            f"key/value heads ({k.shape[1]})"
        )
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    max_q = _check_max("max_seqlen_q", max_seqlen_q)
    max_k = _check_max("max_seqlen_k", max_seqlen_k)
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, Integral) and w >= -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size must be a pair of ints >= -1 (left, right), got {window_size!r}"
        )
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if full:
        _full_validation("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_q)
        _full_validation("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_k)
    return max_q, max_k


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
) -> torch.Tensor:
    """Attention inside each packed document (FlashAttention-2 ``flash_attn_varlen_func`` semantics).

    Args:
        q: (T_q, H_q, D) packed queries. k, v: (T_k, H_kv, D); H_q must be a multiple of H_kv (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: int32 (n_docs + 1,) document offsets, on q's device.
        max_seqlen_q, max_seqlen_k: Python ints, the longest document (an upper bound is fine).
        softmax_scale: defaults to D ** -0.5.
        causal: bottom-right aligned causal mask inside each document.
        window_size: (left, right) sliding window, -1 = unbounded (FA semantics: a query sees keys
            in [i - left, i + right]; with causal the right side is 0).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) (Gemma2).
        dropout_p: attention dropout probability (only backends that implement it accept > 0).
        deterministic: request a bitwise-repeatable backward (also FLASH_ATTENTION_DETERMINISTIC=1
            or torch.use_deterministic_algorithms(True)).
        backend: "auto" or a name from ``hf_varlen.available_backends()``. An explicit backend that
            cannot serve the call raises; it never falls back silently.
        validate: run the checks that need a device sync; default from HF_VARLEN_VALIDATE.
    Returns:
        (T_q, H_q, D) attention output.
    """
    full = _env_flag("HF_VARLEN_VALIDATE") if validate is None else bool(validate)
    max_q, max_k = validate_inputs(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size,
        softcap,
        dropout_p,
        full,
    )
    window = (int(window_size[0]), int(window_size[1]))
    det = deterministic_requested(deterministic)
    req = Request(
        device=q.device.type,
        dtype=q.dtype,
        head_dim=q.shape[-1],
        causal=bool(causal),
        window=window != (-1, -1),
        softcap=softcap > 0,
        dropout=dropout_p > 0,
        deterministic=det,
        needs_grad=torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad),
        long_documents=max(max_q, max_k) >= LONG_DOCUMENT_TOKENS,
    )
    spec = resolve(backend, req)
    if q.stride(-1) != 1:  # every kernel needs a unit-stride head dim; other strides are fine
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    return spec.fn(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_q,
        max_k,
        softmax_scale=q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale),
        causal=bool(causal),
        window_size=window,
        softcap=float(softcap),
        dropout_p=float(dropout_p),
        deterministic=det,
    )
