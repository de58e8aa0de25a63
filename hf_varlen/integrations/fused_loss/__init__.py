"""Fused linear cross-entropy for any HF causal LM: the loss without the (tokens x vocab) logits.

``install_fused_cross_entropy(model)`` wraps the model's ``forward`` (an instance attribute, the
same seam TRL's ``add_fused_lm_head`` uses; no model source is rewritten). When a call is a
training call with ``labels`` the wrapper runs the model's OWN forward with two substitutions,
installed with the wrapper (never added and removed per call: torch.compile cannot trace the
removal on every torch version) and active only while such a call runs (``_State.call``):

  1. the output-embedding module (``model.get_output_embeddings()``, looked up per call, so PEFT or
     FSDP wrappers added later are seen) gets an instance ``forward`` that computes the fused loss
     from the hidden states it receives and returns a placeholder of shape (..., 0) instead of
     logits. It runs inside the module's ``__call__``, so FSDP2 / DeepSpeed ZeRO-3 hooks gather the
     weight around it exactly as they would for the projection;
  2. ``model.loss_function`` (a documented transformers setter) returns that loss with the
     normalisation of HF's ``ForCausalLMLoss``: ``sum / num_items_in_batch`` when given, else the
     mean over label tokens. A batch without label tokens (or ``num_items_in_batch`` 0) gives loss
     0 and zero gradients; HF's gradients are zero too, its loss value is NaN (0 / 0).

Everything else stays the model's code: ``logits_to_keep`` slicing, MoE router aux losses added to
the loss, ``output_hidden_states``, VLM backbones. HF's causal shift is reproduced exactly
(``labels`` padded with -100 and shifted by one, or ``shift_labels`` used as given), and the op
receives the aligned labels. Post-projection logit transforms are read from the forward's source
at install time; supported: softcaps (Gemma2/3, ``final_logit_softcapping``, ``logits_soft_cap``),
multiplicative scales ``* self.<attr>`` / ``/ self.<attr>`` (Cohere ``logit_scale``, Granite
``logits_scaling``, Falcon-H1 ``lm_head_multiplier``), dtype casts. Anything else, or a loss not
computed through ``self.loss_function``, or a ``loss_function`` other than HF's ``ForCausalLMLoss``,
raises NotImplementedError at install (``audit.py`` says why the source is read).

Returned outputs: with the fused path, ``logits`` is None in a ModelOutput (a (..., 0) placeholder
in a tuple when ``return_dict=False``). Without labels, or in eval mode, the original forward
runs and returns real logits. Public per-call keyword of the wrapped forward: ``fused_loss=True``
/ ``False`` forces either path (``fused_loss=True`` for eval-loss loops that need no logits); it is
consumed by the wrapper and never reaches the model's own forward.

lm_head kinds (``head.py``): ``nn.Linear`` (weight possibly tied to the embeddings: the
gradient is added to the shared parameter by autograd); a PEFT LoRA layer; a PEFT
``ModulesToSaveWrapper`` (its active copy). FSDP2: when lm_head is its own FSDP unit the head's
pre-forward hook unshards the weight before our forward runs; a weight still sharded (a DTensor)
is gathered with ``full_tensor()`` (differentiable; logged once). Tested with FSDP2 on 2 CPU ranks
(gloo, lm_head its own unit); not yet on GPUs.
TRL 1.16's SFTTrainer calls ``model(..., fused_lm_head=True)`` (its own fused head, which also never
materialises logits): such calls pass straight through.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

import torch
import torch.nn.functional as F

from ...ops.common import IGNORE_INDEX, check_int
from .audit import HeadSpec, audit, check_causal_lm_loss, head_attr_name, logit_transform
from .head import head_params

_STATE_ATTR = "_hf_varlen_fused_ce"


@dataclasses.dataclass
class _State:
    options: dict[str, Any]  # the install's keywords of fused_linear_cross_entropy, by name
    spec: HeadSpec
    previous_forward: object  # the instance forward we wrapped, or None (the class forward)
    forward: object  # our bound wrapper, to check that uninstall removes what we installed
    labels_position: int | None = None  # of `labels` in the forward's positional arguments
    loss_function: object = None  # our _LossFunction, to check that uninstall removes it
    previous_loss_function: object = None  # the instance _loss_function we replaced, or None
    heads: list = dataclasses.field(default_factory=list)  # [(head, its previous forward)]
    call: object = None  # the _Call of the fused forward running now, else None


@dataclasses.dataclass
class _Call:
    labels: torch.Tensor
    shift_labels: torch.Tensor | None
    loss_sum: torch.Tensor | None = None
    n_tokens: torch.Tensor | None = None
    returned: bool = False


# ----------------------------------------------------------------------------------------------
# Per-call substitutions
# ----------------------------------------------------------------------------------------------


class _HeadForward:
    """The output embedding's instance ``forward`` while the fused loss is installed.

    Installed once per head (not per call: torch.compile cannot trace removing an instance
    attribute again on every torch version), it computes the fused loss during a fused call
    (``state.call`` set by the wrapped model forward) and runs the head's own forward otherwise."""

    def __init__(self, model, head, state: _State, previous):
        self.model, self.head, self.state, self.previous = model, head, state, previous

    def __call__(self, hidden, *args, **kwargs):
        call = self.state.call
        if call is None:
            if self.previous is not None:
                return self.previous(hidden, *args, **kwargs)
            return type(self.head).forward(self.head, hidden, *args, **kwargs)
        return _fused_head_forward(self.model, self.head, self.state, call, hidden, *args, **kwargs)


class _LossFunction:
    """``model.loss_function`` while the fused loss is installed (the documented transformers
    setter stores it as ``_loss_function``): the fused loss's normalisation during a fused call,
    the model's own loss function (as it was at install) otherwise."""

    def __init__(self, state: _State, original):
        self.state, self.original = state, original

    def __call__(self, logits=None, labels=None, vocab_size=None, **kwargs):
        call = self.state.call
        if call is None or call.loss_sum is None:  # not through our head: the plain loss
            return self.original(logits, labels, vocab_size, **kwargs)
        return _fused_loss(call, **kwargs)


def _fused_head_forward(
    model, head, state: _State, call: _Call, hidden: torch.Tensor, *args, **kwargs
):
    if call.loss_sum is not None:
        raise RuntimeError(
            f"{type(model).__name__}: the output embeddings were called twice in one forward; "
            "the fused cross-entropy supports one head call per step (pass fused_loss=False)"
        )
    if call.shift_labels is not None:
        labels = call.shift_labels
    else:  # HF ForCausalLMLoss: pad with ignore_index, shift left by one
        labels = F.pad(call.labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    labels = labels.to(hidden.device).reshape(-1)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    if labels.numel() != hidden2.shape[0]:
        raise ValueError(
            f"labels: {labels.numel()} shifted labels for {hidden2.shape[0]} hidden states "
            f"reaching the head (hidden {tuple(hidden.shape)}); with labels, logits_to_keep must "
            "keep every position"
        )
    from ...ops.cross_entropy import fused_linear_cross_entropy  # imports triton: only when used

    weight, bias = head_params(head)
    if not torch.is_autocast_enabled(hidden.device.type) and hidden2.dtype != weight.dtype:
        hidden2 = hidden2.to(weight.dtype)
    logit_scale, softcap = logit_transform(model, state.spec)
    call.loss_sum = fused_linear_cross_entropy(
        hidden2,
        weight,
        labels,
        bias=bias,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        softcap=softcap,
        logit_scale=logit_scale,
        **state.options,  # chunk_size, z_loss, label_smoothing, backend, drop_ignored_tokens
    )
    call.n_tokens = (labels != IGNORE_INDEX).sum()
    return hidden.new_empty((*hidden.shape[:-1], 0))


def _fused_loss(call: _Call, **kwargs):
    ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
    if ignore_index != IGNORE_INDEX:
        raise ValueError(
            f"ignore_index: the fused cross-entropy uses {IGNORE_INDEX}, got {ignore_index}"
        )
    call.returned = True
    num_items = kwargs.get("num_items_in_batch")
    if num_items is None:
        num_items = call.n_tokens
    # A count of 0 means no label token anywhere, so loss_sum is an empty sum (0): dividing by 1
    # keeps loss 0 with zero gradients, where 0 / 0 would put NaN into every weight (HF's own loss
    # value is NaN there; its gradients are zero, as ours are).
    if torch.is_tensor(num_items):
        num_items = num_items.to(call.loss_sum.device).clamp(min=1)
    else:  # sym_max: under torch.compile a symbolic count gets no guard (max() would add one)
        num_items = torch.sym_max(num_items, 1)
    return call.loss_sum / num_items


def _drop_logits(output):
    try:
        from transformers.utils import ModelOutput
    except ImportError:  # pragma: no cover - transformers is a dependency
        return output
    if isinstance(output, ModelOutput) and "logits" in output:
        return type(output)(**{k: v for k, v in output.items() if k != "logits"})
    return output


def _labels_position(forward) -> int | None:
    """Index of ``labels`` among the positional arguments after ``self`` (read once at install:
    ``inspect.signature`` cannot run inside a torch.compile trace)."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == "labels":
            return i
    return None


def _labels_from(position: int | None, args, kwargs):
    if "labels" in kwargs or not args:
        return kwargs.get("labels")
    return args[position] if position is not None and position < len(args) else None


def _forward(model, *args, fused_loss: bool | None = None, **kwargs):
    state: _State = model.__dict__[_STATE_ATTR]
    # `is None`, not truthiness: dynamo 2.11 cannot branch on a bound method
    inner = state.previous_forward
    if inner is None:
        inner = functools.partial(type(model).forward, model)
    labels = _labels_from(state.labels_position, args, kwargs)
    use = model.training if fused_loss is None else bool(fused_loss)
    if not use or labels is None or kwargs.get("fused_lm_head"):
        return inner(*args, **kwargs)

    call = _Call(labels=labels, shift_labels=kwargs.get("shift_labels"))
    head = model.get_output_embeddings()
    ours = head.__dict__.get("forward")
    if not isinstance(ours, _HeadForward) or ours.state is not state:  # a new head (PEFT, resize)
        _install_head(model, head, state)
    if model.__dict__.get("_loss_function") is not state.loss_function:
        raise RuntimeError(
            f"{type(model).__name__}.loss_function was replaced after the fused loss was "
            "installed; set it before install_fused_cross_entropy, or pass fused_loss=False"
        )
    state.call = call
    try:
        output = inner(*args, **kwargs)
    finally:
        state.call = None
    if call.loss_sum is not None and not call.returned:
        raise RuntimeError(
            f"{type(model).__name__}: the fused loss was computed but the forward never asked "
            "self.loss_function for it; its loss would be wrong (pass fused_loss=False)"
        )
    return _drop_logits(output)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside PEFT (``PeftModel``, ``LoraModel``) / DDP wrappers."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if hasattr(model, "get_base_model") and callable(model.get_base_model):  # peft.PeftModel
        model = model.get_base_model()
    # peft's tuner (LoraModel, a PeftModel's ``base_model``) keeps the transformers model as
    # ``.model``; told from its class's module, never by importing peft
    inner = getattr(model, "model", None)
    if type(model).__module__.startswith("peft.tuners.") and isinstance(inner, torch.nn.Module):
        model = inner
    return model


def install_fused_cross_entropy(
    model: torch.nn.Module,
    *,
    chunk_size: int | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    backend: str = "auto",
    drop_ignored_tokens: bool = False,
) -> torch.nn.Module:
    """Make ``model``'s training loss the fused linear cross-entropy (see the module doc).

    Idempotent: a second call only updates the options. Works on a transformers causal LM, or a
    PEFT / DDP wrapper around one (the inner model is patched). Raises NotImplementedError at
    install for forwards whose logit post-processing or loss it cannot reproduce. Returns ``model``.

    Calls of the wrapped forward accept ``fused_loss: bool | None`` (default None: fused in
    training mode when ``labels`` are given; True: also in eval mode, returning no logits; False:
    the original forward). Undo with :func:`uninstall_fused_cross_entropy`.

    ``drop_ignored_tokens``: see ``hf_varlen.ops.fused_linear_cross_entropy`` (False, the default:
    no host sync, CUDA-graph safe; True: fewer FLOPs when many labels are masked, one sync per
    step).
    """
    lm = _causal_lm(model)
    if not isinstance(lm, torch.nn.Module) or not callable(
        getattr(lm, "get_output_embeddings", None)
    ):
        raise TypeError(f"model: expected a transformers causal LM, got {type(lm).__name__}")
    if not isinstance(getattr(type(lm), "loss_function", None), property):
        raise TypeError(
            f"model: {type(lm).__name__} has no settable loss_function (not a PreTrainedModel)"
        )
    if lm.get_output_embeddings() is None:
        raise TypeError(
            f"model: {type(lm).__name__} has no output embeddings (not a causal LM head model)"
        )
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")
    check_int("chunk_size", chunk_size, 1, allow_none=True)
    if not 0.0 <= label_smoothing < 1.0 or z_loss < 0.0:
        raise ValueError(
            f"label_smoothing / z_loss: expected [0, 1) / >= 0, got {label_smoothing} / {z_loss}"
        )
    if not isinstance(drop_ignored_tokens, bool):
        raise TypeError(f"drop_ignored_tokens: expected True or False, got {drop_ignored_tokens!r}")
    options = dict(
        drop_ignored_tokens=drop_ignored_tokens,
        chunk_size=chunk_size,
        z_loss=float(z_loss),
        label_smoothing=float(label_smoothing),
        backend=backend,
    )
    state = lm.__dict__.get(_STATE_ATTR)
    if state is not None:
        state.options = options
        return model
    check_causal_lm_loss(lm)
    spec = audit(type(lm), head_attr_name(lm))

    @functools.wraps(type(lm).forward)  # keeps the signature: Trainer/generate inspect it
    def forward(self, *args, **kwargs):
        return _forward(self, *args, **kwargs)

    bound = types.MethodType(forward, lm)
    state = _State(
        options, spec, lm.__dict__.get("forward"), bound, _labels_position(type(lm).forward)
    )
    state.previous_loss_function = lm.__dict__.get("_loss_function")
    state.loss_function = _LossFunction(state, lm.loss_function)  # the loss as it is now
    lm.__dict__[_STATE_ATTR] = state
    lm.__dict__["_loss_function"] = state.loss_function
    _install_head(lm, lm.get_output_embeddings(), state)
    lm.forward = bound
    return model


def _install_head(lm, head, state: _State) -> None:
    previous = head.__dict__.get("forward")
    head.__dict__["forward"] = _HeadForward(lm, head, state, previous)  # see _HeadForward
    state.heads.append((head, previous))


def uninstall_fused_cross_entropy(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`install_fused_cross_entropy` (a no-op when it is not installed)."""
    lm = _causal_lm(model)
    state = lm.__dict__.get(_STATE_ATTR)
    if state is None:
        return model
    if lm.__dict__.get("forward") is not state.forward:
        raise RuntimeError(
            f"{type(lm).__name__}.forward was wrapped again after the fused loss was installed; "
            "undo that wrapper first"
        )
    if state.previous_forward is None:
        del lm.forward
    else:
        lm.forward = state.previous_forward
    _restore(lm, "_loss_function", state.loss_function, state.previous_loss_function)
    for head, previous in state.heads:
        ours = head.__dict__.get("forward")
        if isinstance(ours, _HeadForward) and ours.state is state:
            _restore(head, "forward", ours, previous)
    del lm.__dict__[_STATE_ATTR]
    return model


def _restore(obj, name: str, ours, previous) -> None:
    """Put back the instance attribute we replaced (unless someone replaced ours since)."""
    current = obj.__dict__.get(name)
    if current is not ours:
        return
    if previous is None:
        del obj.__dict__[name]
    else:
        obj.__dict__[name] = previous


def is_fused_cross_entropy_installed(model: torch.nn.Module) -> bool:
    """True when :func:`install_fused_cross_entropy` is in effect on ``model`` (or its inner LM)."""
    return _STATE_ATTR in _causal_lm(model).__dict__
