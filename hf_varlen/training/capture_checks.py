"""What in a built model keeps the training step from being captured in CUDA graphs.

``model_blockers(model)``: with gradient checkpointing on, a checkpointed layer that restores the
RNG state on the host (``preserve_rng_state`` not False) or a dropout that draws random numbers
(``graphs.py`` says why); ``hf-varlen train --cuda-graphs on`` raises with these reasons, ``auto``
steps eager and says why. The run's other requirements (device, processes, options) are
``graphs.graph_blockers``.
"""

from __future__ import annotations

import torch


def model_blockers(model: torch.nn.Module) -> list[str]:
    """Why this built model cannot be captured (empty: it can): with gradient checkpointing on, a
    checkpointed layer that restores the RNG state (``preserve_rng_state`` not False) or a dropout
    that draws random numbers (see the module docstring)."""
    checkpointed = [
        (name, m)
        for name, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
        and getattr(m, "_gradient_checkpointing_func", None) is not None
    ]
    if not checkpointed:
        return []
    reasons = []
    name, layer = checkpointed[0]
    keywords = getattr(layer._gradient_checkpointing_func, "keywords", {})
    if keywords.get("preserve_rng_state", True) is not False:
        reasons.append(
            f"gradient checkpointing of {name or 'the model'} restores the RNG state on the host "
            "in backward: enable it with preserve_rng_state=False (gradient_checkpointing_kwargs)"
        )
    dropouts = [
        f"{n} (p={m.p})"
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop"):
        value = getattr(config, key, 0.0)
        if isinstance(value, float | int) and value > 0:
            dropouts.append(f"config.{key}={value}")
    if dropouts:
        reasons.append(
            "gradient checkpointing with dropout (" + ", ".join(dropouts[:3]) + "): the recompute "
            "must redraw the same masks; set the dropout to 0 or turn checkpointing off"
        )
    return reasons
