"""Benchmark fused QK RoPE against HF eager, torch.compile and Liger (comparator only).

Shapes (Llama-8B-like, HF layout): q (1, 32, T, 128) and k (1, 8, T, 128) bf16 views of
(1, T, H*128) projection outputs; cos/sin (1, T, 128) gathered from packed position_ids.
Forward and backward are timed separately (``triton.testing.do_bench``, median, L2 flushed);
the backward uses a random upstream gradient. GB/s counts the bytes the op must move: read q, k,
cos, sin and write q, k (same count for every provider, so GB/s is comparable across them).

    python scripts/bench_rope.py --json out/rope.json [--tokens 4096,16384] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_common import run_header as header  # noqa: E402

from hf_varlen.ops.rope import apply_rotary_qk, rotary_pos_emb  # noqa: E402
from hf_varlen.ops.rope import function as rope_ops  # noqa: E402

HQ, HKV, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16


def packed_inputs(seqlen: int):
    """q, k as HF views; cos/sin gathered from the position_ids of a packed batch."""
    gen = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seqlen:  # instruction-tuning-like documents of 64..2048 tokens
        n = min(int(torch.randint(64, 2049, (1,), generator=gen)), seqlen - total)
        lengths.append(n)
        total += n
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths]).view(1, seqlen).cuda()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM)
    freqs = torch.arange(4096, device="cuda")[:, None].float() * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)
    table = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    q = torch.randn(1, seqlen, HQ * HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(1, seqlen, HKV * HEAD_DIM, device="cuda", dtype=DTYPE)
    q = q.view(1, seqlen, HQ, HEAD_DIM).transpose(1, 2)
    k = k.view(1, seqlen, HKV, HEAD_DIM).transpose(1, 2)
    return q, k, table[0][pos], table[1][pos], table, cu.cuda()


def providers():
    from transformers.models.llama import modeling_llama

    hf = modeling_llama.apply_rotary_pos_emb
    found = {"hf_eager": hf, "torch_compile": torch.compile(hf, dynamic=False)}
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        found["liger"] = liger_rotary_pos_emb
    except ImportError:
        try:
            from liger_kernel.ops.rope import LigerRopeFunction

            found["liger"] = LigerRopeFunction.apply
        except ImportError:
            print("liger-kernel not installed: Liger column skipped")
    found["hf_varlen"] = rotary_pos_emb  # the kernel-hub entry: out of place under autograd
    return found


def time_provider(fn, q, k, cos, sin, rep):
    """(fwd, bwd, bwd with an expanded gradient) in ms for a training call: inputs require grad;
    bwd uses a random upstream gradient, the last one the stride-0 gradient of
    ``(q_out.sum() + k_out.sum()).backward()`` (how the baselines in docs/BENCHMARKS.md were
    measured)."""
    ql, kl = q.detach().requires_grad_(), k.detach().requires_grad_()
    fwd = do_bench(lambda: fn(ql, kl, cos, sin), warmup=10, rep=rep, return_mode="median")
    outs = fn(ql, kl, cos, sin)
    times = [fwd]
    for grads in (
        [torch.randn_like(o) for o in outs],
        [torch.ones((), device=o.device, dtype=o.dtype).expand_as(o) for o in outs],
    ):
        times.append(do_bench(
            lambda grads=grads: torch.autograd.grad(outs, (ql, kl), grads, retain_graph=True),
            warmup=10, rep=rep, return_mode="median",
        ))  # fmt: skip
    return tuple(times)


def time_inplace_autograd_bwd(q, k, cos, sin, rep) -> float:
    """Backward of in-place RoPE on HF's non-leaf views: CopySlices / AsStrided nodes come on
    top of the conjugate launches (why rotary_pos_emb is out of place under autograd)."""
    batch, seqlen = q.shape[0], q.shape[2]
    base_q = torch.randn(batch, seqlen, HQ * HEAD_DIM, device="cuda", dtype=DTYPE)
    base_k = torch.randn(batch, seqlen, HKV * HEAD_DIM, device="cuda", dtype=DTYPE)
    base_q.requires_grad_()
    base_k.requires_grad_()
    # clone() makes the non-leaf projection-like output; its backward passes grads as they are
    qv = base_q.clone().view(batch, seqlen, HQ, HEAD_DIM).transpose(1, 2)
    kv = base_k.clone().view(batch, seqlen, HKV, HEAD_DIM).transpose(1, 2)
    outs = apply_rotary_qk(qv, kv, cos, sin)
    grads = [torch.randn_like(o) for o in outs]
    return do_bench(
        lambda: torch.autograd.grad(outs, (base_q, base_k), grads, retain_graph=True),
        warmup=10,
        rep=rep,
        return_mode="median",
    )


def time_hf_varlen_variants(q, k, cos, sin, table, cu, rep):
    """In place without autograd (inference), in place under autograd (backward only), and the
    cu_seqlens path (cos/sin table, positions found in the kernel)."""
    nan = float("nan")
    with torch.no_grad():
        fwd = do_bench(lambda: apply_rotary_qk(q, k, cos, sin), warmup=10, rep=rep,
                       return_mode="median")  # fmt: skip
    out = {"hf_varlen_inplace_nograd": (fwd, nan, nan)}
    out["hf_varlen_inplace_autograd"] = (nan, time_inplace_autograd_bwd(q, k, cos, sin, rep), nan)
    torch.cuda.empty_cache()

    def cu_fn(q_, k_, _cos, _sin):
        return apply_rotary_qk(q_, k_, table[0], table[1], cu_seqlens=cu, inplace=False)

    out["hf_varlen_cu_seqlens"] = time_provider(cu_fn, q, k, cos, sin, rep)
    return out


def sweep(seqlen: int, rep: int) -> list[dict]:
    """Raw kernel GB/s per tile config: in-place forward and out-of-place conjugate (backward)."""
    q, k, cos, sin, _, _ = packed_inputs(seqlen)
    nbytes = moved_bytes(q, k, cos)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    st = rope_ops._check_inputs(q, k, cos, sin, None, None, False, None)
    rows = []
    for block_t, block_h, warps in [
        (16, 4, 4), (8, 4, 4), (32, 4, 4), (32, 2, 4), (4, 8, 4), (8, 8, 4), (16, 4, 8), (8, 8, 8),
    ]:  # fmt: skip
        rope_ops._config_override = rope_ops._Config(block_t, block_h, warps)
        try:
            f = do_bench(
                lambda: rope_ops._launch(q, k, q, k, cos, sin, None, None, st, conjugate=False),
                warmup=10, rep=rep, return_mode="median",
            )  # fmt: skip
            b = do_bench(
                lambda: rope_ops._launch(q, k, dq, dk, cos, sin, None, None, st, conjugate=True),
                warmup=10, rep=rep, return_mode="median",
            )  # fmt: skip
        finally:
            rope_ops._config_override = None
        row = dict(block_t=block_t, block_h=block_h, num_warps=warps, T=seqlen, fwd_ms=f, bwd_ms=b)
        row.update(fwd_gbps=nbytes / f / 1e6, bwd_gbps=nbytes / b / 1e6)
        rows.append(row)
        print(f"sweep T={seqlen} BLOCK_T={block_t} BLOCK_H={block_h} warps={warps}: fwd "
              f"{row['fwd_gbps']:.0f} GB/s, bwd {row['bwd_gbps']:.0f} GB/s")  # fmt: skip
    return rows


def moved_bytes(q, k, cos) -> int:
    return 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096,16384,65536,262144")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--peak-tbps", type=float, default=4.3)
    parser.add_argument("--rep", type=int, default=60, help="do_bench rep (ms) per measurement")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel tile configs")
    args = parser.parse_args()

    head = header()
    print("## RoPE benchmark\n")
    print(" | ".join(f"{k}: {v}" for k, v in head.items()), "\n")
    peak = args.peak_tbps * 1e12
    rows = []
    found = providers()
    for seqlen in [int(t) for t in args.tokens.split(",")]:
        q, k, cos, sin, table, cu = packed_inputs(seqlen)
        nbytes = moved_bytes(q, k, cos)
        times = {}
        for name, fn in found.items():
            times[name] = time_provider(fn, q, k, cos, sin, args.rep)
            torch.cuda.empty_cache()
        times.update(time_hf_varlen_variants(q, k, cos, sin, table, cu, args.rep))
        ours = times["hf_varlen"]
        for name, (fwd, bwd, bwd_exp) in times.items():
            print(f"T={seqlen} {name}: fwd {fwd:.4f} ms, bwd {bwd:.4f} ms, "
                  f"bwd (expanded grad) {bwd_exp:.4f} ms", flush=True)  # fmt: skip
        for name, (fwd, bwd, bwd_exp) in times.items():
            passes = (
                ("fwd", fwd, ours[0]),
                ("bwd", bwd, ours[1]),
                ("bwd_expanded", bwd_exp, ours[2]),
            )
            for pass_, ms, ref in passes:
                if ms != ms:  # nan: pass not timed for this variant
                    continue
                gbps = nbytes / ms / 1e6
                rows.append(dict(T=seqlen, pass_=pass_, provider=name, ms=ms, gbps=gbps,
                                 pct_peak=100 * gbps * 1e9 / peak, hf_varlen_speedup=ms / ref,
                                 bytes=nbytes))  # fmt: skip
        del q, k, cos, sin, table, cu
        torch.cuda.empty_cache()
        write_json(args, head, rows, [])  # partial results survive an interrupted run

    print("| T | pass | provider | ms | GB/s | % of peak | hf_varlen speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['pass_']} | {r['provider']} | {r['ms']:.4f} | {r['gbps']:.0f} | "
              f"{r['pct_peak']:.1f}% | {r['hf_varlen_speedup']:.2f}x |")  # fmt: skip
    print("\nfwd+bwd (ms) and hf_varlen speedup:\n")
    print("| T | provider | fwd+bwd ms | hf_varlen speedup |")
    print("|---|---|---|---|")
    fb = {}
    for r in rows:
        if r["pass_"] in ("fwd", "bwd"):
            fb.setdefault((r["T"], r["provider"]), []).append(r["ms"])
    for (seqlen, name), ms in fb.items():
        if len(ms) == 2:
            ours = sum(fb[(seqlen, "hf_varlen")])
            print(f"| {seqlen} | {name} | {sum(ms):.4f} | {sum(ms) / ours:.2f}x |")
    sweep_rows = []
    if args.sweep:
        for seqlen in (16384, 65536):
            sweep_rows += sweep(seqlen, max(20, args.rep // 2))
    write_json(args, head, rows, sweep_rows)
    if args.json:
        print(f"\nwrote {args.json}")


def write_json(args, head, rows, sweep_rows) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"header": head, "peak_tbps": args.peak_tbps, "rows": rows, "sweep": sweep_rows}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
