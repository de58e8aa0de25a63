"""hf_varlen: packed, padding-free training for any Hugging Face causal LM.

``import hf_varlen`` registers ``attn_implementation="varlen_packed"`` with transformers, so

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="varlen_packed")

attends only within each packed document, on the fastest varlen attention backend available.
"""

from __future__ import annotations

from .backends import (
    available_backends,
    default_backend,
    model_backend,
    register_backend,
    set_backend,
)
from .collator import PackingCollator
from .functional import varlen_attention
from .integrations.hub_package import enable_local_hub_kernel, hub_kernel_path
from .integrations.kernelize import KernelizeReport, kernelize
from .integrations.loss import (
    install_fused_cross_entropy,
    is_fused_cross_entropy_installed,
    uninstall_fused_cross_entropy,
)
from .integrations.transformers import register
from .packing import (
    ExampleCountBatchSampler,
    PackingResult,
    PackingStats,
    TokenBudgetBatchSampler,
    bucket_ladder,
    pack_by_tokens,
)

__version__ = "0.1.0"

ATTN_IMPLEMENTATION = register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KernelizeReport",
    "enable_local_hub_kernel",
    "hub_kernel_path",
    "install_fused_cross_entropy",
    "is_fused_cross_entropy_installed",
    "kernelize",
    "uninstall_fused_cross_entropy",
    "PackingCollator",
    "PackingResult",
    "PackingStats",
    "TokenBudgetBatchSampler",
    "ExampleCountBatchSampler",
    "bucket_ladder",
    "pack_by_tokens",
    "available_backends",
    "default_backend",
    "model_backend",
    "register",
    "register_backend",
    "set_backend",
    "varlen_attention",
]
