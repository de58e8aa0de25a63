"""What one attention call is: where the documents are (``VarlenMetadata``) and how to attend
(``AttentionParams``). Both are frozen; the public layer builds and validates them once per call
and hands them to the backend, so a backend never re-reads user keywords.

    VarlenMetadata: cu_seqlens_q/k (n_docs + 1,) int32 offsets, max_seqlen_q/k Python ints,
        indices_q/k (T_real,) int64 or None (only the transformers padding-mask path sets them).
    AttentionParams: window (left, right) with causality folded in (FA-2 semantics, -1 = unbounded,
        (-1, 0) = causal, (-1, -1) = full), softmax_scale (resolved float), softcap (0 = off),
        dropout_p, deterministic (already resolved against the environment), sinks ((H_q,)
        per-head attention-sink logits, gpt-oss style, or None).

This module sits below the backends and imports nothing from the public layer; ``VarlenMetadata``
is defined in ``hf_varlen.metadata`` (beside the builders that check it) and re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..metadata import VarlenMetadata  # re-exported: the class lives with its builders
from ..ops.common import causal_window

__all__ = ["AttentionParams", "VarlenMetadata"]


@dataclass(frozen=True)
class AttentionParams:
    """How to attend; see the module docstring. Build with ``AttentionParams.create``."""

    window: tuple[int, int]
    softmax_scale: float
    softcap: float = 0.0
    dropout_p: float = 0.0
    deterministic: bool = False
    # (H_q,) sink logits: exp(sinks[h]) joins each row's softmax denominator, with no value
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @classmethod
    def create(
        cls,
        *,
        head_dim: int,
        causal: bool,
        window_size: tuple[int, int] = (-1, -1),
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        dropout_p: float = 0.0,
        deterministic: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> AttentionParams:
        """From already validated FA-2 style keywords (the one place causality is folded in)."""
        return cls(
            window=causal_window(causal, window_size),
            softmax_scale=head_dim**-0.5 if softmax_scale is None else float(softmax_scale),
            softcap=float(softcap),
            dropout_p=float(dropout_p),
            deterministic=bool(deterministic),
            sinks=sinks,
        )

    @property
    def causal(self) -> bool:
        """Bottom-right causal: no key right of the diagonal (a window with right == 0)."""
        return self.window[1] == 0

    @property
    def sliding_window(self) -> bool:
        """A bounded window beyond plain causal / full attention."""
        return self.window not in ((-1, 0), (-1, -1))
