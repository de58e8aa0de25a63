"""Pure-PyTorch RMSNorm: the oracle for ``hf_varlen.ops.rmsnorm``.

Shapes: x (..., H), weight (H,); output (..., H). Rows are the last dimension.

Llama style (``add_unit_offset=False``, ``LlamaRMSNorm``; also Qwen2/3, Mistral):

    n = x.float() * rsqrt(mean(x.float() ** 2) + eps)
    y = weight * n.to(x.dtype)                  (dtype: promote(weight.dtype, x.dtype))

Gemma style (``add_unit_offset=True``, ``GemmaRMSNorm``/``Gemma2RMSNorm``):

    y = (n * (1.0 + weight.float())).to(x.dtype)

The code repeats transformers' lines so the rounding order matches: Llama rounds the normalised
row to the input dtype before the weight multiply, Gemma multiplies in fp32 and rounds once.
"""

from __future__ import annotations

import torch


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, add_unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim with HF's rounding order (see the module docstring)."""
    input_dtype = x.dtype
    h = x.to(torch.float32) if x.dtype != torch.float64 else x
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if add_unit_offset:
        w = weight.float() if weight.dtype != torch.float64 else weight
        return (n * (1.0 + w)).type_as(x)
    return weight * n.to(input_dtype)
