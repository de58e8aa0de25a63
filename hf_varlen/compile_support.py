"""torch.compile support for packed batches: compile once, whatever the pack.

A packed batch changes shape every step (token count, number of documents, longest document).
Left to automatic dynamic shapes, torch.compile compiles a static graph first and once more for
each of those the first time it changes; these helpers make the first graph symbolic in all of
them, and patch Dynamo where a model's own code would otherwise break the graph:

  * ``mark_dynamic_pack(batch)``: the token dimension and the document count of a batch dynamic;
  * ``symbolic_batch_ints()``: the batch's ints (``max_length_q/k``, ``num_items_in_batch``)
    symbolic from the first compilation;
  * ``checkpointed_side_effects(model)``: the Dynamo config patches a gradient-checkpointed model
    with kernels' attention wrappers needs.

``hf-varlen train --compile`` and ``VarlenSFTTrainer(torch_compile=True)`` use all three; a user
compiling a model by hand calls them around the compiled calls (docs/compile-and-graphs.md).
"""

from __future__ import annotations

import torch

__all__ = [
    "MAX_LENGTH_SOURCES",
    "NUM_ITEMS_SOURCES",
    "checkpointed_side_effects",
    "mark_dynamic_pack",
    "symbolic_batch_ints",
]

# Keys of a packed batch whose last dimension is the token count (seq_idx: TRL's padding-free
# document index per token), and the offsets (n_docs + 1).
_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "inputs_embeds", "token_type_ids", "seq_idx")
_OFFSET_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


# torch.compiler.config.dynamic_sources patterns for the collator's max_length_q/k ints, whether
# the compiled frame gets them as keyword arguments (L['kwargs']['max_length_q']) or as locals:
# dynamo then traces them symbolic from the first compilation instead of static-then-symbolic.
MAX_LENGTH_SOURCES = r".*\['max_length_[qk]'\]"
# The same for the loss's token count (Trainer's num_items_in_batch, when it is a Python int).
NUM_ITEMS_SOURCES = r".*\['num_items_in_batch'\]"


def symbolic_batch_ints():
    """Context manager for calls into a compiled packed model: torch.compile traces the batch's
    changing ints (``max_length_q/k``, ``num_items_in_batch``) symbolic from the first
    compilation (``torch.compiler.config.dynamic_sources``, appended to the user's own), where each
    would otherwise compile static first and once more when it changes. A no-op on a torch
    without that setting. Pair with ``mark_dynamic_pack`` for the tensors."""
    import contextlib

    config = torch.compiler.config
    if not hasattr(config, "dynamic_sources"):
        return contextlib.nullcontext()
    ours = ",".join((MAX_LENGTH_SOURCES, NUM_ITEMS_SOURCES))
    return config.patch(dynamic_sources=",".join(filter(None, (config.dynamic_sources, ours))))


def checkpointed_side_effects(model) -> dict[str, bool]:
    """Dynamo config patches for compiling ``model`` (pass them to ``torch._dynamo.config.patch``).

    transformers >= 5.25 decorates its attention classes with kernels' ``use_kernelized_func``
    (kernels >= 0.19; instances then carry ``_kernel_funcs``), whose forward sets and resets a
    module-global context variable on every call. Inside a gradient-checkpointed layer Dynamo
    refuses that mutation ("HOP: Unsafe side effect ... CompileableContextVar"): fullgraph fails,
    otherwise every layer runs eager, whatever the attention implementation. The variable is
    restored within the call, so the backward's recompute loses nothing by not replaying it:
    such models get ``skip_fwd_side_effects_in_bwd_under_checkpoint``; other models nothing."""
    if not hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return {}
    if any("_kernel_funcs" in vars(m) for m in model.modules()):
        return {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
    return {}


def mark_dynamic_pack(batch):
    """Mark a packed batch's token dimension and document count dynamic for torch.compile.

    Call on the batch as the compiled model receives it (after ``.to(device)``, which drops the
    marks). Without it, automatic dynamic shapes compile a static graph first and then recompile
    once for every dimension that changes later: the token count on the second pack, the number of
    documents (cu_seq_lens length) only when it first differs, possibly many packs later. With it,
    the first graph is already symbolic in both, and only the ``max_length_q/k`` ints (static in
    the first graph, symbolic after their first change) cost one more: at most 2 compilations.
    Ints cannot be marked; ``symbolic_batch_ints()`` around the compiled calls makes them symbolic
    from the start too (one compilation; what ``hf-varlen train --compile`` and
    ``VarlenSFTTrainer(torch_compile=True)`` do).
    Returns ``batch`` (marked in place; keys it does not know are left alone).
    """
    for key in _TOKEN_KEYS:
        t = batch.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1 if key != "inputs_embeds" else 1)
    for key in _OFFSET_KEYS:
        t = batch.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1)
    return batch
