"""Triton varlen flash attention: ``triton_varlen_attention`` (public, validating) and
``triton_attention`` (already-validated input, the ``triton`` backend's entry).

    function.py       validation, the eager autograd.Function, the public functions
    launch.py         configs picked per shape, forward / backward launches, attention sinks
    fwd.py, bwd.py    the Triton kernels (forward; dQ and dK/dV, or the fused backward)
    schedule.py       tile plan: row bounds, heaviest-first tile orders, kernel configs (torch only)
    tma.py            Hopper tensor descriptors for K/V
    torch_library.py  ``torch.ops.<namespace>.triton_attention{,_backward}`` (what torch.compile calls)

Names resolve lazily (PEP 562): ``schedule`` is torch-only, and the backends that use its row
bounds (flex) must import without triton.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "triton_varlen_attention": "function",
    "triton_attention": "function",
    "SUPPORTED_DTYPES": "function",
    "MAX_HEAD_DIM": "function",
    "forward_launch": "launch",
    "backward_launch": "launch",
    "apply_sinks": "launch",
    "sinks_grad": "launch",
    "triton_attention_op": "torch_library",
    "attention_forward": "fwd",
    "attention_backward": "bwd",
    "get_plan": "schedule",
    "launch_passes": "schedule",
    "pick_config": "schedule",
    "pick_long_path": "schedule",
}

__all__ = ["triton_attention", "triton_varlen_attention"]
__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
