"""Fused linear cross-entropy: ``fused_linear_cross_entropy(hidden, weight, labels, ...)``, the
lm_head matmul and the loss without materialising the (T, V) logits.

    function.py       the math and contract, validation, autograd.Function, public function
    chunks.py         row step launchers (Triton / torch), the chunk loop, row compaction
    kernel.py         the Triton row kernel (imported only where triton is installed)
    torch_library.py  the registered ops (what torch.compile calls)

Imports without triton: the CPU path runs the torch row step.
"""

from __future__ import annotations

from .chunks import ce_rows_torch, ce_rows_triton, default_chunk_size
from .function import fused_linear_cross_entropy

__all__ = ["ce_rows_torch", "ce_rows_triton", "default_chunk_size", "fused_linear_cross_entropy"]
