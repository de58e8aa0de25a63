"""``kernelize(model)``: the entry point that puts hf_varlen's fused RMSNorm, RoPE and GLU kernels
(and the fused loss) into an already-built Hugging Face model. Its report says what changed and
undoes it.

Module map: this file (the entry point, what users call); ``probes.py`` (which modules
qualify, decided by running them); ``peft_lora.py`` (peft's LoRA layers on the one-op projection);
``..hub/layers.py`` (the layer forwards, shipped in the kernel-hub package); ``..hub/package.py``
(builds that package locally from ``hf_varlen/ops`` + ``hub/layers.py`` + ``hub/attention.py``).

One set of layers, two wirings:

- ``"kernels"`` (``kernels`` 0.17-0.19, the release the installed transformers accepts: 0.17 for
  transformers 5.18-5.22, 0.18 for 5.23-5.24, 0.19 for 5.25): the generated hub
  package is registered through ``LocalLayerRepository`` mappings without a mode dict (=
  ``Mode.FALLBACK``: matches every mode), inside ``use_kernel_mapping(..., inherit_mapping=False)``,
  and ``kernels.kernelize(..., mode=Mode.TRAINING)`` swaps the forwards. It is called on a
  selection holding exactly the approved modules (``_Selection``), never on the whole model, so
  kernels touches nothing else (it resets every layer it finds without a mapping, e.g. HF's
  decorated activations, to the class forward). Classes that kernels must see under our layer
  name (undecorated MLPs and Gemma norms, or a class decorated with another name) are marked
  with ``replace_kernel_forward_from_hub`` only for the duration of that call and restored after:
  no HF class is changed process-wide.
- ``"fallback"`` (``kernels`` missing or outside the range transformers accepts, in which case
  transformers turns its hub decorators into no-ops): the same layer forwards are bound per
  instance (``module.forward = MethodType(Layer.forward, module)``, exactly what ``kernels``
  does). RoPE is replaced only where a ``rotary_pos_emb`` entry exists; otherwise it is left
  alone, because on a built model RoPE is a module-global function called inside the attention
  forward, and changing it means swapping that global or rewriting the attention forward. We do
  neither; the report says so.

Either way only instance attributes of this model's modules change, so a second model of the same
class is untouched. The one exception is inherent to transformers: the ``rotary_pos_emb`` entry is
one module per modeling file, called as a module-global by every attention forward of that
architecture, so the RoPE replacement is seen by every such model in the process (the report says
so in ``notes``).

Each call first undoes earlier hf_varlen replacements, so the model ends up exactly as the flags
ask: calling twice is a no-op, and ``kernelize(model, rope=False, glu=False, rmsnorm=False,
cross_entropy=False)`` restores the original forwards; ``report.undo()`` restores everything the
call changed, the fused loss included.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MethodType

import torch
from torch import nn

from ...ops.common import env_flag
from .probes import ROPE_ENTRY, Target, plan, rope_funcs

logger = logging.getLogger("hf_varlen")

# kernel-hub layer key -> layer class in hub/layers.py, and the report kind of each
_LAYER = {
    "RMSNorm": "RMSNorm",
    "GemmaRMSNorm": "GemmaRMSNorm",
    ROPE_ENTRY: "RotaryPosEmb",
    "SwiGLUMLP": "SwiGLUMLP",
    "GeGLUMLP": "GeGLUMLP",
}
_KIND = {"RMSNorm": "rmsnorm", "GemmaRMSNorm": "rmsnorm", ROPE_ENTRY: "rope"}
KINDS = ("rmsnorm", "rope", "glu", "cross_entropy", "lora")
_OUR_FORWARDS = {f"{name}.forward" for name in _LAYER.values()}
# [lo, hi) of the kernels releases this wiring is tested with (CI: 0.19 with transformers 5.25;
# 0.17 with 5.22, as on the GPU machine; 0.18 with 5.24 once, by hand)
_KERNELS_TESTED = ((0, 17), (0, 20))
_MARKS = ("kernel_layer_name", "kernel_condition")  # what replace_kernel_forward_from_hub sets


@dataclass
class KernelizeReport:
    """What ``kernelize`` did to one model.

    Attributes:
        path: ``"kernels"`` or ``"fallback"``; ``path_reason`` says why the fallback was used.
        replaced: kind -> module names now running an hf_varlen kernel. Kinds: ``"rmsnorm"``,
            ``"glu"``, ``"rope"`` (the attention modules whose ``rotary_pos_emb`` entry runs the
            fused kernel), ``"cross_entropy"`` (the model's class name when the fused loss
            was installed) and ``"lora"`` (peft LoRA Linear layers on the one-op projection).
        counts: kind -> number of replaced modules, for every kind (0 when none).
        layers: HF class -> hf_varlen layer it now runs.
        left_alone: module name (or a kind) -> why it was not replaced.
        notes: how the replacements were wired.

    ``installed(kind)`` says whether a kind runs fused (e.g. ``report.installed("cross_entropy")``
    for a trainer deciding whether eval calls may skip the logits); ``undo()`` restores the model.
    """

    path: str  # "kernels" or "fallback"
    path_reason: str = ""  # why the fallback wiring was used
    replaced: dict[str, list[str]] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)  # HF class -> hf_varlen layer
    left_alone: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _model: weakref.ref | None = field(default=None, repr=False, compare=False)
    # transformers' own kernelization was on for the model and this call turned it off (undo
    # turns it back on)
    _hf_kernels: bool = field(default=False, repr=False, compare=False)

    @property
    def counts(self) -> dict[str, int]:
        """Kind -> number of replaced modules, for every kind of ``KINDS``."""
        return {kind: len(self.replaced.get(kind, [])) for kind in KINDS}

    def installed(self, kind: str) -> bool:
        """True when ``kind`` ("rmsnorm", "rope", "glu", "cross_entropy", "lora") runs fused now."""
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        return bool(self.replaced.get(kind))

    def undo(self) -> None:
        """Give the model its original forwards back: every hf_varlen layer forward is removed,
        and the fused loss too when this call installed it (``installed("cross_entropy")``).
        A no-op when the model is gone; calling it twice is harmless."""
        model = self._model() if self._model is not None else None
        if model is None:
            return
        _undo(model)
        if self.installed("cross_entropy"):
            from ..fused_loss import uninstall_fused_cross_entropy

            uninstall_fused_cross_entropy(model)
        if self._hf_kernels:
            model.set_use_kernels(True)
            self._hf_kernels = False
        self.replaced.clear()
        self.layers.clear()

    def summary(self) -> str:
        done = ", ".join(f"{k} x{n}" for k, n in self.counts.items() if n) or "nothing"
        how = ", ".join(f"{cls} -> {layer}" for cls, layer in sorted(self.layers.items()))
        text = f"hf_varlen.kernelize [{self.path}]: replaced {done}" + (f" ({how})" if how else "")
        if self.left_alone:
            text += f"; left alone: {len(self.left_alone)} (see report.left_alone)"
        return text

    __str__ = summary


# ---------------------------------------------------------------------------------------- choice


def _kernels_problem() -> str | None:
    """None when the kernels wiring can be used, else why not."""
    try:
        import kernels
    except ImportError:
        return "the `kernels` package is not installed (pip install 'hf_varlen[kernels]')"
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
        return f"kernels {kernels.__version__} is not a release hf_varlen supports (0.17-0.19)"
    return None


def _device_type(model: nn.Module, device) -> str:
    if device is None:
        param = next(model.parameters(), None)
        return param.device.type if param is not None else "cpu"
    if isinstance(device, str | torch.device):
        return torch.device(device).type
    raise TypeError(f"device must be None, a str or a torch.device, got {type(device).__name__}")


def _triton_problem() -> str | None:
    """None when triton imports, else why the layer kernels cannot run (CPU-only installs of
    hf_varlen do not get triton; the fused loss has a pure-torch path and is still installed)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return (
            "triton is not installed: the fused RMSNorm / RoPE / GLU layers are Triton kernels "
            "(pip install triton; CUDA builds of torch already depend on it)"
        )
    return None


def _device_problem(device_type: str) -> str | None:
    if device_type == "cuda" or (device_type == "cpu" and env_flag("TRITON_INTERPRET")):
        return None
    return (
        f"the Triton kernels cannot run on device type {device_type!r} (cuda; cpu only under "
        "TRITON_INTERPRET=1); pass device='cuda' when the model moves to the GPU after kernelize"
    )


# ------------------------------------------------------------------------------------- applying


def _is_ours(forward) -> bool:
    func = getattr(forward, "__func__", None)
    return (
        func is not None
        and func.__qualname__ in _OUR_FORWARDS
        and func.__module__.endswith(".hub.layers")
    )


def _stop_hf_kernels(model: nn.Module, report: KernelizeReport) -> bool:
    """Turn transformers' own kernelization off for this model (``reset_kernels``, its public
    switch); True when it was on. From 5.25 ``from_pretrained`` turns it on by default and it runs
    again at every ``train()`` / ``eval()`` switch, resetting every hub-decorated layer (RMSNorm)
    to its class forward or transformers' own mapping: our replacements would be gone silently at
    the first ``model.train()``."""
    if not getattr(model, "use_kernels", False) or not hasattr(model, "reset_kernels"):
        return False
    model.reset_kernels()
    report.notes.append(
        "transformers' own kernelization (use_kernels, re-run at every train()/eval()) is off for "
        "this model so the fused layers stay; report.undo() turns it back on"
    )
    return True


def _undo(model: nn.Module) -> None:
    """Remove every hf_varlen forward from the model (the class forwards take over again)."""
    from . import peft_lora

    peft_lora.uninstall(model)
    for module in model.modules():
        for m in (module, *rope_funcs(module)):
            if _is_ours(m.__dict__.get("forward")):
                del m.__dict__["forward"]


class _Selection(nn.Module):
    """The "model" handed to ``kernels.kernelize``: exactly the approved modules.

    ``kernels.kernelize(model)`` visits ``model.named_modules()`` (plus their ``_kernel_funcs``)
    and resets every marked layer that has no mapping to its class forward, e.g. transformers'
    decorated activations inside an MLP. Its only per-module entry point (``kernelize_layer``) is
    private, so the smallest shim is this container whose ``named_modules`` yields the approved
    modules and nothing else: kernels replaces them and touches nothing more, so there is nothing
    "left unmapped" to find out afterwards.
    """

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.selected = list(modules)  # a plain list: not registered as submodules

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        for i, module in enumerate(self.selected):
            yield f"{prefix}{i}", module


@contextlib.contextmanager
def _marked(classes: dict[type, str]) -> Iterator[None]:
    """Give classes our layer name (``replace_kernel_forward_from_hub``, kernels' public API) for
    one ``kernels.kernelize`` call, then restore exactly what each class had before."""
    from kernels import replace_kernel_forward_from_hub

    saved = {cls: {a: cls.__dict__[a] for a in _MARKS if a in cls.__dict__} for cls in classes}
    try:
        for cls, name in classes.items():
            replace_kernel_forward_from_hub(cls, name)
        yield
    finally:
        for cls, attrs in saved.items():
            for attr in _MARKS:
                if attr in attrs:
                    setattr(cls, attr, attrs[attr])
                elif attr in cls.__dict__:
                    delattr(cls, attr)


def _apply_kernels(targets: list[Target], device_type: str, report: KernelizeReport) -> object:
    import kernels
    from kernels import LocalLayerRepository, Mode, use_kernel_mapping

    from ..hub.package import hub_kernel_path

    repo_path = hub_kernel_path()
    layers = kernels.get_local_kernel(repo_path).layers
    by_entry: dict[str, list[Target]] = {}
    for t in targets:  # one call per layer key: a class carries one kernel_layer_name at a time
        by_entry.setdefault(t.entry, []).append(t)
    for entry, group in by_entry.items():
        repo = LocalLayerRepository(repo_path=repo_path, layer_name=_LAYER[entry])
        with (
            _marked({type(t.module): entry for t in group}),
            use_kernel_mapping({entry: {device_type: repo}}, inherit_mapping=False),
        ):
            selection = _Selection([t.module for t in group])
            kernels.kernelize(selection, mode=Mode.TRAINING, device=device_type)
    if targets:
        report.notes.append(
            f"kernels.kernelize(mode=TRAINING) on the approved modules only, with "
            f"LocalLayerRepository at {repo_path}"
        )
    return layers


def _apply_fallback(targets: list[Target], report: KernelizeReport) -> object:
    from ..hub import layers

    for t in targets:
        t.module.forward = MethodType(getattr(layers, _LAYER[t.entry]).forward, t.module)
    if targets:
        report.notes.append(
            "per-instance forward: module.forward = MethodType(Layer.forward, module)"
        )
    return layers


def _install_loss(model: nn.Module, report: KernelizeReport) -> None:
    try:
        from ..fused_loss import install_fused_cross_entropy
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__.rpartition('.')[0]}.fused_loss":  # not a deeper failure
            raise
        report.left_alone["cross_entropy"] = "hf_varlen.integrations.fused_loss is not available"
        return
    try:
        install_fused_cross_entropy(model)  # idempotent
    except (NotImplementedError, TypeError) as exc:  # a head/loss it cannot reproduce: keep HF's
        report.left_alone["cross_entropy"] = f"fused cross-entropy not installed: {exc}"
        return
    report.replaced["cross_entropy"] = [type(model).__name__]
    report.notes.append("fused linear cross-entropy: hf_varlen.install_fused_cross_entropy")


def _install_lora(model: nn.Module, report: KernelizeReport) -> None:
    from . import peft_lora

    done, left = peft_lora.install(model)
    report.left_alone.update(left)
    if done:
        report.replaced["lora"] = done
        report.layers["lora.Linear"] = "lora_linear"
        report.notes.append(
            "lora: peft lora.Linear forwards bound per instance to the one-op LoRA projection"
        )
    elif not left:
        report.left_alone["lora"] = "no peft LoRA layer in the model (wrap it with get_peft_model)"


# --------------------------------------------------------------------------------------- public


def kernelize(
    model: nn.Module,
    *,
    rope: bool = True,
    glu: bool = True,
    rmsnorm: bool = True,
    cross_entropy: bool = True,
    lora: bool = False,
    device: str | torch.device | None = None,
) -> KernelizeReport:
    """Replace the supported RMSNorm / RoPE / GLU-MLP forwards of ``model`` with fused kernels.

    Args:
        model: a built (weights loaded) transformers model, e.g. ``LlamaForCausalLM``.
        rope, glu, rmsnorm: which kinds to fuse; a kind set to False is restored to the original.
        cross_entropy: also install the fused linear cross-entropy loss
            (``hf_varlen.install_fused_cross_entropy``). False leaves the loss as it is (undo it
            with ``hf_varlen.uninstall_fused_cross_entropy``).
        lora: run peft's LoRA Linear layers (of a ``get_peft_model`` model) on the one-op LoRA
            projection ``hf_varlen.ops.lora_linear`` (base + scale * B(A(x)) with a hand-written
            backward; torch matmuls, any device). Off by default: see ``docs/lora.md``. Layers
            it cannot compute exactly (DoRA, lora_bias, dropout > 0, a quantised base) are left
            alone with the reason.
        device: device type the kernels will run on (default: where the parameters are). Pass
            ``"cuda"`` when kernelizing on CPU before ``model.to("cuda")``.

    Returns:
        A ``KernelizeReport``: the wiring used ("kernels" or "fallback" and why), the replaced
        modules per kind (``counts``, ``installed(kind)``), every candidate left alone with its
        reason, and ``undo()``. The model is changed in place, and only its own modules (see the
        module doc for the shared RoPE entry).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device_type = _device_type(model, device)
    problem = _kernels_problem()
    report = KernelizeReport(
        path="fallback" if problem else "kernels",
        path_reason=problem or "",
        _model=weakref.ref(model),
    )
    _undo(model)
    kinds = [kind for kind, on in (("rmsnorm", rmsnorm), ("rope", rope), ("glu", glu)) if on]
    if not kinds:  # only the loss asked for: nothing to plan, and no Triton import
        targets, report.left_alone = [], {}
    elif why := _triton_problem():  # hub/layers.py imports the Triton ops: do not plan
        targets, report.left_alone = [], dict.fromkeys(kinds, why)
    else:
        from ..hub import layers as helpers

        targets, report.left_alone = plan(model, helpers, rope=rope, glu=glu, rmsnorm=rmsnorm)
    if targets and (why := _device_problem(device_type)):
        report.left_alone.update({t.name: why for t in targets})
        targets = []
    if targets:
        report._hf_kernels = _stop_hf_kernels(model, report)
    if not targets:
        layers = None
    elif problem:
        layers = _apply_fallback(targets, report)
    else:
        layers = _apply_kernels(targets, device_type, report)

    for t in targets:  # count what really runs our layer now (kernels may fall back silently)
        layer = getattr(layers, _LAYER[t.entry])
        if getattr(t.module.__dict__.get("forward"), "__func__", None) is layer.forward:
            report.replaced.setdefault(_KIND.get(t.entry, "glu"), []).append(t.name)
            report.layers[t.owner] = _LAYER[t.entry]
        else:
            report.left_alone[t.name] = f"{t.owner}: approved but {report.path} did not replace it"
    if report.replaced.get("rope"):
        report.notes.append(
            f"rope: the `{ROPE_ENTRY}` entry is shared by every model of the same modeling file "
            "in this process (transformers calls it as a module-global)"
        )
    if cross_entropy:
        _install_loss(model, report)
    if lora:
        _install_lora(model, report)

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
