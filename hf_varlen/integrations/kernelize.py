"""``kernelize(model)``: put hf_varlen's fused RMSNorm, RoPE and GLU kernels (and the fused loss)
into an already-built Hugging Face model.

One set of layers (``hub_layers.py``), two wirings:

- ``"kernels"`` (``kernels`` 0.17.x, accepted by the installed transformers): the hub package that
  ``hub_package.py`` generates is registered through ``LocalLayerRepository`` mappings without a
  mode dict (= ``Mode.FALLBACK``: matches every mode), inside ``use_kernel_mapping(...,
  inherit_mapping=False)``, and ``kernels.kernelize(model, mode=Mode.TRAINING)`` swaps the forwards.
  Norm and MLP classes are marked with ``replace_kernel_forward_from_hub`` (no model decorates its
  MLP; Gemma norms are undecorated); RoPE is the ``rotary_pos_emb`` function entry transformers
  attaches to attention modules (``_kernel_funcs``).
- ``"fallback"`` (``kernels`` missing or outside the range transformers accepts, in which case
  transformers turns its hub decorators into no-ops): the same layer forwards are bound per instance
  (``module.forward = MethodType(Layer.forward, module)``, exactly what ``kernels`` does). RoPE is
  replaced only where a ``rotary_pos_emb`` entry exists; otherwise it is left alone, because on a
  built model RoPE is a module-global function called inside the attention forward, and changing it
  means swapping that global or rewriting the attention forward. We do neither; the report says so.

Nothing is replaced on trust. A pure-torch probe (tiny random input, the module's dtype and device,
eval mode, local RNG) checks that the module's own forward computes what the layer computes:
Llama-style ``w * n.to(dtype)`` vs Gemma-style ``(n * (1 + w)).to(dtype)`` norm (the Llama kernel
never lands on a ``(1 + w)`` norm), the GLU structure ``down(act(gate(x)) * up(x))``, HF's
half-rotation RoPE. The activation comes from the ``act_fn`` class: silu -> SwiGLU, gelu (erf) /
gelu_pytorch_tanh -> GeGLU. Anything else is left alone, with its reason in the report and a log
line.

Each call first undoes earlier hf_varlen replacements, so the model ends up exactly as the flags
ask: calling twice is a no-op, and ``kernelize(model, rope=False, glu=False, rmsnorm=False,
cross_entropy=False)`` restores the original forwards (the fused loss is managed by its own
module). Caveat (kernels' design): the ``rotary_pos_emb`` entry is one module per modeling file,
shared by every model of that architecture in the process, so RoPE follows the latest call for all.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import weakref
from dataclasses import dataclass, field
from types import MethodType

import torch
from torch import nn

logger = logging.getLogger("hf_varlen")

ROPE_ENTRY = "rotary_pos_emb"
# mapping key (kernel_layer_name) -> layer class in hub_layers, and the report kind of each
_LAYER = {
    "RMSNorm": "RMSNorm",
    "GemmaRMSNorm": "GemmaRMSNorm",
    ROPE_ENTRY: "RotaryPosEmb",
    "SwiGLUMLP": "SwiGLUMLP",
    "GeGLUMLP": "GeGLUMLP",
}
_KIND = {"RMSNorm": "rmsnorm", "GemmaRMSNorm": "rmsnorm", ROPE_ENTRY: "rope"}
_GLU_ENTRY = {"silu": "SwiGLUMLP", "gelu": "GeGLUMLP", "gelu_tanh": "GeGLUMLP"}
_OUR_FORWARDS = {f"{name}.forward" for name in _LAYER.values()}
_KERNELS_TESTED = ((0, 17), (0, 18))  # [lo, hi) of the kernels releases this wiring was written for

# module -> mapping key it was approved for; read by the kernel_condition of marked classes
_APPROVED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


@dataclass
class KernelizeReport:
    """What ``kernelize`` did. ``replaced[kind]`` lists module names (for ``rope``, the attention
    modules whose ``rotary_pos_emb`` entry now runs the fused kernel); ``left_alone`` maps a module
    name, or a kind, to the reason it was not replaced."""

    path: str  # "kernels" or "fallback"
    path_reason: str = ""  # why the fallback wiring was used
    replaced: dict[str, list[str]] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)  # HF class -> hf_varlen layer
    left_alone: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return {
            kind: len(self.replaced.get(kind, []))
            for kind in ("rmsnorm", "rope", "glu", "cross_entropy")
        }

    def summary(self) -> str:
        done = ", ".join(f"{k} x{n}" for k, n in self.counts.items() if n) or "nothing"
        how = ", ".join(f"{cls} -> {layer}" for cls, layer in sorted(self.layers.items()))
        text = f"hf_varlen.kernelize [{self.path}]: replaced {done}" + (f" ({how})" if how else "")
        if self.left_alone:
            text += f"; left alone: {len(self.left_alone)} (see report.left_alone)"
        return text

    __str__ = summary


@dataclass
class _Target:
    name: str  # module name in the model (rope: the attention module)
    module: nn.Module  # whose forward is replaced (rope: the shared rotary_pos_emb entry)
    entry: str  # mapping key, e.g. "RMSNorm"
    owner: str  # HF class (or function entry) name, for the report


# ---------------------------------------------------------------------------------------- choice


def _kernels_problem() -> str | None:
    """None when the kernels wiring can be used, else why not."""
    try:
        import kernels
    except ImportError:
        return "the `kernels` package is not installed"
    import transformers
    from packaging.version import Version
    from transformers.utils import import_utils

    if not import_utils.is_kernels_available():
        lo = getattr(import_utils, "KERNELS_MIN_VERSION", "?")
        hi = getattr(import_utils, "KERNELS_MAX_VERSION", "?")
        return (
            f"kernels {kernels.__version__} is outside the range transformers "
            f"{transformers.__version__} accepts ({lo} <= kernels < {hi}), so transformers' hub "
            "decorators are inactive"
        )
    release = Version(kernels.__version__).release[:2]
    if not _KERNELS_TESTED[0] <= release < _KERNELS_TESTED[1]:
        return f"kernels {kernels.__version__} is not a release hf_varlen supports (0.17.x)"
    return None


def _device_type(model: nn.Module, device) -> str:
    if device is None:
        param = next(model.parameters(), None)
        return param.device.type if param is not None else "cpu"
    if isinstance(device, str | torch.device):
        return torch.device(device).type
    raise TypeError(f"device must be None, a str or a torch.device, got {type(device).__name__}")


def _device_problem(device_type: str) -> str | None:
    if device_type == "cuda" or (
        device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    ):
        return None
    return (
        f"the Triton kernels cannot run on device type {device_type!r} (cuda; cpu only under "
        "TRITON_INTERPRET=1); pass device='cuda' when the model moves to the GPU after kernelize"
    )


# ---------------------------------------------------------------------------------------- probes


def _rand(shape, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=like.device).manual_seed(0)  # never touch the global RNG
    return torch.randn(shape, generator=gen, device=like.device, dtype=torch.float32).to(like.dtype)


def _mismatch(got, want) -> str | None:
    """None if every tensor of ``got`` matches ``want`` up to a few roundings of its dtype."""
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape:
            return f"shape {tuple(g.shape)} vs {tuple(w.shape)}"
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


def _rope_funcs(module: nn.Module) -> list[nn.Module]:
    funcs = module.__dict__.get("_kernel_funcs") or {}
    return [f for f in funcs.values() if getattr(type(f), "kernel_layer_name", None) == ROPE_ENTRY]


def _is_glu_mlp(module: nn.Module) -> bool:
    projections = ("gate_proj", "up_proj", "down_proj")
    has_projections = all(isinstance(getattr(module, n, None), nn.Module) for n in projections)
    return has_projections and hasattr(module, "act_fn")


def _plan(model: nn.Module, helpers, *, rope: bool, glu: bool, rmsnorm: bool):
    """Targets to replace and {name: reason} for candidates left alone."""
    targets: list[_Target] = []
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
            targets.append(_Target(name, module, entry, cls.__name__))
        elif why:
            left[name] = why
        for func in _rope_funcs(module) if rope else ():
            entry, why = verdict(
                (ROPE_ENTRY, id(func), dtype), lambda f=func, h=module: _rope_entry(f, h)
            )
            if entry is not None:
                targets.append(_Target(name, func, entry, ROPE_ENTRY))
            else:
                left[name] = why
    if rope and not any(_rope_funcs(m) for m in model.modules()):
        left["rope"] = (
            f"no `{ROPE_ENTRY}` kernel entry on any attention module (transformers attaches one "
            "where the modeling code uses `use_kernelized_func` and its hub decorators are active, "
            "which needs a kernels release it accepts); RoPE stays the model's module-level "
            "function, which hf_varlen does not swap"
        )
    return targets, left


# ------------------------------------------------------------------------------------- applying


def _is_ours(forward) -> bool:
    func = getattr(forward, "__func__", None)
    return (
        func is not None
        and func.__qualname__ in _OUR_FORWARDS
        and func.__module__.endswith("hub_layers")
    )


def _undo(model: nn.Module) -> None:
    """Remove every hf_varlen forward from the model (the class forwards take over again)."""
    for module in model.modules():
        for m in (module, *_rope_funcs(module)):
            if _is_ours(m.__dict__.get("forward")):
                del m.__dict__["forward"]
            _APPROVED.pop(m, None)


class _ApprovedAs:
    """kernel_condition: replace only modules the probes approved for this mapping key."""

    def __init__(self, entry: str):
        self.entry = entry

    def __call__(self, module: nn.Module) -> bool:
        return _APPROVED.get(module) == self.entry


class _CollectUnmapped(logging.Filter):
    """Swallow kernels' per-module "No kernel mapping found" warnings; keep the layer names."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "No kernel mapping found for layer" in msg:
            self.names.add(msg.split("`")[1] if "`" in msg else msg)
            return False
        return True


def _apply_kernels(model: nn.Module, targets: list[_Target], device_type: str, report) -> object:
    import kernels
    from kernels import (
        LocalLayerRepository,
        Mode,
        replace_kernel_forward_from_hub,
        use_kernel_mapping,
    )

    from .hub_package import hub_kernel_path

    repo_path = hub_kernel_path()
    entries = {t.entry for t in targets}
    for t in targets:
        _APPROVED[t.module] = t.entry
        if t.entry != ROPE_ENTRY:  # function entries are found through _kernel_funcs, not classes
            replace_kernel_forward_from_hub(type(t.module), t.entry, condition=_ApprovedAs(t.entry))
    # Classes transformers decorated with one of our names (e.g. a norm the probe rejected) must
    # consult the approvals too: their own condition accepts every instance.
    for cls in {type(m) for m in model.modules()}:
        name = getattr(cls, "kernel_layer_name", None)
        if name in _LAYER and not isinstance(getattr(cls, "kernel_condition", None), _ApprovedAs):
            replace_kernel_forward_from_hub(cls, name, condition=_ApprovedAs(name))
    layers = kernels.get_local_kernel(repo_path).layers
    if not entries:
        return layers
    mapping = {
        e: {device_type: LocalLayerRepository(repo_path=repo_path, layer_name=_LAYER[e])}
        for e in entries
    }
    collect = _CollectUnmapped()
    kernels_logger = logging.getLogger("kernels.layer.layer")
    kernels_logger.addFilter(collect)
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernels.kernelize(model, mode=Mode.TRAINING, device=device_type)
    finally:
        kernels_logger.removeFilter(collect)
    # rotary entries the probes rejected: kernels applies no condition to function entries
    for module in model.modules():
        for func in _rope_funcs(module):
            if _APPROVED.get(func) != ROPE_ENTRY and _is_ours(func.__dict__.get("forward")):
                del func.__dict__["forward"]
    if collect.names:
        report.notes.append(
            f"kernels reset these hub layers of the model to their original forward (no hf_varlen "
            f"kernel for them): {', '.join(sorted(collect.names))}"
        )
    report.notes.append(
        f"kernels.kernelize(mode=TRAINING) with LocalLayerRepository at {repo_path}"
    )
    return layers


def _apply_fallback(targets: list[_Target], report) -> object:
    from . import hub_layers as layers

    for t in targets:
        _APPROVED[t.module] = t.entry
        t.module.forward = MethodType(getattr(layers, _LAYER[t.entry]).forward, t.module)
    if targets:
        report.notes.append(
            "per-instance forward: module.forward = MethodType(Layer.forward, module)"
        )
    return layers


def _install_loss(model: nn.Module, report: KernelizeReport) -> None:
    try:
        from .loss import install_fused_cross_entropy
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.loss":
            raise
        report.left_alone["cross_entropy"] = "hf_varlen.integrations.loss is not available"
        return
    try:
        install_fused_cross_entropy(model)  # idempotent
    except (NotImplementedError, TypeError) as exc:  # a head/loss it cannot reproduce: keep HF's
        report.left_alone["cross_entropy"] = f"fused cross-entropy not installed: {exc}"
        return
    report.replaced["cross_entropy"] = [type(model).__name__]
    report.notes.append("fused linear cross-entropy: hf_varlen.integrations.loss")


# --------------------------------------------------------------------------------------- public


def kernelize(
    model: nn.Module,
    *,
    rope: bool = True,
    glu: bool = True,
    rmsnorm: bool = True,
    cross_entropy: bool = True,
    device: str | torch.device | None = None,
) -> KernelizeReport:
    """Replace the supported RMSNorm / RoPE / GLU-MLP forwards of ``model`` with fused kernels.

    Args:
        model: a built (weights loaded) transformers model, e.g. ``LlamaForCausalLM``.
        rope, glu, rmsnorm: which kinds to fuse; a kind set to False is restored to the original.
        cross_entropy: also install the fused linear cross-entropy loss
            (``hf_varlen.integrations.loss.install_fused_cross_entropy``). False leaves the loss as
            it is (undo it with ``uninstall_fused_cross_entropy``).
        device: device type the kernels will run on (default: where the parameters are). Pass
            ``"cuda"`` when kernelizing on CPU before ``model.to("cuda")``.

    Returns:
        A ``KernelizeReport``: the wiring used ("kernels" or "fallback" and why), the replaced
        modules per kind, and every candidate left alone with its reason. The model is changed in
        place.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device_type = _device_type(model, device)
    problem = _kernels_problem()
    report = KernelizeReport(path="fallback" if problem else "kernels", path_reason=problem or "")
    from . import hub_layers as helpers

    _undo(model)
    targets, report.left_alone = _plan(model, helpers, rope=rope, glu=glu, rmsnorm=rmsnorm)
    if targets and (why := _device_problem(device_type)):
        report.left_alone.update({t.name: why for t in targets})
        targets = []
    if problem:
        layers = _apply_fallback(targets, report)
    else:
        layers = _apply_kernels(model, targets, device_type, report)

    for t in targets:  # count what really runs our layer now (kernels may fall back silently)
        layer = getattr(layers, _LAYER[t.entry])
        if getattr(t.module.__dict__.get("forward"), "__func__", None) is layer.forward:
            report.replaced.setdefault(_KIND.get(t.entry, "glu"), []).append(t.name)
            report.layers[t.owner] = _LAYER[t.entry]
        else:
            report.left_alone[t.name] = f"{t.owner}: approved but {report.path} did not replace it"
    if cross_entropy:
        _install_loss(model, report)

    by_reason: dict[str, int] = {}
    for why in report.left_alone.values():
        by_reason[why] = by_reason.get(why, 0) + 1
    for why, n in by_reason.items():
        logger.warning("hf_varlen.kernelize: left %d module(s) as they are: %s", n, why)
    if problem:  # say what the fallback did and why, once per call
        logger.warning("%s; fallback wiring because %s", report.summary(), problem)
    else:
        logger.info(report.summary())
    return report
