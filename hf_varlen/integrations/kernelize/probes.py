"""The probes behind ``kernelize``: which modules of a model compute what an hf_varlen layer
computes, decided by running them, never by their names.

A pure-torch probe (tiny random input, the module's dtype and device, eval mode, no autograd, a
local RNG) checks that the module's own forward equals the layer's math:

    norm   Llama-style ``w * n.to(dtype)`` -> "RMSNorm", Gemma-style ``(n * (1 + w)).to(dtype)``
           -> "GemmaRMSNorm" (the Llama kernel never lands on a ``(1 + w)`` norm)
    MLP    ``down(act(gate(x)) * up(x))`` with act_fn silu -> "SwiGLUMLP", gelu (erf) /
           gelu_pytorch_tanh -> "GeGLUMLP"
    RoPE   the ``rotary_pos_emb`` function entry is HF's half rotation (full or partial)

``plan(model, ...)`` returns the approved targets and ``{name: reason}`` for every candidate left
alone. Probes are cached per (class, activation, dtype) within one call.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn

ROPE_ENTRY = "rotary_pos_emb"
_GLU_ENTRY = {"silu": "SwiGLUMLP", "gelu": "GeGLUMLP", "gelu_tanh": "GeGLUMLP"}


@dataclass
class Target:
    """One approved replacement."""

    name: str  # module name in the model (rope: the attention module)
    module: nn.Module  # whose forward is replaced (rope: the shared rotary_pos_emb entry)
    entry: str  # kernel-hub layer key, e.g. "RMSNorm"
    owner: str  # HF class (or function entry) name, for the report


def _rand(shape, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=like.device).manual_seed(0)  # never touch the global RNG
    return torch.randn(shape, generator=gen, device=like.device, dtype=torch.float32).to(like.dtype)


def _mismatch(got, want) -> str | None:
    """None if every tensor of ``got`` matches ``want`` up to a few roundings of its dtype."""
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape:
            return f"shape {tuple(g.shape)} vs {tuple(w.shape)}"
        # Host reads, intended: probes run once at kernelize() time, never in a training step.
        tol = max(8 * torch.finfo(w.dtype).eps, 1e-5) * (w.float().abs().max().item() + 1e-6)
        err = (g.float() - w.float()).abs().max().item()
        if not err <= tol:
            return f"max error {err:.2e} > {tol:.2e}"
    return None


@contextlib.contextmanager
def _probing(module: nn.Module):
    """Eval mode (no dropout) and no autograd for one probe; restores every submodule's flag."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, flag in flags:
            m.training = flag


def _float_param(module: nn.Module) -> torch.Tensor | None:
    return next((p for p in module.parameters() if p.is_floating_point()), None)


def _single_input_forward(cls: type) -> bool:
    """forward(self, x) exactly: kernels requires the layer's parameter count and kinds."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return len(params) == 1 and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def _norm_entry(module: nn.Module, helpers) -> tuple[str | None, str]:
    """("RMSNorm" | "GemmaRMSNorm", "") when the probe identifies the style, else (None, reason)."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not weight.is_floating_point():
        return None, f"{cls.__name__}: no 1-D floating-point weight"
    if not _single_input_forward(cls):
        return None, f"{cls.__name__}: forward{inspect.signature(cls.forward)} is not forward(x)"
    try:
        eps = helpers.norm_eps(module)
    except TypeError as exc:
        return None, str(exc)
    x = _rand((2, 3, weight.shape[0]), weight)
    with _probing(module):
        out = cls.forward(module, x)
        n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        llama = _mismatch((out,), (weight * n.to(x.dtype),))
        gemma = _mismatch((out,), ((n * (1.0 + weight.float())).to(x.dtype),))
    if llama is None:
        return "RMSNorm", ""
    if gemma is None:
        return "GemmaRMSNorm", ""
    return None, (
        f"{cls.__name__}: not a Llama-style (w * n) or Gemma-style ((1 + w) * n) RMSNorm "
        f"(probe: {llama} / {gemma})"
    )


def _glu_entry(module: nn.Module, helpers) -> tuple[str | None, str]:
    cls = type(module)
    act = module.act_fn
    kind = helpers.activation_kind(act)
    if kind is None:
        name = (
            type(act).__name__
            if isinstance(act, nn.Module)
            else getattr(act, "__name__", repr(act))
        )
        return None, (
            f"{cls.__name__}: unsupported activation {name} (GLU kernels: silu -> SwiGLU; "
            "gelu, gelu_pytorch_tanh -> GeGLU)"
        )
    if not _single_input_forward(cls):
        return None, f"{cls.__name__}: forward{inspect.signature(cls.forward)} is not forward(x)"
    like = _float_param(module.gate_proj)
    in_features = getattr(module.gate_proj, "in_features", None)
    if like is None or not isinstance(in_features, int):
        return None, f"{cls.__name__}: gate_proj has no floating-point weight / in_features"
    x = _rand((2, 3, in_features), like)
    with _probing(module):
        out = cls.forward(module, x)
        ref = module.down_proj(act(module.gate_proj(x)) * module.up_proj(x))
    problem = _mismatch((out,), (ref,))
    if problem is not None:
        return (
            None,
            f"{cls.__name__}: forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x)) "
            f"({problem})",
        )
    return _GLU_ENTRY[kind], ""


def _half_rotation(q, k, cos, sin):
    """HF's ``x * cos + rotate_half(x) * sin`` on the first R = cos.shape[-1] features."""
    r = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(t):
        x = t[..., :r]
        y = x * c + torch.cat((-x[..., r // 2 :], x[..., : r // 2]), dim=-1) * s
        return torch.cat((y, t[..., r:]), dim=-1)

    return rotate(q), rotate(k)


def _rope_entry(func: nn.Module, host: nn.Module) -> tuple[str | None, str]:
    """Probe the original apply_rotary_pos_emb against HF's half-rotation formula."""
    signature = inspect.signature(type(func).forward)
    params = list(signature.parameters.values())[1:]
    if len(params) != 5 or any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        return None, f"{ROPE_ENTRY}: forward{signature} is not (q, k, cos, sin, unsqueeze_dim=1)"
    like = _float_param(host)
    if like is None:
        return None, f"{type(host).__name__}: no floating-point parameter to take dtype/device from"
    dim = getattr(host, "head_dim", None)
    dim = dim if isinstance(dim, int) and dim % 2 == 0 else 16
    q, k = _rand((1, 2, 5, dim), like), _rand((1, 1, 5, dim), like)
    pos = torch.arange(3, 8, device=like.device, dtype=torch.float32)
    inv_freq = 1.0 / 10000 ** (
        torch.arange(0, dim, 2, device=like.device, dtype=torch.float32) / dim
    )
    angles = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[None]
    cos, sin = angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    with _probing(func):
        try:
            out = type(func).forward(func, q.clone(), k.clone(), cos, sin)
        except Exception as exc:  # a different signature or layout: not HF's rotary function
            return None, f"{ROPE_ENTRY}: probe call failed ({type(exc).__name__}: {exc})"
        problem = _mismatch(tuple(out), _half_rotation(q, k, cos, sin))
        if problem is None:  # a function that accepts a narrower cos must rotate only that part
            r = dim // 2 if dim % 4 == 0 else dim
            try:
                out = type(func).forward(func, q.clone(), k.clone(), cos[..., :r], sin[..., :r])
            except RuntimeError:  # HF's full-rotary functions cannot broadcast it: fine
                out = None
            if out is not None:
                problem = _mismatch(tuple(out), _half_rotation(q, k, cos[..., :r], sin[..., :r]))
    if problem is not None:
        return (
            None,
            f"{ROPE_ENTRY} of {type(host).__name__}: not HF's half-rotation RoPE ({problem})",
        )
    return ROPE_ENTRY, ""


# ------------------------------------------------------------------------------------ planning


def rope_funcs(module: nn.Module) -> list[nn.Module]:
    funcs = module.__dict__.get("_kernel_funcs") or {}
    return [f for f in funcs.values() if getattr(type(f), "kernel_layer_name", None) == ROPE_ENTRY]


def _is_glu_mlp(module: nn.Module) -> bool:
    projections = ("gate_proj", "up_proj", "down_proj")
    has_projections = all(isinstance(getattr(module, n, None), nn.Module) for n in projections)
    return has_projections and hasattr(module, "act_fn")


def plan(model: nn.Module, helpers, *, rope: bool, glu: bool, rmsnorm: bool):
    """Targets to replace and {name: reason} for candidates left alone."""
    targets: list[Target] = []
    left: dict[str, str] = {}
    cache: dict[tuple, tuple[str | None, str]] = {}

    def verdict(key, probe):
        if key not in cache:
            try:
                cache[key] = probe()
            except Exception as exc:  # a probe that cannot run means "do not replace"
                cache[key] = (None, f"{key[0]}: probe failed ({type(exc).__name__}: {exc})")
        return cache[key]

    for name, module in model.named_modules():
        cls = type(module)
        like = _float_param(module)
        dtype = like.dtype if like is not None else None
        if rmsnorm and "rmsnorm" in cls.__name__.lower():
            entry, why = verdict(
                (cls.__name__, cls, dtype), lambda m=module: _norm_entry(m, helpers)
            )
        elif glu and _is_glu_mlp(module):
            act = type(module.act_fn)
            entry, why = verdict(
                (cls.__name__, cls, act, dtype), lambda m=module: _glu_entry(m, helpers)
            )
        else:
            entry = why = None
        if entry is not None:
            targets.append(Target(name, module, entry, cls.__name__))
        elif why:
            left[name] = why
        for func in rope_funcs(module) if rope else ():
            entry, why = verdict(
                (ROPE_ENTRY, id(func), dtype), lambda f=func, h=module: _rope_entry(f, h)
            )
            if entry is not None:
                targets.append(Target(name, func, entry, ROPE_ENTRY))
            else:
                left[name] = why
    if rope and not any(rope_funcs(m) for m in model.modules()):
        left["rope"] = (
            f"no `{ROPE_ENTRY}` kernel entry on any attention module (transformers attaches one "
            "where the modeling code uses `use_kernelized_func` and its hub decorators are active, "
            "which needs a kernels release it accepts); RoPE stays the model's module-level "
            "function, which hf_varlen does not swap"
        )
    return targets, left
