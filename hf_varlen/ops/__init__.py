"""hf_varlen's kernels: Triton ops with a pure-PyTorch reference each (``hf_varlen.reference``).

    apply_rotary_qk(q, k, cos, sin, ...)   fused in-place RoPE on q and k (varlen positions)
    rotary_pos_emb(q, k, cos, sin, dim)    drop-in for HF's apply_rotary_pos_emb
    swiglu(gate, up) / geglu(gate, up)     silu(gate) * up / gelu(gate) * up
    rms_norm(x, weight, eps, add_unit_offset=False)   Llama RMSNorm (True: Gemma's (1 + w))
    fused_linear_cross_entropy(hidden, weight, labels, ...)   lm_head + CE without the logits
    lora_linear(x, weight, bias, lora_a, lora_b, scale)   base(x) + scale * B(A(x)) (torch only)
    triton_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)   varlen flash attention

One package per op (``attention/``, ``cross_entropy/``, ``glu/``, ``lora/``, ``rmsnorm/``,
``rope/``): its public function exported by its ``__init__``, the implementation in ``function.py``
(validation, autograd.Function, launch), Triton kernels and ``torch.library`` registration beside
it. Shared by all: ``common.py`` (host-side helpers, torch only), ``library.py`` (the op
namespace, the autograd return shared by ops), ``_triton_common.py`` (Triton helpers),
``_lazy.py`` (lazy exports).

The names resolve lazily (PEP 562), so ``import hf_varlen.ops`` and the torch-only
``hf_varlen.ops.common`` work where triton is not installed; the op modules import triton.
This package is copied into the generated kernel-hub package: relative imports only.

The flat module paths of earlier releases (``hf_varlen.ops.attention_fwd``, ...) still import, with
a DeprecationWarning, for one release: their forwarding modules live in ``_deprecated/``, which
``__path__`` lists after this directory, so the old paths need no file beside the packages.

Every op is also a ``torch.library`` op, ``torch.ops.hf_varlen.*`` (``library.py``; the hub copy
registers under its own versioned namespace), which the functions above call while torch.compile
traces; eager calls skip the dispatcher (see each module's docstring).
"""

from __future__ import annotations

import os

from ._lazy import lazy_exports

_EXPORTS = {
    "apply_rotary_qk": "rope",
    "rotary_pos_emb": "rope",
    "swiglu": "glu",
    "geglu": "glu",
    "rms_norm": "rmsnorm",
    "fused_linear_cross_entropy": "cross_entropy",
    "lora_linear": "lora",
    "triton_varlen_attention": "attention",
}

__all__ = sorted(_EXPORTS)
__path__.append(os.path.join(os.path.dirname(__file__), "_deprecated"))  # old flat paths
__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
