"""The flash-linear-attention path of a packed gated DeltaNet layer: the whole packed row in one
call of FLA's varlen ``chunk_gated_delta_rule(..., cu_seqlens=...)`` (the recurrent state starts
from zero at every document), instead of one call of the layer's own forward per document.

FLA's kernel replaces only the delta rule; the rest of the layer is restated here from its
weights, per layer shape (transformers' Qwen3-Next, Qwen3.5 / Qwen3.5-MoE, OLMo-hybrid layers,
read from their modeling files): the input projections, the short causal convolution (restarted
at each document: ``varlen_causal_conv1d``), the gates, and the gated norm + output projection.
A layer of another shape has no adapter here (``has_fla_adapter``) and stays on the loop.

Shapes: hidden (1, T, hidden); mixed q/k/v (1, C, T) around the convolution, C = 2 * H * K + HV * V;
q, k (1, T, H, K); v (1, T, HV, V); beta, g (1, T, HV); the output (1, T, hidden). ``bounds``: the
non-empty documents [(start, end)] of the row (``linear_attention._document_bounds``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import TensorCache

_DEVICE_CACHE = TensorCache(size=4)  # per offsets tensor: (cu_seqlens, position in document)


@functools.cache
def fla_chunk_gated_delta_rule() -> Callable | None:
    """FLA's varlen delta rule, or None when flash-linear-attention is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def fla_runs_on(device: torch.device) -> bool:
    """FLA's kernels are Triton kernels for CUDA GPUs."""
    return device.type == "cuda"


def _kind(layer: nn.Module) -> str | None:
    names = vars(layer)["_modules"]
    if "in_proj_qkvz" in names and "in_proj_ba" in names:
        return "qwen3_next"
    if all(n in names for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        return "qwen3_5"
    if all(n in names for n in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")):
        return "olmo_hybrid"
    return None


def has_fla_adapter(layer: nn.Module) -> bool:
    return _kind(layer) is not None


def _inputs(layer, hidden):
    """(mixed q/k/v before the convolution, beta, a (the decay's input), the output gate)."""
    b_size, t = hidden.shape[:2]
    kind = _kind(layer)
    if kind == "qwen3_next":
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden)
        )
        mixed = torch.cat([x.reshape(b_size, t, -1) for x in (q, k, v)], dim=-1)
        return mixed.transpose(1, 2), b.sigmoid(), a, z
    if kind == "qwen3_5":
        z = layer.in_proj_z(hidden).reshape(b_size, t, -1, layer.head_v_dim)
        mixed = layer.in_proj_qkv(hidden).transpose(1, 2)
        return mixed, layer.in_proj_b(hidden).sigmoid(), layer.in_proj_a(hidden), z
    qkv = [layer.q_proj(hidden), layer.k_proj(hidden), layer.v_proj(hidden)]
    beta = layer.b_proj(hidden).sigmoid()
    if layer.allow_neg_eigval:
        beta = beta * 2.0
    return torch.cat(qkv, dim=-1).transpose(1, 2), beta, layer.a_proj(hidden), layer.g_proj(hidden)


def _output(layer, core, gate):
    b_size, t = core.shape[:2]
    if _kind(layer) == "olmo_hybrid":
        out = layer.o_norm(core.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
        return layer.o_proj(out.reshape(b_size, t, -1))
    out = layer.norm(core.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(b_size, t, -1))


def _device_offsets(bounds, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens of the non-empty documents (n + 1,) int64, each token's position in its
    document (T,)), on ``device``."""
    cu = [0] + [e for _, e in bounds]
    pos = torch.cat([torch.arange(e - s) for s, e in bounds])
    return torch.tensor(cu, dtype=torch.long).to(device), pos.to(device)


def varlen_causal_conv1d(x, weight, bias, activation, pos_in_doc) -> torch.Tensor:
    """The depthwise causal convolution of the layer, restarted at every document: the tap that
    would reach ``shift`` tokens back reads zero where the token is fewer than ``shift`` tokens
    into its document (each document then sees the zero left padding it has alone).

    x (1, C, T); weight (C, 1, W) (``nn.Conv1d`` of ``groups=C``); pos_in_doc (T,)."""
    from transformers.activations import ACT2FN

    w = weight.squeeze(1)
    width = w.shape[-1]
    t = x.shape[-1]
    xp = F.pad(x.to(w.dtype), (width - 1, 0))
    out = torch.zeros_like(xp[..., :t])
    for j in range(width):
        shift = width - 1 - j
        tap = xp[..., j : j + t] * w[:, j, None]
        out = out + (tap if shift == 0 else tap * (pos_in_doc >= shift))
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


# Every document starts from a zero state and no final state is kept (training, no cache); q and
# k are L2-normalised in the kernel, as the layers' own forward asks of FLA.
_FROM_ZERO_STATE = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)


def fla_packed_forward(layer: nn.Module, hidden, cu, bounds, chunk_rule: Callable):
    """The layer on a packed row (1, T, hidden): FLA's varlen delta rule over all documents at once
    (``chunk_rule``: FLA's ``chunk_gated_delta_rule``), each starting from a zero state."""
    cu_long, pos = _DEVICE_CACHE.get_or_compute(
        cu, lambda: _device_offsets(bounds, hidden.device), extra=str(hidden.device)
    )
    mixed, beta, a, gate = _inputs(layer, hidden)
    mixed = varlen_causal_conv1d(
        mixed, layer.conv1d.weight, layer.conv1d.bias, layer.activation, pos
    )
    q, k, v = torch.split(
        mixed.transpose(1, 2), [layer.key_dim, layer.key_dim, layer.value_dim], -1
    )
    b_size, t = hidden.shape[:2]
    q = q.reshape(b_size, t, -1, layer.head_k_dim)
    k = k.reshape(b_size, t, -1, layer.head_k_dim)
    v = v.reshape(b_size, t, -1, layer.head_v_dim)
    # fp32 decay, as the layers compute it (A might be -inf in half precision)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    core, _ = chunk_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_long, **_FROM_ZERO_STATE)
    return _output(layer, core, gate)
