"""Benchmark varlen attention backends on packs of real document lengths (forward, backward, f+b).

Providers go through ``hf_varlen.varlen_attention(..., backend=X)`` (triton, torch, flex, fa4,
flash_attn) plus ``sdpa_padded``: torch SDPA (causal) on the zero-padded (n_docs, H, L_max, D) batch.
For flex the document BlockMask build is timed separately (the attention timings reuse the mask, as
all layers of one forward do). Useful FLOPs (FlashAttention's count): sum over documents of 4 * L^2 * D * H_q / 2
for the causal forward; backward = 2.5x, forward+backward = 3.5x. "floor" is the HBM-traffic bound
(read q, k, v, write o; backward reads q, k, v, o, dO, writes dq, dk, dv) at 4.3 TB/s.
"match" applies the numerics rule (hf_varlen.testing) (hf_varlen.testing) to the output and, for packs
whose documents are all <= 4096 tokens, to dq/dk/dv; longer documents are checked on their last
512 query rows (forward only).

    python scripts/bench_attention.py --make-lengths --shared-data ../shared/data   # once (CPU ok)
    python scripts/bench_attention.py [--providers triton,flex] [--cases alpaca64k] [--heads 32/8/128]
        [--json out/attn.json] [--breakdown] [--tune]

The document lengths come from scripts/data/lengths_{alpaca,lima}.json (Qwen2 tokenizer, alpaca
prompt format of ../shared/data/README.md, no special tokens), so the GPU machine needs no data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config as functorch_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_cases import HEADS, cases, crossover_cases, floor_ms, make_lengths, useful_flops_fwd  # noqa: E402
from attention_targets import targets  # noqa: E402
from attention_tuning import best_config, breakdown, programs_sweep, tune  # noqa: E402
from bench_common import bench_ms  # noqa: E402
from bench_common import run_header as header  # noqa: E402

HERE = Path(__file__).resolve().parent
# the default run; also known: the triton variants below
PROVIDERS = ["triton", "torch", "flex", "fa4", "flash_attn", "sdpa_padded"]
# triton with KernelConfig fields changed in every config it picks (short and long path)
TRITON_VARIANTS = {
    "triton_fused_bwd": {"bwd_fused": True},  # the fused (atomic dQ) backward
    "triton_tma": {"tma": True},  # tensor-descriptor (TMA) loads of the streamed blocks
    # both: Q/dO streamed by descriptors, dQ reduced into its fp32 buffer in bulk (FA3's scheme)
    "triton_fused_tma": {"bwd_fused": True, "tma": True},
}


# ---- providers ------------------------------------------------------------------------------------


def varlen_provider(name, cu, max_len):
    import hf_varlen

    def fn(q, k, v):
        return hf_varlen.varlen_attention(q, k, v, cu, cu, max_len, max_len, backend=name)

    return fn


@contextlib.contextmanager
def triton_variant(fields: dict):
    """The triton backend with ``fields`` of KernelConfig replaced in its short and long configs
    (the providers of TRITON_VARIANTS)."""
    import dataclasses

    from hf_varlen.ops.attention import launch as attention

    pick, pick_long = attention.pick_config, attention.pick_long_path

    def long_path(*a):
        lp = pick_long(*a)
        return lp and dataclasses.replace(lp, cfg=dataclasses.replace(lp.cfg, **fields))

    attention.pick_config = lambda *a: dataclasses.replace(pick(*a), **fields)
    attention.pick_long_path = long_path
    try:
        yield
    finally:
        attention.pick_config, attention.pick_long_path = pick, pick_long


def padded_provider(lengths, device):
    """SDPA on the zero-padded batch; the pad/unpad copies are outside the timed region."""
    import torch.nn.functional as F

    n, lmax = len(lengths), max(lengths)
    starts = torch.tensor([0] + lengths[:-1], device=device).cumsum(0)
    pos = torch.arange(lmax, device=device)
    lens = torch.tensor(lengths, device=device)
    valid = pos[None, :] < lens[:, None]  # (n, L)
    src = (starts[:, None] + pos[None, :])[valid]

    def to_padded(x):  # (T, H, D) -> (n, H, L, D), a leaf so backward stops here
        out = x.new_zeros(n, lmax, x.shape[1], x.shape[2])
        out[valid] = x[src]
        return out.transpose(1, 2).detach().requires_grad_(x.requires_grad)

    def prepare(q, k, v):
        return to_padded(q), to_padded(k), to_padded(v)

    def fn(qp, kp, vp):
        return F.scaled_dot_product_attention(
            qp, kp, vp, is_causal=True, enable_gqa=qp.shape[1] != kp.shape[1]
        )

    def unpad(o):
        return o.transpose(1, 2)[valid]

    return prepare, fn, unpad


def time_provider(fn, q, k, v, grad):
    """(fwd, bwd, fwd+bwd) medians in ms; q, k, v require grad."""
    leaves = [q, k, v]
    fwd = bench_ms(lambda: fn(q, k, v))
    # Compiled FlexAttention donates saved buffers to its backward, which then refuses the repeated
    # backward(retain_graph=True) this timing needs; donation saves memory, not time, so turn it off.
    functorch_config.donated_buffer = False
    graph = [fn(q, k, v)]
    bwd = bench_ms(lambda: graph[0].backward(grad, retain_graph=True), grad_to_none=leaves)
    graph.clear()  # frees the saved activations before the next measurement
    fb = bench_ms(lambda: fn(q, k, v).backward(grad), grad_to_none=leaves)
    return fwd, bwd, fb


# ---- reference match ------------------------------------------------------------------------------


def reference_results(q, k, v, lengths, cu, grad, with_grads):
    """{"out": (hi, lo), "dq": ...}; long documents (> 8192) contribute only their last 512 rows."""
    from hf_varlen.reference.attention import attention_reference

    long = [i for i, n in enumerate(lengths) if n > 8192]
    res = {}
    if not long:
        for tag, dt in (("hi", torch.float32), ("lo", q.dtype)):
            qq, kk, vv = (t.detach().to(dt).requires_grad_(with_grads) for t in (q, k, v))
            o = attention_reference(qq, kk, vv, cu, cu)
            res.setdefault("out", {})[tag] = o.detach()
            if with_grads:
                o.backward(grad.to(dt))
                for name, t in (("dq", qq), ("dk", kk), ("dv", vv)):
                    res.setdefault(name, {})[tag] = t.grad
        return {kk: (vv["hi"], vv["lo"]) for kk, vv in res.items()}, None
    # forward only: short documents through the reference, long ones on their last 512 rows
    rows = torch.cat(
        [torch.arange(int(cu[i]), int(cu[i + 1])) for i in range(len(lengths)) if i not in long]
        + [torch.arange(int(cu[i + 1]) - 512, int(cu[i + 1])) for i in long]
    ).to(q.device)
    short = [n for n in lengths if n <= 8192]
    out = {}
    for tag, dt in (("hi", torch.float32), ("lo", q.dtype)):
        pieces = []
        if short:
            idx = torch.cat(
                [
                    torch.arange(int(cu[i]), int(cu[i + 1]))
                    for i in range(len(lengths))
                    if i not in long
                ]
            ).to(q.device)
            cu_s = torch.tensor(
                [0] + list(torch.tensor(short).cumsum(0)), dtype=torch.int32, device=q.device
            )
            pieces.append(
                attention_reference(q[idx].to(dt), k[idx].to(dt), v[idx].to(dt), cu_s, cu_s)
            )
        for i in long:
            s0, s1 = int(cu[i]), int(cu[i + 1])
            g = q.shape[1] // k.shape[1]
            qq = q[s1 - 512 : s1].to(dt).transpose(0, 1)
            kk = k[s0:s1].to(dt).transpose(0, 1).repeat_interleave(g, 0)
            vv = v[s0:s1].to(dt).transpose(0, 1).repeat_interleave(g, 0)
            s = torch.matmul(qq, kk.transpose(1, 2)) * q.shape[-1] ** -0.5
            mask = (
                torch.arange(s1 - s0, device=q.device)[None, :]
                <= torch.arange(s1 - s0 - 512, s1 - s0, device=q.device)[:, None]
            )
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1, dtype=torch.float32).to(dt)
            pieces.append(torch.matmul(p, vv).transpose(0, 1))
            del s, p
        out[tag] = torch.cat(pieces)
    return {"out": (out["hi"], out["lo"])}, rows


def match(got, ref, rows) -> str:
    from hf_varlen.testing import numerics_error

    worst = []
    for name, (hi, lo) in ref.items():
        x = got[name] if rows is None else got[name][rows]
        ok, msg = numerics_error(x, hi, lo, factor=2.0 if name == "out" else 3.0)
        if not ok:
            return f"FAIL {name}: {msg}"
        err = (x.float() - hi.float()).abs().max().item()
        worst.append(f"{name} {err:.1e}")
    return "ok (" + ", ".join(worst) + ")"


# ---- main -----------------------------------------------------------------------------------------


def run_case(case, lengths, heads, providers, device, dtype, check):
    import hf_varlen

    h_q, h_kv, d = HEADS[heads]
    total = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(total, h_q, d, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(total, h_kv, d, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(total, h_kv, d, device=device, dtype=dtype, generator=g).requires_grad_()
    grad = torch.randn(total, h_q, d, device=device, dtype=dtype, generator=g)
    flops = useful_flops_fwd(lengths, h_q, d)
    fl_f, fl_fb = floor_ms(total, h_q, h_kv, d)
    with_grads = max(lengths) <= 4096
    ref = rows = None
    if check:
        try:
            ref, rows = reference_results(q, k, v, lengths, cu, grad, with_grads)
        except torch.OutOfMemoryError:
            ref = None
        torch.cuda.empty_cache()
    base = dict(
        case=case,
        heads=heads,
        tokens=total,
        docs=len(lengths),
        max_len=max(lengths),
        useful_gflop_fwd=flops / 1e9,
        floor_fwd_ms=fl_f,
        floor_fb_ms=fl_fb,
    )
    rows_out = []
    for name in providers:
        row = dict(base, provider=name)
        try:
            extra = ""
            if name == "sdpa_padded":
                prepare, fn, unpad = padded_provider(lengths, device)
                qp, kp, vp = prepare(q, k, v)
                gp = prepare(grad, grad[:, :h_kv], grad[:, :h_kv])[0].detach()
                fwd, bwd, fb = time_provider(fn, qp, kp, vp, gp)
                pad = 1 - total / (len(lengths) * max(lengths))
                extra = f"{pad:.0%} padding"
                got = None
                if ref is not None:
                    qp.grad = kp.grad = vp.grad = None
                    o = fn(qp, kp, vp)
                    got = {"out": unpad(o.detach())}
                    if rows is None and with_grads:
                        o.backward(prepare(grad, grad[:, :h_kv], grad[:, :h_kv])[0].detach())
                        got.update(dq=unpad(qp.grad), dk=unpad(kp.grad), dv=unpad(vp.grad))
                del qp, kp, vp, gp
            else:
                variant = TRITON_VARIANTS.get(name)
                backend = "triton" if variant else name
                with triton_variant(variant) if variant else contextlib.nullcontext():
                    reason = hf_varlen.backends.unavailable_reason(backend)
                    if reason is not None:
                        raise RuntimeError(reason)
                    fn = varlen_provider(backend, cu, max(lengths))
                    if name == "flex":
                        extra = f"mask build {flex_mask_build_ms(cu, total):.2f} ms"
                    fn(q, k, v)  # warm-up / compile
                    fwd, bwd, fb = time_provider(fn, q, k, v, grad)
                    got = None
                    if ref is not None:
                        q.grad = k.grad = v.grad = None
                        o = fn(q, k, v)
                        got = {"out": o.detach()}
                        if with_grads:
                            o.backward(grad)
                            got.update(dq=q.grad, dk=k.grad, dv=v.grad)
                        q.grad = k.grad = v.grad = None
            row.update(
                fwd_ms=fwd, bwd_ms=bwd, fb_ms=fb, tflops_fb=3.5 * flops / fb / 1e9, extra=extra
            )
            if got is not None:
                got_ref = {kk: vv for kk, vv in ref.items() if kk in got}
                row["match"] = match(got, got_ref, rows)
            else:
                row["match"] = "n/a" if ref is None else "-"
        except torch.OutOfMemoryError:
            row["error"] = "OOM"
        except Exception as exc:  # a provider that cannot run this case: report, keep going
            row["error"] = f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
        torch.cuda.empty_cache()
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def flex_mask_build_ms(cu, total) -> float:
    from hf_varlen.backends.flex import document_block_mask

    times = []
    for _ in range(6):
        fresh = cu.clone()  # a new tensor object defeats the per-batch cache: a real rebuild
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        document_block_mask(fresh, fresh, total, total, causal=True, window_size=(-1, -1))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times[1:])[len(times[1:]) // 2]


def table(rows) -> str:
    tri = {(r["case"], r["heads"]): r for r in rows if r["provider"] == "triton" and "fb_ms" in r}
    out = [
        "| case | heads | tokens / docs / max | provider | fwd ms | bwd ms | f+b ms | TFLOP/s f+b "
        "| triton speedup (f+b) | % of HBM floor (f+b) | match | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['tokens']} / {r['docs']} / {r['max_len']}"
        if "error" in r:
            out.append(
                f"| {r['case']} | {r['heads']} | {shape} | {r['provider']} | {r['error']} "
                "| | | | | | | |"
            )
            continue
        t = tri.get((r["case"], r["heads"]))
        speed = f"{r['fb_ms'] / t['fb_ms']:.2f}x" if t else "-"
        out.append(
            f"| {r['case']} | {r['heads']} | {shape} | {r['provider']} | {r['fwd_ms']:.3f} | "
            f"{r['bwd_ms']:.3f} | {r['fb_ms']:.3f} | {r['tflops_fb']:.0f} | {speed} | "
            f"{r['floor_fb_ms'] / r['fb_ms']:.0%} | {r.get('match', '-')} | {r.get('extra', '')} |"
        )
    return "\n".join(out)


def case_names(spec: str, issue_cases: list[str], crossover: list[str]) -> list[str]:
    """--cases: a comma list of case names, where 'all' stands for issue 16's cases and
    'crossover' for the crossover packs (in a list too: 'crossover,128k'); an unknown name exits
    before any GPU work, naming the known ones."""
    groups = {"all": issue_cases, "crossover": crossover}
    names = [n for part in spec.split(",") if part for n in groups.get(part, [part])]
    unknown = [n for n in names if n not in issue_cases and n not in crossover]
    if unknown or not names:
        raise SystemExit(
            f"--cases {spec!r}: unknown case(s) {unknown}; known: 'all', 'crossover', "
            f"{issue_cases + crossover}"
        )
    return list(dict.fromkeys(names))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--make-lengths", action="store_true", help="tokenize the shared data, write scripts/data"
    )
    ap.add_argument("--shared-data", type=Path, default=HERE.parents[1] / "shared" / "data")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument(
        "--cases",
        default="all",
        help="comma list of case names; 'all' (default): issue 16's cases; 'crossover': the packs "
        "that place auto's switch to FA4 and torch (attention_cases.crossover_cases); both may "
        "appear in the list",
    )
    ap.add_argument("--heads", default="32/8/128", help=f"comma list from {list(HEADS)} or 'all'")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--no-check", action="store_true", help="skip the reference match column")
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="time the first case without running it once before (discarded) as a warm-up",
    )
    ap.add_argument(
        "--breakdown", action="store_true", help="per-kernel times of the triton backend"
    )
    ap.add_argument(
        "--tune", action="store_true", help="sweep triton block configs on the chosen cases"
    )
    ap.add_argument(
        "--tune-set",
        choices=["short", "long", "programs"],
        default="short",
        help="with --tune: the candidates for short-document tiles or for long-document tiles; "
        "'programs': the shipped long config's persistent launches at 1-4 programs per SM "
        "(LongPath.programs_per_sm) against one program per tile, with the compiled resources",
    )
    ap.add_argument(
        "--long-min-span",
        type=int,
        default=1024,
        help="with --tune-set long --write-config: the span from which a tile takes the long path",
    )
    ap.add_argument("--write-config", type=Path, help="with --tune: write the chosen config JSON")
    ap.add_argument("--json", type=Path, help="write header + rows as JSON")
    args = ap.parse_args(argv)
    if args.make_lengths:
        make_lengths(args.shared_data)
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (use --make-lengths on CPU)")
    all_cases = cases()
    extra = crossover_cases()
    names = case_names(args.cases, list(all_cases), list(extra))
    all_cases.update(extra)
    heads = list(HEADS) if args.heads == "all" else args.heads.split(",")
    hdr = header()
    print(" | ".join(f"{k}: {v}" for k, v in hdr.items()), flush=True)
    dtype = getattr(torch, args.dtype)
    result = {"header": hdr}
    if args.tune or args.breakdown:
        if args.tune and args.tune_set == "programs":
            result["programs"] = programs_sweep(all_cases, names, heads, dtype)
        elif args.tune:
            result["tune"] = tune(all_cases, names, heads, dtype, args.tune_set)
            result["chosen"] = best_config(result["tune"])
            if args.write_config:  # usable via HF_VARLEN_TRITON_ATTN_CONFIG=<path>
                prefix = "long" if args.tune_set == "long" else ""
                chosen = {f"{prefix}{d}": result["chosen"] for d in (64, 128)}
                if prefix:
                    chosen["long_min_span"] = args.long_min_span
                args.write_config.write_text(json.dumps(chosen))
        if args.breakdown:
            result["breakdown"] = breakdown(all_cases, names, heads, dtype)
    else:
        rows = []
        if not args.no_warmup:  # the first case of a process read 5-10% slow in every run (runs
            # M, N): run it once, discarded, so that every timed case finds the GPU warm
            print(f"warm-up (discarded): {names[0]} {heads[0]}", flush=True)
            run_case(names[0], all_cases[names[0]], heads[0], args.providers.split(","), "cuda",
                     dtype, False)  # fmt: skip
        for case in names:
            for h in heads:
                rows += run_case(
                    case,
                    all_cases[case],
                    h,
                    args.providers.split(","),
                    "cuda",
                    dtype,
                    not args.no_check,
                )
        print()
        print(" | ".join(f"{k}: {v}" for k, v in hdr.items()))
        print()
        print(table(rows))
        print()
        result["targets"] = targets(rows)
        print("\n".join(result["targets"]))
        result["rows"] = rows
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
