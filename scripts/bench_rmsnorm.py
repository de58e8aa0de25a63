"""Benchmark RMSNorm (x: T x H bf16, weight: H bf16) forward and backward, per provider.

Providers: HF eager (transformers' ``LlamaRMSNorm``, or ``Gemma2RMSNorm`` with ``--style gemma``),
torch.compile of that module, Liger (comparator only, if installed; its HF-patch settings: llama
casting in place, gemma casting offset 1 not in place) and hf_varlen. Forward and backward are timed
separately (backward = ``torch.autograd.grad`` for x and weight with a random upstream gradient and
``retain_graph``), median of >= 10 CUDA-event-timed runs after warm-up, L2 flushed before each run.
GB/s counts the op's own traffic: forward reads x, w and writes y (2 T H + H elements); backward
reads dy, x, w and writes dx, dw (3 T H + 2 H).

Also times hf_varlen's int32 path against its forced LONG_INDEXING path at T = 16K, and with
``--sweep`` the launch configurations of the hf_varlen kernels.

    python scripts/bench_rmsnorm.py --json out/rmsnorm.json [--style llama gemma] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (  # noqa: E402
    PEAK_BYTES_PER_S,
    _fmt,
    print_match_failures,
    print_provider_report,
    run_header,
    time_ms,
)

from hf_varlen.ops import rmsnorm  # noqa: E402
from hf_varlen.reference.rmsnorm import rms_norm_reference  # noqa: E402
from hf_varlen.testing import numerics_error  # noqa: E402

header = run_header

EPS = 1e-6
UNIT_OFFSET = {"llama": False, "gemma": True}


def providers(style: str, weight: torch.Tensor) -> dict:
    """name -> fn(x, w), or a string saying why the provider is missing."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    unit = UNIT_OFFSET[style]
    module = (Gemma2RMSNorm if unit else LlamaRMSNorm)(weight.shape[0], eps=EPS)
    module = module.to(device=weight.device, dtype=weight.dtype)
    module.weight = weight  # the providers share one parameter, so dweight is comparable
    compiled = torch.compile(module, dynamic=False)
    out = {"HF eager": lambda x, w: module(x), "torch.compile": lambda x, w: compiled(x)}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        mode, offset, in_place = ("gemma", 1.0, False) if unit else ("llama", 0.0, True)
        out["Liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, offset, mode, in_place)
    except Exception as e:  # comparator only: any import problem just drops it
        out["Liger"] = f"unavailable ({type(e).__name__}: {e})"
    out["hf_varlen"] = lambda x, w: rmsnorm.rms_norm(x, w, EPS, add_unit_offset=unit)
    return dict(sorted(out.items(), key=lambda kv: kv[0] == "Liger"))


def bench_providers(style: str, n_tok: int, hidden: int) -> list[dict]:
    rows = []
    unit = UNIT_OFFSET[style]
    bytes_fwd = (2 * n_tok * hidden + hidden) * 2
    bytes_bwd = (3 * n_tok * hidden + 2 * hidden) * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_init = torch.randn(hidden, device="cuda", generator=gen) * 0.5 + (0.0 if unit else 1.0)
    weight = torch.nn.Parameter(w_init.to(torch.bfloat16))
    for name, fn in providers(style, weight).items():
        if isinstance(fn, str):
            rows.append({"style": style, "T": n_tok, "provider": name, "skipped": fn})
            continue
        x = torch.randn(n_tok, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        dy = torch.randn(n_tok, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        x.requires_grad_()
        y = fn(x, weight)
        sl = slice(0, 1024)
        xs, ws = x.detach()[sl], weight.detach()
        ok, msg = numerics_error(
            y[sl],
            rms_norm_reference(xs.double(), ws.double(), EPS, add_unit_offset=unit),
            rms_norm_reference(xs, ws, EPS, add_unit_offset=unit),
        )
        fwd = time_ms(lambda fn=fn, x=x: fn(x, weight))
        bwd = time_ms(
            lambda y=y, x=x, dy=dy: torch.autograd.grad(y, (x, weight), dy, retain_graph=True)
        )
        print(f"{name} T={n_tok}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms", file=sys.stderr, flush=True)
        for direction, ms, nbytes in (("fwd", fwd, bytes_fwd), ("bwd", bwd, bytes_bwd)):
            rows.append(
                {
                    "style": style,
                    "T": n_tok,
                    "H": hidden,
                    "dir": direction,
                    "provider": name,
                    "ms": ms,
                    "GB/s": nbytes / ms / 1e6,
                    "pct_peak": 100 * nbytes / ms / 1e9 / PEAK_BYTES_PER_S,
                    "fwd_match": ok,
                    "match_msg": msg,
                }
            )
        del x, dy, y
        torch.cuda.empty_cache()
    for r in rows:
        if "ms" not in r:
            continue
        same = {x["provider"]: x["ms"] for x in rows if x.get("dir") == r["dir"] and "ms" in x}
        r["speedup_vs_eager"] = same["HF eager"] / r["ms"]
        r["speedup_vs_liger"] = same["Liger"] / r["ms"] if "Liger" in same else None
    return rows


def _launch_inputs(style: str, n_tok: int, hidden: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_tok, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(n_tok, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(hidden, device="cuda", generator=gen).to(torch.bfloat16)
    _, rstd = rmsnorm.rms_norm_forward(x, w, EPS, UNIT_OFFSET[style])
    return x, dy, w, rstd


def bench_int32_vs_long(style: str, n_tok: int, hidden: int) -> list[dict]:
    x, dy, w, rstd = _launch_inputs(style, n_tok, hidden)
    unit, rows = UNIT_OFFSET[style], []
    for long in (False, True):
        fwd = time_ms(
            lambda long=long: rmsnorm.rms_norm_forward(x, w, EPS, unit, long_indexing=long)
        )
        bwd = time_ms(
            lambda long=long: rmsnorm.rms_norm_backward(dy, x, w, rstd, unit, long_indexing=long)
        )
        rows.append(
            {"style": style, "T": n_tok, "long_indexing": long, "fwd_ms": fwd, "bwd_ms": bwd}
        )
    return rows


SWEEP_FWD_WARPS = [4, 8, 16]
SWEEP_BWD = [(w, p) for w in (4, 8, 16) for p in (1, 2, 4, 8)]


def bench_sweep(style: str, n_tok: int, hidden: int) -> list[dict]:
    x, dy, w, rstd = _launch_inputs(style, n_tok, hidden)
    unit, rows = UNIT_OFFSET[style], []
    fwd_bytes, bwd_bytes = 4 * n_tok * hidden, 6 * n_tok * hidden
    for warps in SWEEP_FWD_WARPS:
        ms = time_ms(lambda warps=warps: rmsnorm.rms_norm_forward(x, w, EPS, unit, num_warps=warps))
        print(f"sweep fwd warps={warps} T={n_tok}: {ms:.3f} ms", file=sys.stderr, flush=True)
        rows.append(
            {
                "style": style,
                "T": n_tok,
                "dir": "fwd",
                "num_warps": warps,
                "programs_per_sm": None,
                "ms": ms,
                "pct_peak": 100 * fwd_bytes / ms / 1e9 / PEAK_BYTES_PER_S,
            }
        )
    for warps, per_sm in SWEEP_BWD:
        kw = {"num_warps": warps, "programs_per_sm": per_sm}
        ms = time_ms(lambda kw=kw: rmsnorm.rms_norm_backward(dy, x, w, rstd, unit, **kw))
        print(f"sweep bwd {kw} T={n_tok}: {ms:.3f} ms", file=sys.stderr, flush=True)
        rows.append(
            {
                "style": style,
                "T": n_tok,
                "dir": "bwd",
                "num_warps": warps,
                "programs_per_sm": per_sm,
                "ms": ms,
                "pct_peak": 100 * bwd_bytes / ms / 1e9 / PEAK_BYTES_PER_S,
            }
        )
    return rows


def print_report(head: dict, results, int_vs_long, sweep) -> None:
    print_provider_report(
        "RMSNorm benchmark", "style", "fwd bytes 2TH*2, bwd 3TH*2", head, results, int_vs_long
    )
    if sweep:
        print("\n| style | T | dir | warps | programs/SM | ms | % peak |")
        print("|---|---|---|---|---|---|---|")
        for r in sweep:
            print(
                f"| {r['style']} | {r['T']} | {r['dir']} | {r['num_warps']} | "
                f"{_fmt(r['programs_per_sm'], 'd')} | {r['ms']:.3f} | {r['pct_peak']:.1f} |"
            )
    print_match_failures("style", results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    p.add_argument("--H", type=int, default=4096)
    p.add_argument("--style", nargs="+", default=["llama"], choices=list(UNIT_OFFSET))
    p.add_argument("--sweep", action="store_true", help="also time kernel launch configurations")
    p.add_argument("--json", type=Path, help="write all results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rmsnorm.py needs a CUDA GPU")

    head = header()
    results, int_vs_long, sweep = [], [], []
    for style in args.style:
        if args.sweep:
            for n_tok in (16384, 65536):
                sweep += bench_sweep(style, n_tok, args.H)
        int_vs_long += bench_int32_vs_long(style, 16384, args.H)
        for n_tok in args.T:
            results += bench_providers(style, n_tok, args.H)
    print_report(head, results, int_vs_long, sweep)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"header": head, "results": results, "int32_vs_long": int_vs_long}
        args.json.write_text(json.dumps(payload | {"sweep": sweep}, indent=1))


if __name__ == "__main__":
    main()
