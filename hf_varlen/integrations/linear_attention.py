"""Hybrid models (Qwen3-Next, Qwen3.5, OLMo-hybrid): linear-attention layers that restart their
state at every document boundary of a packed batch.

Their full-attention layers go through ``varlen_packed`` like any other model. Their gated
DeltaNet layers carry a recurrent state (and a short causal convolution) along the row: in a
packed row that state would flow from one document into the next. transformers 5.25 passes the
collator's ``cu_seq_lens_q`` to flash-linear-attention's ``chunk_gated_delta_rule`` when that
package runs, but its short convolution gets no document offsets (the torch path and the
``causal_conv1d`` package both convolve across the boundary), its torch fallback raises for
``cu_seqlens``, and a batch packed by ``position_ids`` alone reaches these layers with no offsets
at all.

transformers offers no seam for a whole linear-attention layer (its ``use_kernelized_func`` hooks
replace single functions through the ``kernels`` hub and get no offsets for the convolution), so
``install_linear_attention(model)`` gives each gated DeltaNet *instance* a subclass of its own class
whose ``forward`` is the packed one (transformers' class and files stay untouched;
``uninstall_linear_attention`` gives the instance its class back), as FSDP2 does for the modules
it shards. Not an instance ``forward`` attribute: transformers >= 5.25 loads models kernelized by
default and re-kernelizes on every ``train()`` / ``eval()`` switch, and the ``kernels`` library
then drops each instance ``forward`` of a layer that uses kernel functions (these layers do).

Two paths for a packed row (``install_linear_attention(model, path=...)``):

- ``"loop"``: the layer's own forward once per document (cache off, no padding mask): each
  document alone by construction, on any device (flash-linear-attention used per document where
  transformers finds it). One host read of the offsets per batch; eager only.
- ``"fla"``: flash-linear-attention's varlen ``chunk_gated_delta_rule(..., cu_seqlens=...)`` over
  the whole row at once (``linear_attention_fla``): CUDA tensors, the ``fla`` package (>= 0.5)
  (``pip install 'hf_varlen[fla]'``) and a layer shape it knows (Qwen3-Next, Qwen3.5,
  OLMo-hybrid).
- ``"auto"`` (default): ``"fla"`` where it can run, else ``"loop"``; logs its choice once per
  layer class, device, choice and reason (logger ``hf_varlen``). An explicit ``"fla"`` that cannot run
  raises one line naming why, at install when it cannot run anywhere, else at the forward.

Unpacked and padded batches, and decoding, go to the layer's own forward unchanged. Both paths
read the document offsets on the host once per batch, which a CUDA graph cannot capture:
``capture_blockers(model)`` says so for ``hf-varlen train`` and the captured Trainer step.

Shapes: hidden_states (1, T, hidden) for a packed row (T tokens, documents at cu_seq_lens_q),
(B, T, hidden) otherwise; the output has the same shape.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref

import torch
from torch import nn

from ..ops.common import TensorCache
from . import linear_attention_fla as fla_path

logger = logging.getLogger("hf_varlen")
PATHS = ("auto", "loop", "fla")

_BASE = "_hf_varlen_linear_attention_base"  # class attribute of our subclasses: the layer's class
_PATH = "_hf_varlen_linear_attention_path"  # instance attribute: the path asked for
_LOGGED: set[tuple] = set()  # (layer class, device type, choice, why) "auto" has logged
# id(config) -> weakref(config), for the configs of models whose layers are installed (configs
# are unhashable dataclasses)
_INSTALLED: dict[int, weakref.ref] = {}
_PACKED_CLASSES: dict[type, type] = {}  # a gated DeltaNet class -> its packed subclass
_BOUNDS = TensorCache(size=4)
_OFFSET_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def is_linear_attention_layer(module: nn.Module) -> bool:
    """A gated DeltaNet token mixer (transformers names them ``<Model>GatedDeltaNet``)."""
    return type(module).__name__.endswith("GatedDeltaNet")


# config fields listing each layer's kind, and the kinds that carry a state along the row
_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types", "layers_block_types")
_STATEFUL = re.compile(r"linear|mamba|recurrent|conv|ssm|lightning|rnn|delta", re.IGNORECASE)


def stateful_layer_kinds(config) -> list[str]:
    """The kinds of layer in ``config`` (or its text config) that carry a state along the row
    (linear attention, Mamba, RG-LRU, short convolutions), sorted; [] for a pure transformer."""
    kinds: set[str] = set()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in {id(config): config, id(text): text}.values():
        fields = vars(cfg)
        for key in _KIND_FIELDS:
            value = fields.get(key)
            if isinstance(value, (list, tuple)):
                kinds |= {str(t) for t in value if _STATEFUL.search(str(t))}
        if any(k.startswith(("mamba_", "ssm_")) for k in fields):
            kinds.add("mamba")
    return sorted(kinds)


def has_linear_attention(config) -> bool:
    """Whether ``config`` declares gated-DeltaNet-style ``linear_attention`` layers."""
    return "linear_attention" in stateful_layer_kinds(config)


def is_installed(config) -> bool:
    ref = _INSTALLED.get(id(config)) if config is not None else None
    return ref is not None and ref() is config


def _configs(model: nn.Module) -> list:
    out = []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and all(cfg is not c for c in out):
            out.append(cfg)
            if hasattr(cfg, "get_text_config") and cfg.get_text_config() is not cfg:
                out.append(cfg.get_text_config())
    return out


def _packed_class(cls: type) -> type:
    """The subclass of ``cls`` with the packed forward (same name, so that logs, reprs and
    ``is_linear_attention_layer`` read as before)."""
    sub = _PACKED_CLASSES.get(cls)
    if sub is None:
        attrs = {"forward": _packed_forward, _BASE: cls, "__qualname__": cls.__qualname__}
        sub = _PACKED_CLASSES[cls] = type(cls.__name__, (cls,), attrs)
    return sub


def is_packed_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a gated DeltaNet layer installed by ``install_linear_attention``."""
    return hasattr(type(module), _BASE)


def capture_blockers(model: nn.Module) -> list[str]:
    """Why a CUDA graph cannot capture a training step of ``model`` (empty: nothing here blocks
    it): installed linear-attention layers split the row per document from the offsets' values on
    the host every batch (both paths). The CLI and the captured Trainer steps read this one rule."""
    packed = [name for name, m in model.named_modules() if is_packed_layer(m)]
    if not packed:
        return []
    return [
        f"{len(packed)} linear-attention layer(s) ({packed[0]}, ...) read the document offsets "
        "on the host every batch, which a CUDA graph cannot capture"
    ]


def _fla_missing(layer: nn.Module) -> str | None:
    """Why the FLA path cannot serve ``layer`` on any device, or None."""
    if fla_path.fla_chunk_gated_delta_rule() is None:
        return "flash-linear-attention is not installed (pip install 'hf_varlen[fla]')"
    if not fla_path.has_fla_adapter(layer):
        return f"{type(layer).__name__} has a layer shape the FLA path does not know"
    return None


def install_linear_attention(model: nn.Module, path: str = "auto") -> int:
    """Make every gated DeltaNet layer of ``model`` restart at document boundaries; returns how
    many layers were changed (0 for a model without any). Idempotent; a later call sets ``path``
    ("auto", "loop" or "fla": see the module docstring)."""
    if path not in PATHS:
        raise ValueError(f"install_linear_attention: path must be one of {PATHS}, got {path!r}")
    layers = [m for m in model.modules() if is_linear_attention_layer(m)]
    why = next((w for m in layers if (w := _fla_missing(m)) is not None), None)
    if path == "fla" and why is not None:
        raise ValueError(f"install_linear_attention(path='fla'): {why}; use path='auto' or 'loop'")
    n = 0
    for module in layers:
        if not is_packed_layer(module):
            module.__class__ = _packed_class(type(module))
        module.__dict__[_PATH] = path
        n += 1
    if n:
        for cfg in _configs(model):
            _INSTALLED[id(cfg)] = weakref.ref(cfg)
    return n


def uninstall_linear_attention(model: nn.Module) -> int:
    """Undo ``install_linear_attention``; returns how many layers were restored."""
    n = 0
    for module in model.modules():
        if _BASE in vars(type(module)):  # ours, not a subclass made later (e.g. by FSDP2)
            module.__class__ = getattr(type(module), _BASE)
            module.__dict__.pop(_PATH, None)
            n += 1
    for cfg in _configs(model):
        if is_installed(cfg):
            del _INSTALLED[id(cfg)]
    return n


def _document_bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    """cu_seq_lens (n_docs + 1,) -> [(start, end)] of the non-empty documents (one host read per
    batch, shared by every layer: the same tensor object reaches all of them)."""

    def build():
        # intended: one host read per batch; this per-document loop is eager-only
        edges = cu.tolist()
        return [(s, e) for s, e in zip(edges[:-1], edges[1:]) if e > s]

    return _BOUNDS.get_or_compute(cu, build)


def _packed_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    original = functools.partial(getattr(type(self), _BASE).forward, self)  # the layer's own

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if hidden_states.shape[0] != 1:
        raise ValueError(
            f"{type(self).__name__}: a packed batch (cu_seq_lens_q) must be one row, got "
            f"hidden_states of shape {tuple(hidden_states.shape)}"
        )
    if cache is not None:
        raise ValueError(
            f"{type(self).__name__}: a packed batch (cu_seq_lens_q) cannot fill a recurrent "
            "cache (each document has its own state); call the model with use_cache=False"
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"{type(self).__name__}: a packed batch (cu_seq_lens_q) carries no padding mask; "
            "drop attention_mask"
        )
    rest = {k: v for k, v in kwargs.items() if k not in _OFFSET_KWARGS}
    bounds = _document_bounds(cu)
    if bounds[-1][1] != hidden_states.shape[1]:
        raise ValueError(
            f"{type(self).__name__}: cu_seq_lens_q ends at {bounds[-1][1]} but the packed row has "
            f"{hidden_states.shape[1]} tokens"
        )
    if _choose_path(self, hidden_states) == "fla":
        rule = fla_path.fla_chunk_gated_delta_rule()
        return fla_path.fla_packed_forward(self, hidden_states, cu, bounds, rule)
    outs = [original(hidden_states[:, s:e], cache=None, **rest) for s, e in bounds]
    return torch.cat(outs, dim=1)


def _choose_path(layer: nn.Module, hidden: torch.Tensor) -> str:
    """ "loop" or "fla" for this packed row (see the module docstring)."""
    want = layer.__dict__.get(_PATH, "auto")
    if want == "loop":
        return "loop"
    why = _fla_missing(layer)
    if why is None and not fla_path.fla_runs_on(hidden.device):
        why = f"FLA's kernels run on CUDA, this batch is on {hidden.device.type}"
    if want == "fla":
        if why is not None:
            raise ValueError(
                f"install_linear_attention(path='fla'): {why}; use path='auto' or 'loop'"
            )
        return "fla"
    choice = "loop" if why else "fla"
    key = (type(layer), hidden.device.type, choice, why)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(
            "hf_varlen: linear attention 'auto' chose %r for %s on %s%s",
            choice,
            type(layer).__name__,
            hidden.device.type,
            f" ({why})" if why else "",
        )
    return choice
