"""LoRA projection: ``lora_linear(x, weight, bias, lora_a, lora_b, scale)`` =
base(x) + scale * B(A(x)) with a hand-written backward (torch only; ``function.py``)."""

from __future__ import annotations

from .function import lora_linear

__all__ = ["lora_linear"]
