"""Pure-PyTorch gated linear units: the oracle for ``hf_varlen.ops.glu``.

Shapes: gate, up (..., F); output (..., F). This is Hugging Face's MLP middle step,
``act_fn(gate_proj(x)) * up_proj(x)``, written with the same torch calls and in the same order:

    swiglu(gate, up)             = silu(gate) * up               (nn.SiLU, "silu"/"swish")
    geglu(gate, up, "none")      = gelu(gate) * up               (GELUActivation, "gelu")
    geglu(gate, up, "tanh")      = gelu_tanh(gate) * up          (GELUTanh, "gelu_pytorch_tanh")

Each torch op computes in fp32 internally and rounds its result to the input dtype, so in bf16 the
activation is rounded before the product. Run it on fp32/fp64 copies for the high-precision
reference and on the input dtype for the low-precision one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, exactly as HF's ``LlamaMLP`` computes it (autograd-capable)."""
    return F.silu(gate) * up


def geglu_reference(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "none"
) -> torch.Tensor:
    """``gelu(gate, approximate) * up``, as HF's ``GemmaMLP``/``Gemma2MLP`` compute it."""
    return F.gelu(gate, approximate=approximate) * up
