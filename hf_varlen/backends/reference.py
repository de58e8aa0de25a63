"""`reference`: the pure-PyTorch oracle as a backend (CPU and GPU, every feature, slow).

Offsets are read on the host (the oracle loops over documents), so they are always fully checked.
"""

from __future__ import annotations

import torch

from ..reference.attention import attention_reference
from ._common import host_offsets_qk
from .registry import BackendSpec, register_backend


def reference_backend(q, k, v, metadata, params):
    host_offsets_qk(q, k, metadata)  # the full check, with max_seqlen (the oracle has none)
    cu_q, cu_k, p = metadata.cu_seqlens_q, metadata.cu_seqlens_k, params
    return attention_reference(
        q, k, v, cu_q, cu_k, softmax_scale=p.softmax_scale, causal=p.causal,
        window_size=p.window, softcap=p.softcap, dropout_p=p.dropout_p, sinks=p.sinks,
    )  # fmt: skip


_EVERY_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
register_backend(BackendSpec(
    name="reference", fn=reference_backend, devices=frozenset({"cpu", "cuda"}), dtypes=_EVERY_FLOAT,
    description="pure PyTorch, one matmul-softmax-matmul per document (the test oracle)",
    requires="nothing (CPU or GPU)", sliding_window=True, softcap=True, dropout=True, sinks=True,
    traceable=False,  # host offsets: an opaque op under torch.compile
))  # fmt: skip
