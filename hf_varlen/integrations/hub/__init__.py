"""The kernel-hub package: hf_varlen's fused layers and FlashAttention-style entry points in the
layout the ``kernels`` library loads.

    layers.py     kernels layers (RMSNorm, RoPE, SwiGLU/GeGLU MLPs) on ``hf_varlen/ops``
    attention.py  ``flash_attn_varlen_func`` / ``flash_attn_func`` on ``varlen_attention``
    package.py    builds the local package from ``hf_varlen/ops`` + the two files above;
                  ``enable_local_hub_kernel`` maps ``attn_implementation="hf-varlen/hf-varlen"``

``layers.py`` and ``attention.py`` are copied verbatim into the generated package (they keep
their place under ``integrations/hub/`` there), so they import ``...ops`` relatively; this file
is not copied.
"""

from __future__ import annotations

from .package import enable_local_hub_kernel, hub_kernel_path

__all__ = ["enable_local_hub_kernel", "hub_kernel_path"]
