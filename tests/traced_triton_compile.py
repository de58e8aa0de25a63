"""Compile a tiny packed model on CPU through the triton backend's *traced* path, as on a GPU.

On a GPU the triton attention ops are ``triton_op``s: torch.compile traces their bodies (the tile
plan's torch ops and the launch code), so a shape guard there is a recompile on varying packs. On
CPU the same ops run under TRITON_INTERPRET as opaque custom ops, whose bodies nothing traces, so
the CPU compile tests cannot see such guards. This script runs without TRITON_INTERPRET (the ops
register as on a GPU), turns every kernel launch into a no-op (outputs are garbage; only the trace
and its guards matter), lets the triton backend run on CPU with the GPU's tile configs, and trains
a compiled model over varying packs with aot_eager. It prints one JSON line:
{"compiles": n, "graph_breaks": {...}, "recompile_reasons": [...]}.

    python tests/traced_triton_compile.py KIND STYLE STEPS    (run by test_compile_attention.py)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import zlib

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit(
        "run without TRITON_INTERPRET: the point is the GPU's (traced) op registration"
    )


class _NoLaunch:
    """Stands in for ``kernel[grid](...)`` and for ``wrap_triton(kernel)[grid](...)``."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(kind: str, style: str, steps: int) -> dict:
    torch.library.wrap_triton = lambda kernel: _NoLaunch()  # before the ops are traced

    import hf_varlen
    import hf_varlen.ops.attention as attention
    import hf_varlen.ops.attention_bwd as attention_bwd
    import hf_varlen.ops.attention_fwd as attention_fwd
    from hf_varlen.backends import registry
    from hf_varlen.metadata import mark_dynamic_pack
    from hf_varlen.ops.attention_schedule import _CUDA_CONFIGS

    attention_fwd.launcher = attention_bwd.launcher = lambda kernel, traceable: _NoLaunch()
    attention.pick_config = lambda head_dim, dtype, device: _CUDA_CONFIGS[64]  # the GPU's tiles
    registry._REGISTRY["triton"] = dataclasses.replace(
        registry._REGISTRY["triton"], probe=lambda: None, devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
    )  # fmt: skip

    sys.path.insert(0, os.path.dirname(__file__))
    import test_compile_attention as t
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    model = t._model(kind, torch.float32, "cpu")
    hf_varlen.set_backend("triton", model=model)
    counting = t._CountingBackend("aot_eager")
    compiled = torch.compile(model, backend=counting, fullgraph=True)
    for step, lengths in enumerate(t._packs(steps, seed=zlib.crc32(f"{kind}{style}".encode()))):
        batch = t._batch(lengths, style, "cpu", seed=step)
        compiled(**mark_dynamic_pack(batch)).loss.backward()
    reasons = [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]
    return {
        "compiles": counting.compiles,
        "graph_breaks": dict(counters["graph_break"]),
        "recompile_reasons": [r.split("\n")[0] for r in reasons],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
