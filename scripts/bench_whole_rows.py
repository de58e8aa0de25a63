"""Calls of whole rows (a vision tower's per-window and per-image attention): our kernel vs SDPA.

"auto" sends a call whose every document is one whole row to ``sdpa`` first on CUDA, ahead of
the long-documents rules (``rows_first`` in ``backends/__init__.py``); this sweep is that rule's
measurement, and its ``auto`` column checks that the rule routes as measured. For rows of 64 to 8192 tokens it times a run of back-to-back forward + backward calls
by wall clock (a vision tower's calls come by the hundred per forward and each pays its backend's
fixed host work, so no CUDA-event-only timing) on each backend, and prints ms per call and
sdpa's speed-up over our kernel. Run on a GPU:

    python scripts/bench_whole_rows.py [--calls 32] [--json out.json]

Shapes: q, k, v (rows * n, H, D) bf16; Qwen2.5-VL's vision tower is H 16, D 80, not causal.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_common import run_header

from hf_varlen.backends import AttentionParams
from hf_varlen.functional import dispatch
from hf_varlen.metadata import from_rows

LENGTHS = (64, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192)
SHAPES = {  # name: (heads, head_dim, causal)
    "vision-h16-d80": (16, 80, False),
    "text-h32-d128-causal": (32, 128, True),
}


def per_call_ms(
    backend: str, rows: int, n: int, heads: int, head_dim: int, causal: bool, calls: int
):
    """Median over 5 repeats of (wall time of ``calls`` forward + backward calls) / calls."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(
            rows * n, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g
        ).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    meta = from_rows(rows, n, n, q.device)
    params = AttentionParams.create(head_dim=head_dim, causal=causal)

    def run():
        for _ in range(calls):
            out = dispatch(q, k, v, meta, params, backend)
            out.backward(grad)

    for _ in range(2):
        run()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    times.sort()
    return times[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--backends", nargs="+", default=["triton", "sdpa", "auto"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    header = run_header(calls=args.calls)
    print(json.dumps(header))
    results = []
    print(
        f"{'shape':22} {'rows':>4} {'n':>5} "
        + " ".join(f"{b:>9}" for b in args.backends)
        + "  sdpa/triton"
    )
    for shape, (heads, head_dim, causal) in SHAPES.items():
        for rows in args.rows:
            for n in LENGTHS:
                row = {"shape": shape, "rows": rows, "n": n}
                for b in args.backends:
                    try:
                        row[b] = per_call_ms(b, rows, n, heads, head_dim, causal, args.calls)
                    except Exception as exc:  # a backend that cannot serve the shape: say so
                        row[b] = None
                        row[f"{b}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                results.append(row)
                cells = " ".join(
                    f"{row[b]:9.3f}" if row[b] is not None else f"{'-':>9}" for b in args.backends
                )
                ratio = (
                    f"{row['triton'] / row['sdpa']:.2f}x"
                    if row.get("triton") and row.get("sdpa")
                    else "-"
                )
                print(f"{shape:22} {rows:4d} {n:5d} {cells}  {ratio}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "ms_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
