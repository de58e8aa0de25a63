"""Install-time audit for the fused loss: what a causal LM's forward does to the logits between
its output projection and ``self.loss_function``.

``audit(cls, head_name)`` reads ``cls.forward``'s source (``ast``) once per class and classifies
every assignment to the logits variable: the projection itself, softcaps (tanh / softcap words),
multiplicative scales ``* self.<attr>`` / ``/ self.<attr>``, and benign ``.float()`` /
``.contiguous()`` / ``.to(...)``. Anything else raises NotImplementedError naming the statement,
so an unknown transform is refused at install, never reproduced wrongly.
``logit_transform(model, spec)`` resolves (logit_scale, softcap) for a call from the model/config.

Why the source and not an API: transformers has none for this. Its public seams say which *loss*
runs (``model.loss_function`` / ``loss_type`` -> ``LOSS_MAPPING``; ``check_causal_lm_loss`` uses
that), but not which logit post-processing the forward applies: a config attribute such as
``final_logit_softcapping`` exists on configs whose forward ignores it and vice versa, and a probe
run of the forward would need a full model forward at install (and fails on meta or sharded
weights). The audit is static, costs nothing per call, and fails closed.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap

import torch

_SOFTCAP_ATTRS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_SOFTCAP_WORDS = re.compile(r"tanh|softcap|soft_cap|\bcap\b")
_ATTR_CHAIN = r"self(?:\.\w+)+"


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What the model's forward does to the logits after the projection (read from its source)."""

    has_softcap: bool
    scale_ops: tuple[tuple[str, str], ...]  # ("*" | "/", "self.attr.chain")


def head_attr_name(model: torch.nn.Module) -> str:
    head = model.get_output_embeddings()
    for name, module in model.named_children():
        if module is head:
            return name
    raise NotImplementedError(
        f"{type(model).__name__}: get_output_embeddings() is not a direct child module; the fused "
        "loss needs the head called as self.<name>(hidden_states) in forward"
    )


@functools.lru_cache(maxsize=64)
def audit(cls: type, head_name: str) -> HeadSpec:
    """Classify every assignment to the logits in ``cls.forward``; unknown transforms raise."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError) as err:
        raise NotImplementedError(
            f"{cls.__name__}.forward: source unavailable ({err}); cannot audit it"
        ) from err
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]
    if not any(c.func.attr == "loss_function" for c in calls):
        raise NotImplementedError(
            f"{cls.__name__}.forward does not compute its loss with self.loss_function(...); "
            "the fused cross-entropy cannot stand in for it"
        )
    head_call = f"self.{head_name}("
    statements = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AugAssign)),
        key=lambda n: n.lineno,
    )
    names = {
        t.id
        for n in statements
        if isinstance(n, ast.Assign) and head_call in ast.unparse(n.value)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    if not names:
        raise NotImplementedError(
            f"{cls.__name__}.forward: no `logits = self.{head_name}(...)` assignment found"
        )
    var = "|".join(sorted(names))
    projection = re.compile(
        rf"^self\.{head_name}\(.*\)(?:\.float\(\)|\.contiguous\(\))?(?:\s*([*/])\s*({_ATTR_CHAIN}))?$"
    )
    scale = re.compile(rf"^(?:{var})(?:\.float\(\))?\s*([*/])\s*({_ATTR_CHAIN})$")
    benign = re.compile(rf"^(?:{var})(?:\.float\(\)|\.contiguous\(\)|\.to\([^()]*\))$")
    has_softcap, scale_ops, unknown = False, [], []
    for node in statements:
        target = node.target if isinstance(node, ast.AugAssign) else node.targets[0]
        if not (isinstance(target, ast.Name) and target.id in names):
            continue
        value = (
            node.value if isinstance(node, ast.Assign) else ast.BinOp(target, node.op, node.value)
        )
        text = ast.unparse(value)
        if m := projection.match(text):
            if m.group(1):
                scale_ops.append((m.group(1), m.group(2)))
        elif _SOFTCAP_WORDS.search(text):
            has_softcap = True
        elif m := scale.match(text):
            if has_softcap:
                unknown.append(f"{target.id} = {text}   (a scale after the softcap)")
            scale_ops.append((m.group(1), m.group(2)))
        elif not benign.match(text):
            unknown.append(f"{target.id} = {text}")
    if unknown:
        raise NotImplementedError(
            f"{cls.__name__}.forward transforms the logits in a way the fused cross-entropy "
            f"does not reproduce: {unknown}"
        )
    return HeadSpec(has_softcap=has_softcap, scale_ops=tuple(scale_ops))


def logit_transform(model: torch.nn.Module, spec: HeadSpec) -> tuple[float, float | None]:
    """(logit_scale, softcap) for this call, resolved from the model / its config."""
    scale = 1.0
    for op, chain in spec.scale_ops:
        value = model
        for attr in chain.split(".")[1:]:
            value = getattr(value, attr)
        value = float(value)
        scale = scale * value if op == "*" else scale / value
    softcap = None
    if spec.has_softcap:
        config = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        present = [a for a in _SOFTCAP_ATTRS if hasattr(config, a)]
        if not present:
            raise NotImplementedError(
                f"{type(model).__name__}: the forward softcaps the logits but the config has "
                f"none of {_SOFTCAP_ATTRS}"
            )
        softcap = next(
            (getattr(config, a) for a in present if getattr(config, a) is not None), None
        )
    return scale, softcap


def check_causal_lm_loss(model: torch.nn.Module) -> None:
    """Raise NotImplementedError unless ``model.loss_function`` is HF's ``ForCausalLMLoss`` (the
    loss the fused path reproduces: shift, cross-entropy, ``num_items_in_batch`` normalisation)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss = model.loss_function
    if loss is not ForCausalLMLoss:
        name = getattr(loss, "__qualname__", type(loss).__name__)
        raise NotImplementedError(
            f"{type(model).__name__}.loss_function is {name} (loss_type="
            f"{getattr(model, 'loss_type', None)!r}), not transformers' ForCausalLMLoss; the fused "
            "cross-entropy reproduces only that loss"
        )
