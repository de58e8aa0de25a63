"""Benchmark the LoRA projection: peft's ``lora.Linear`` (separate base, A and B matmuls, scale and
add) against the same layer on hf_varlen's one-op projection (``kernelize(model, lora=True)``,
``hf_varlen.ops.lora_linear``), forward + backward, eager and captured in a CUDA graph.

Shapes: the projections of the 1B preset (hidden 2048, intermediate 8192, 8 KV heads of 64:
q/o 2048 -> 2048, k/v 2048 -> 512, gate/up 2048 -> 8192, down 8192 -> 2048), tokens N in
``--tokens``, rank ``--rank``, bf16 weights and activations, fp32 adapters (peft's default in a
bf16 model). One step = forward, then backward with a fixed upstream gradient; gradients of x,
A and B (the base is frozen). Eager: median CUDA-event time of the step (host time included,
as a host-bound training step sees it). Captured: the step captured once in a CUDA graph, median
replay time (GPU work only: the captured training step). Also: the activation memory the
forward keeps for the backward (allocated after the forward minus before), and the match of the
two outputs under the numerics rule (ref_hi: the reference in fp64).

    python scripts/bench_lora.py --json out/lora.json [--tokens 1024 8192 32768] [--rank 16]

The default of ``--fused-lora`` (off) changes only where the captured column shows hf_varlen
ahead at every shape, and the end-to-end A/B (docs/lora.md) agrees.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import run_header, time_ms  # noqa: E402

from hf_varlen.integrations.kernelize.peft_lora import fused_lora_forward  # noqa: E402
from hf_varlen.reference.lora import lora_linear_reference  # noqa: E402
from hf_varlen.testing import numerics_error  # noqa: E402

PROJECTIONS = {  # name -> (in, out) at the 1B preset's shape
    "q/o": (2048, 2048),
    "k/v": (2048, 512),
    "gate/up": (2048, 8192),
    "down": (8192, 2048),
}


def lora_layer(k: int, o: int, rank: int, fused: bool):
    """A peft lora.Linear around a frozen bf16 nn.Linear; fp32 adapters, B random."""
    import peft

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(k, o, bias=False, dtype=torch.bfloat16))
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["proj"])
    model = peft.get_peft_model(base, config).cuda()
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0.0, 0.02)
    if fused:
        layer.forward = types.MethodType(fused_lora_forward, layer)
    return layer


def step_fn(layer, x, dy):
    def step():
        y = layer(x)
        y.backward(dy)

    return step


def captured(step):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: gradient buffers exist before the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def saved_bytes(layer, x) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = layer(x)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept


def bench(tokens: int, k: int, o: int, rank: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    x.requires_grad_()
    dy = torch.randn(tokens, o, device="cuda", generator=gen, dtype=torch.bfloat16)
    outputs = {}
    for name, fused in (("peft", False), ("hf_varlen", True)):
        layer = lora_layer(k, o, rank, fused)
        with torch.no_grad():
            outputs[name] = layer(x)
        step = step_fn(layer, x, dy)
        eager = time_ms(step)
        graph = time_ms(captured(step))
        rows.append(
            {
                "N": tokens, "K": k, "O": o, "r": rank, "provider": name,
                "eager_ms": eager, "captured_ms": graph,
                "saved_MiB": saved_bytes(layer, x) / 2**20,
            }
        )  # fmt: skip
        print(f"{name} N={tokens} {k}->{o}: eager {eager:.3f} ms, graph {graph:.3f} ms",
              file=sys.stderr, flush=True)  # fmt: skip
    layer = lora_layer(k, o, rank, False)
    w = layer.base_layer.weight
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    sl = slice(0, 512)
    ref = [x.detach()[sl], w, None, a, b, layer.scaling["default"]]
    with torch.no_grad():
        hi = lora_linear_reference(*[t.double() if torch.is_tensor(t) else t for t in ref])
        lo = lora_linear_reference(
            *[t.to(torch.bfloat16) if torch.is_tensor(t) else t for t in ref]
        )
    for row in rows:
        ok, msg = numerics_error(outputs[row["provider"]][sl], hi, lo)
        row["match"] = "ok" if ok else msg
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora.py: needs a CUDA GPU (benchmarks time GPU work)")
    rows = [
        row
        for tokens in args.tokens
        for k, o in PROJECTIONS.values()
        for row in bench(tokens, k, o, args.rank)
    ]
    print("| N | K -> O | provider | eager ms | captured ms | saved MiB | match |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['N']} | {r['K']} -> {r['O']} | {r['provider']} | {r['eager_ms']:.3f} | "
            f"{r['captured_ms']:.3f} | {r['saved_MiB']:.1f} | {r['match']} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": run_header(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
