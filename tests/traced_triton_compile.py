"""Compile a tiny packed model on CPU through the triton backend's *traced* path, as on a GPU.

On a GPU the triton attention ops are ``triton_op``s: torch.compile traces their bodies (the tile
plan's torch ops and the launch code), so a shape guard there is a recompile on varying packs. On
CPU the same ops run under TRITON_INTERPRET as opaque custom ops, whose bodies nothing traces, so
the CPU compile tests cannot see such guards. This script runs without TRITON_INTERPRET (the ops
register as on a GPU), turns every kernel launch into a no-op (outputs are garbage; only the trace
and its guards matter), lets the triton backend run on CPU with the GPU's tile configs, and trains
a compiled model over varying packs with aot_eager. It prints one JSON line:
{"compiles": n, "graph_breaks": {...}, "recompile_reasons": [...]}.

    python tests/traced_triton_compile.py KIND STYLE STEPS [fused|tma]   (run by
        test_compile_attention.py; fused: the fused attention backward, KernelConfig.bwd_fused;
        tma: tensor descriptors asked for, KernelConfig.tma, on a device that takes them as an
        sm_90 GPU does: the traced launches must decline them and still trace cleanly)
    python tests/traced_triton_compile.py ops                 the row ops on their own: one JSON
        line per op, {"op": name, "compiles": n, "recompile_reasons": [...]}, over token counts
        that cross the kernels' block sizes (marked dynamic from the first call: 1 compilation)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import zlib

import torch


def run(*argv: str) -> list[dict]:
    """Run this script in a subprocess without TRITON_INTERPRET; its JSON lines (for the tests)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, __file__, *argv], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise AssertionError(f"traced_triton_compile.py {' '.join(argv)}: {done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


class _NoLaunch:
    """Stands in for ``kernel[grid](...)`` and for ``wrap_triton(kernel)[grid](...)``."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(kind: str, style: str, steps: int, variant: str = "split") -> dict:
    torch.library.wrap_triton = lambda kernel: _NoLaunch()  # before the ops are traced

    import hf_varlen
    import hf_varlen.ops.attention.bwd as attention_bwd
    import hf_varlen.ops.attention.fwd as attention_fwd
    import hf_varlen.ops.attention.launch as attention
    import hf_varlen.ops.attention.tma as attention_tma
    from hf_varlen.backends import registry
    from hf_varlen.metadata import mark_dynamic_pack
    from hf_varlen.ops.attention.schedule import _CUDA_CONFIGS

    attention_fwd.launcher = attention_bwd.launcher = lambda kernel, traceable: _NoLaunch()
    tma = variant == "tma"
    if tma:  # descriptors as on an sm_90 GPU (attention_tma.py), in the long launches too
        attention_tma.tma_device = lambda device: True
        long = attention.pick_long_path(64, torch.float32, torch.device("cpu"))
        long = dataclasses.replace(long, cfg=dataclasses.replace(long.cfg, tma=True))
        attention.pick_long_path = lambda head_dim, dtype, device: long
    gpu_tiles = dataclasses.replace(_CUDA_CONFIGS[64], bwd_fused=variant == "fused", tma=tma)
    attention.pick_config = lambda head_dim, dtype, device: gpu_tiles  # the GPU's tiles
    registry._REGISTRY["triton"] = dataclasses.replace(
        registry._REGISTRY["triton"], probe=lambda: None, devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
    )  # fmt: skip

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "backends"))
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


def _stub_row_ops():
    """The row ops' device checks accept CPU tensors here (their launches are stubbed)."""
    import hf_varlen.ops.cross_entropy.function as ce
    import hf_varlen.ops.glu.function as glu
    import hf_varlen.ops.rmsnorm.function as rmsnorm
    import hf_varlen.ops.rope.function as rope

    for module in (glu, rmsnorm, rope, ce):
        if hasattr(module, "_INTERPRET"):
            module._INTERPRET = True


def train_over_token_counts(fn, make, token_counts, backend) -> None:
    """Compile ``fn`` (fullgraph, with ``backend``) and run forward + backward once per token
    count; ``make(T)`` gives (args, {token dim: indices of the args marked dynamic there})."""
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for t in token_counts:
        args, dims = make(t)
        for token_dim, indices in dims.items():
            for i in indices:
                torch._dynamo.mark_dynamic(args[i], token_dim)
        out = compiled(*args)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()


def row_op_cases(device, dtype, *, hidden, ffn, heads, kv_heads, dim, vocab) -> dict:
    """The row ops as test cases at the given widths: {name: (fn, make(T) -> (args, {token dim:
    indices of the args marked dynamic there}))}; inputs random, gradients on the activations."""
    import hf_varlen.ops as o

    cos, sin = (torch.randn(8192, dim, device=device, dtype=dtype) for _ in range(2))

    def rows(t, width):
        return torch.randn(t, width, device=device, dtype=dtype, requires_grad=True)

    def rope_case(t):  # (B, H, T, D) as HF hands it; 3 documents' positions
        pos = torch.cat([torch.arange(n) for n in (t // 3, t // 3, t - 2 * (t // 3))])[None]
        q = torch.randn(1, heads, t, dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, t, dim, device=device, dtype=dtype, requires_grad=True)
        return (q, k, cos, sin, pos.to(device)), {2: (0, 1), 1: (4,)}

    def ce_case(t):
        w = torch.randn(vocab, hidden, device=device, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, vocab, (t,), device=device)
        return (rows(t, hidden), w, labels), {0: (0, 2)}

    ones = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
    return {
        "rms_norm": (
            lambda x, w: o.rms_norm(x, w, 1e-6),
            lambda t: ((rows(t, hidden), ones), {0: (0,)}),
        ),
        "swiglu": (o.swiglu, lambda t: ((rows(t, ffn), rows(t, ffn)), {0: (0, 1)})),
        "apply_rotary_qk": (
            lambda q, k, c, s, pos: o.apply_rotary_qk(q, k, c, s, position_ids=pos, inplace=False),
            rope_case,
        ),
        "fused_linear_cross_entropy": (
            lambda h, w, y: o.fused_linear_cross_entropy(h, w, y, reduction="mean"),
            ce_case,
        ),
    }


def ops() -> list[dict]:
    """Each row op compiled (aot_eager, fullgraph) over token counts crossing its block sizes."""
    import triton

    torch.library.wrap_triton = lambda kernel: _NoLaunch()
    # the fused CE is an opaque op: only its Python wrapper is traced, its kernels launch directly
    triton.runtime.jit.JITFunction.run = lambda self, *args, **kwargs: None
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    _stub_row_ops()
    cases = row_op_cases("cpu", torch.float32, hidden=64, ffn=96, heads=4, kv_heads=2, dim=16,
                         vocab=97)  # fmt: skip
    rows = []
    for name, (fn, make) in cases.items():
        torch._dynamo.reset()
        clear_compilation_metrics()
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "backends"))
        from test_compile_attention import _CountingBackend

        counting = _CountingBackend("aot_eager")
        # 2 and 3: fewer rows than the CPU geometry's 4 persistent RMSNorm programs (the GPU has
        # 528 at H = 2048): a grid of min(rows, programs) guards on T there
        train_over_token_counts(fn, make, (17, 2, 63, 64, 3, 65, 129, 1000, 4097), counting)
        reasons = [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]
        rows.append(
            {
                "op": name,
                "compiles": counting.compiles,
                "recompile_reasons": [r.split("\n")[0] for r in reasons],
            }
        )
    return rows


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the point is the GPU's op registration")
    if sys.argv[1] == "ops":
        for row in ops():
            print(json.dumps(row))
    else:
        variant = sys.argv[4] if len(sys.argv) > 4 else "split"
        if variant not in ("split", "fused", "tma"):
            raise SystemExit(f"unknown variant {variant!r}: split, fused or tma")
        print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), variant)))
