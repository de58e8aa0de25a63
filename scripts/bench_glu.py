"""Benchmark the GLU activation (gate, up: T x F bf16) forward and backward, per provider.

Providers: HF eager (``act_fn(gate) * up`` as LlamaMLP/Gemma2MLP compute it), torch.compile of the
same function, Liger (comparator only, if installed; GeGLU only in its tanh form) and hf_varlen.
Forward and backward are timed separately (backward = ``torch.autograd.grad`` with a random
upstream gradient and ``retain_graph``), median of >= 10 CUDA-event-timed runs after warm-up, L2
flushed before each run. GB/s counts the op's own traffic: forward reads gate, up and writes out
(3 T F elements); backward reads d_out, gate, up and writes d_gate, d_up (5 T F).

Also times hf_varlen's int32 path against its forced LONG_INDEXING path at T = 16K, and with
``--sweep`` the launch configurations (BLOCK, num_warps) of the hf_varlen kernels.

    python scripts/bench_glu.py --json out/glu.json [--act swiglu geglu_tanh] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (  # noqa: E402
    PEAK_BYTES_PER_S,
    print_match_failures,
    print_provider_report,
    run_header,
    time_ms,
)

from hf_varlen.ops import glu  # noqa: E402
from hf_varlen.reference.glu import geglu_reference, swiglu_reference  # noqa: E402
from hf_varlen.testing import numerics_error  # noqa: E402

header = run_header

KERNEL_ACTIVATION = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}


def eager_fn(act: str):
    if act == "swiglu":
        return lambda g, u: F.silu(g) * u
    approximate = "tanh" if act == "geglu_tanh" else "none"
    return lambda g, u: F.gelu(g, approximate=approximate) * u


def providers(act: str) -> dict:
    """name -> fn(gate, up), or a string saying why the provider is missing."""
    out = {"HF eager": eager_fn(act), "torch.compile": torch.compile(eager_fn(act), dynamic=False)}
    try:
        if act == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            out["Liger"] = LigerSiLUMulFunction.apply
        elif act == "geglu_tanh":
            from liger_kernel.ops.geglu import LigerGELUMulFunction

            out["Liger"] = LigerGELUMulFunction.apply
        else:
            out["Liger"] = "Liger has no erf GeGLU"
    except Exception as e:  # comparator only: any import problem just drops it
        out["Liger"] = f"unavailable ({type(e).__name__}: {e})"
    if act == "swiglu":
        out["hf_varlen"] = glu.swiglu
    else:
        approximate = "tanh" if act == "geglu_tanh" else "none"
        out["hf_varlen"] = lambda g, u: glu.geglu(g, u, approximate=approximate)
    # Liger's backward overwrites its saved inputs: it runs last on its own inputs anyway.
    return dict(sorted(out.items(), key=lambda kv: kv[0] == "Liger"))


def reference(act: str):
    if act == "swiglu":
        return swiglu_reference
    approximate = "tanh" if act == "geglu_tanh" else "none"
    return lambda g, u: geglu_reference(g, u, approximate=approximate)


def bench_providers(act: str, n_tok: int, n_ff: int) -> list[dict]:
    rows = []
    bytes_fwd, bytes_bwd = 3 * n_tok * n_ff * 2, 5 * n_tok * n_ff * 2
    for name, fn in providers(act).items():
        if isinstance(fn, str):
            rows.append({"act": act, "T": n_tok, "provider": name, "skipped": fn})
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        gate = torch.randn(n_tok, n_ff, device="cuda", generator=gen).to(torch.bfloat16)
        up = torch.randn(n_tok, n_ff, device="cuda", generator=gen).to(torch.bfloat16)
        dout = torch.randn(n_tok, n_ff, device="cuda", generator=gen).to(torch.bfloat16)
        gate.requires_grad_()
        up.requires_grad_()
        out = fn(gate, up)
        sl = slice(0, 1024)  # the match check: first rows vs the fp64 and bf16 references
        g, u = gate.detach()[sl], up.detach()[sl]
        ok, msg = numerics_error(
            out[sl], reference(act)(g.double(), u.double()), reference(act)(g, u)
        )
        fwd = time_ms(lambda fn=fn, gate=gate, up=up: fn(gate, up))
        bwd = time_ms(
            lambda out=out, gate=gate, up=up, dout=dout: torch.autograd.grad(
                out, (gate, up), dout, retain_graph=True
            )
        )
        print(f"{name} T={n_tok}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms", file=sys.stderr, flush=True)
        for direction, ms, nbytes in (("fwd", fwd, bytes_fwd), ("bwd", bwd, bytes_bwd)):
            rows.append(
                {
                    "act": act,
                    "T": n_tok,
                    "F": n_ff,
                    "dir": direction,
                    "provider": name,
                    "ms": ms,
                    "GB/s": nbytes / ms / 1e6,
                    "pct_peak": 100 * nbytes / ms / 1e9 / PEAK_BYTES_PER_S,
                    "fwd_match": ok,
                    "match_msg": msg,
                }
            )
        del gate, up, dout, out
        torch.cuda.empty_cache()
    for r in rows:
        if "ms" not in r:
            continue
        same = {x["provider"]: x["ms"] for x in rows if x.get("dir") == r["dir"] and "ms" in x}
        r["speedup_vs_eager"] = same["HF eager"] / r["ms"]
        r["speedup_vs_liger"] = same["Liger"] / r["ms"] if "Liger" in same else None
    return rows


def _launch_inputs(n_tok: int, n_ff: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(n_tok, n_ff, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3)
    ]


def bench_int32_vs_long(act: str, n_tok: int, n_ff: int) -> list[dict]:
    gate, up, dout = _launch_inputs(n_tok, n_ff)
    a = KERNEL_ACTIVATION[act]
    rows = []
    for long in (False, True):
        fwd = time_ms(lambda long=long: glu.glu_forward(gate, up, a, long_indexing=long))
        bwd = time_ms(lambda long=long: glu.glu_backward(dout, gate, up, a, long_indexing=long))
        rows.append({"act": act, "T": n_tok, "long_indexing": long, "fwd_ms": fwd, "bwd_ms": bwd})
    return rows


SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (16384, 16)]


def bench_sweep(act: str, n_tok: int, n_ff: int) -> list[dict]:
    gate, up, dout = _launch_inputs(n_tok, n_ff)
    a = KERNEL_ACTIVATION[act]
    rows = []
    for block, warps in SWEEP:
        kw = {"block": block, "num_warps": warps}
        fwd = time_ms(lambda kw=kw: glu.glu_forward(gate, up, a, **kw))
        bwd = time_ms(lambda kw=kw: glu.glu_backward(dout, gate, up, a, **kw))
        print(f"sweep {kw} T={n_tok}: fwd {fwd:.3f} bwd {bwd:.3f}", file=sys.stderr, flush=True)
        rows.append(
            {
                "act": act,
                "T": n_tok,
                "block": block,
                "num_warps": warps,
                "fwd_ms": fwd,
                "bwd_ms": bwd,
                "fwd_pct_peak": 100 * 6 * n_tok * n_ff / fwd / 1e9 / PEAK_BYTES_PER_S,
                "bwd_pct_peak": 100 * 10 * n_tok * n_ff / bwd / 1e9 / PEAK_BYTES_PER_S,
            }
        )
    return rows


def print_report(head: dict, results, int_vs_long, sweep) -> None:
    print_provider_report(
        "GLU activation benchmark", "act", "fwd bytes 3TF*2, bwd 5TF*2", head, results, int_vs_long
    )
    if sweep:
        print("\n| act | T | BLOCK | warps | fwd ms | fwd % | bwd ms | bwd % |")
        print("|---|---|---|---|---|---|---|---|")
        for r in sweep:
            print(
                f"| {r['act']} | {r['T']} | {r['block']} | {r['num_warps']} | {r['fwd_ms']:.3f} | "
                f"{r['fwd_pct_peak']:.1f} | {r['bwd_ms']:.3f} | {r['bwd_pct_peak']:.1f} |"
            )
    print_match_failures("act", results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    p.add_argument("--F", type=int, default=14336)
    p.add_argument("--act", nargs="+", default=["swiglu"], choices=list(KERNEL_ACTIVATION))
    p.add_argument("--sweep", action="store_true", help="also time kernel launch configurations")
    p.add_argument("--json", type=Path, help="write all results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_glu.py needs a CUDA GPU")

    head = header()
    results, int_vs_long, sweep = [], [], []
    for act in args.act:
        if args.sweep:
            for n_tok in (16384, 65536):
                sweep += bench_sweep(act, n_tok, args.F)
        int_vs_long += bench_int32_vs_long(act, 16384, args.F)
        for n_tok in args.T:
            results += bench_providers(act, n_tok, args.F)
    print_report(head, results, int_vs_long, sweep)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"header": head, "results": results, "int32_vs_long": int_vs_long}
        args.json.write_text(json.dumps(payload | {"sweep": sweep}, indent=1))


if __name__ == "__main__":
    main()
