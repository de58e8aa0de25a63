"""Pure-PyTorch LoRA projection: the oracle for ``hf_varlen.ops.lora``.

Shapes: x (..., K), weight (O, K), bias (O,) or None, lora_a (r, K), lora_b (O, r); output
(..., O). Written with the torch calls and in the order of peft's ``lora.Linear.forward`` with one
active adapter and no dropout: ``base_layer(x) + lora_B(lora_A(x)) * scaling``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``base(x) + B(A(x)) * scale``, exactly as peft computes it (autograd-capable)."""
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_a), lora_b) * scale
