"""hf_varlen: packed, padding-free training for any Hugging Face causal LM.

``import hf_varlen`` registers ``attn_implementation="varlen_packed"`` with transformers, so

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="varlen_packed")

attends only within each packed document, on the fastest varlen attention backend available.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from ._lazy import lazy_getattr as _lazy_getattr

__version__ = "0.1.0"

# The public names, resolved on first use (module ``__getattr__``): importing them all would pull
# in torch and transformers (~5 s), which ``hf-varlen --help`` and the packing helpers do not need.
_LAZY = {
    "available_backends": "backends",
    "default_backend": "backends",
    "model_backend": "backends",
    "register_backend": "backends",
    "set_backend": "backends",
    "PackingCollator": "collator",
    "check_pending_offsets": "coverage",
    "varlen_attention": "functional",
    "enable_local_hub_kernel": "integrations.hub.package",
    "hub_kernel_path": "integrations.hub.package",
    "KernelizeReport": "integrations.kernelize",
    "kernelize": "integrations.kernelize",
    "install_fused_cross_entropy": "integrations.fused_loss",
    "install_linear_attention": "integrations.linear_attention",
    "uninstall_linear_attention": "integrations.linear_attention",
    "is_fused_cross_entropy_installed": "integrations.fused_loss",
    "uninstall_fused_cross_entropy": "integrations.fused_loss",
    "register": "integrations.transformers",
    "MultimodalPackingCollator": "multimodal",
    "OffsetsCheckCallback": "integrations.trainers.callbacks",
    "ExampleCountBatchSampler": "packing",
    "PackingResult": "packing",
    "PackingStats": "packing",
    "TokenBudgetBatchSampler": "packing",
    "bucket_ladder": "packing",
    "pack_by_tokens": "packing",
}


__getattr__ = _lazy_getattr(__name__, _LAZY, globals(), submodules=True)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _register() -> None:
    from .integrations.transformers import register

    register(ATTN_IMPLEMENTATION)


class _RegisterWithTransformers:
    """An import hook: registers ``varlen_packed`` right after ``transformers`` itself is imported,
    so the name is there before any transformers model can be built, while ``import hf_varlen``
    alone stays cheap. It stays in ``sys.meta_path`` until transformers has really been executed:
    a bare ``importlib.util.find_spec("transformers")`` (TRL and accelerate probe packages that
    way) must not use it up."""

    def __init__(self) -> None:
        self._looking = False  # our own find_spec below goes through sys.meta_path again

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers" or self._looking:
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register()

        spec.loader.exec_module = exec_then_register  # a per-spec loader instance
        return spec


ATTN_IMPLEMENTATION = "varlen_packed"
# ``import hf_varlen`` registers attn_implementation="varlen_packed" with transformers: now, when
# transformers is already imported, else the moment it is (before any model can be built).
if "transformers" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterWithTransformers())

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KernelizeReport",
    "enable_local_hub_kernel",
    "hub_kernel_path",
    "install_fused_cross_entropy",
    "install_linear_attention",
    "uninstall_linear_attention",
    "is_fused_cross_entropy_installed",
    "kernelize",
    "uninstall_fused_cross_entropy",
    "OffsetsCheckCallback",
    "PackingCollator",
    "PackingResult",
    "PackingStats",
    "TokenBudgetBatchSampler",
    "ExampleCountBatchSampler",
    "bucket_ladder",
    "pack_by_tokens",
    "available_backends",
    "check_pending_offsets",
    "default_backend",
    "model_backend",
    "register",
    "register_backend",
    "set_backend",
    "varlen_attention",
]
