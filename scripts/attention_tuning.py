"""The triton attention's internals for scripts/bench_attention.py: a block-config sweep per kernel
(``--tune``) and the per-kernel breakdown of the shipped config (``--breakdown``).

Candidates are (block_m, block_n, warps, stages); for dK/dV (block_n = key tokens, block_m = query
rows, warps, stages). ``--tune-set long`` sweeps the configs meant for tiles of long documents
(bigger tiles, 8 warps; the long-document path of attention_schedule.py) instead of the short ones.
"""

from __future__ import annotations

import json
import math

import torch
from attention_cases import HBM_BYTES_PER_S, HEADS, useful_flops_fwd
from bench_common import bench_ms

# (block_m, block_n, warps, stages); for dK/dV: (block_n = key tokens, block_m = query rows, ...)
FWD_CANDIDATES = [
    (128, 32, 4, 3),
    (128, 32, 4, 2),
    (64, 32, 4, 3),
    (128, 16, 4, 3),
    (128, 32, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 16, 4, 3),
    (128, 32, 4, 4),
]
DQ_CANDIDATES = [
    (64, 64, 4, 2),
    (64, 64, 4, 1),
    (64, 32, 4, 1),
    (32, 64, 4, 2),
    (64, 64, 8, 2),
    (128, 64, 8, 2),
    (64, 32, 4, 2),
    (128, 32, 8, 2),
    (64, 64, 4, 3),
]
DKDV_CANDIDATES = [
    (64, 32, 4, 2),
    (64, 32, 4, 1),
    (64, 32, 4, 3),
    (128, 64, 8, 2),
    (64, 32, 8, 2),
    (32, 32, 4, 2),
    (64, 16, 4, 2),
    (64, 64, 4, 2),
    (32, 16, 4, 2),
    (128, 32, 8, 2),
    (32, 64, 4, 2),
]


# For tiles of long documents: the loops are long, so bigger steps and 8 warps can pay where the
# short set's small steps waste least on many-document tiles.
LONG_FWD_CANDIDATES = [
    (128, 32, 4, 3),  # the short default, for reference
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (256, 64, 8, 3),
    (256, 32, 8, 3),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
]
LONG_DQ_CANDIDATES = [
    (64, 64, 4, 2),  # the short default
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 32, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 8, 2),
    (64, 64, 4, 3),
    (128, 32, 8, 4),
    (64, 32, 4, 3),
]
LONG_DKDV_CANDIDATES = [
    (64, 32, 4, 2),  # the short default
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (64, 64, 4, 3),
    (128, 32, 8, 3),
    (64, 32, 4, 3),
    (128, 16, 8, 3),
]
CANDIDATES = {
    "short": (FWD_CANDIDATES, DQ_CANDIDATES, DKDV_CANDIDATES),
    "long": (LONG_FWD_CANDIDATES, LONG_DQ_CANDIDATES, LONG_DKDV_CANDIDATES),
}


def _triton_setup(lengths, heads, dtype, device="cuda"):
    from hf_varlen.ops.attention import triton_varlen_attention
    from hf_varlen.ops.attention.schedule import get_plan

    h_q, h_kv, d = HEADS[heads]
    total = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(total, h_q, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(total, h_kv, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(total, h_kv, d, device=device, dtype=dtype, generator=g)
    do = torch.randn_like(q)
    o, lse = triton_varlen_attention(q, k, v, cu, cu, return_lse=True)
    plan = get_plan(cu, cu, total, total, -1, 0)
    return dict(
        q=q,
        k=k,
        v=v,
        o=o,
        do=do,
        lse=lse,
        cu=cu,
        plan=plan,
        scale=d**-0.5,
        delta=torch.empty_like(lse),
        dq=torch.empty_like(q),
        dk=torch.empty_like(k),
        dv=torch.empty_like(v),
        group=h_q // h_kv,
    )


def _folds(group, block_m):
    """The two largest GQA folds that keep >= 8 tokens per step (run 1 showed smaller ones lose)."""
    return [f for f in range(1, group + 1) if group % f == 0 and block_m // f >= 8][-2:]


def _launchers(s):
    """Closures that launch one kernel with an explicit (config, fold) on the tensors of ``s``."""
    from hf_varlen.ops.attention.bwd import backward_dkdv, backward_dq
    from hf_varlen.ops.attention.fwd import attention_forward

    p = s["plan"]

    def kw(bm, bn, w, st, f):
        return dict(fold=f, block_m=bm, block_n=bn, num_warps=w, num_stages=st,
                    softmax_scale=s["scale"], softcap=0.0)  # fmt: skip

    def fwd(bm, bn, w, st, f):
        args = (s["q"], s["k"], s["v"], p.lo_q, p.hi_q, p.order_q(bm // f))
        return lambda: attention_forward(*args, **kw(bm, bn, w, st, f))

    def dq(bm, bn, w, st, f):
        args = (s["do"], s["q"], s["k"], s["v"], s["o"], s["lse"], s["delta"], s["dq"], p.lo_q,
                p.hi_q, p.order_q(bm // f))  # fmt: skip
        return lambda: backward_dq(*args, **kw(bm, bn, w, st, f))

    def dkdv(bn, bm, w, st, f):
        args = (s["do"], s["q"], s["k"], s["v"], s["lse"], s["delta"], s["dk"], s["dv"], p.qlo_k,
                p.qhi_k, p.order_k(bn))  # fmt: skip
        return lambda: backward_dkdv(*args, **kw(bm, bn, w, st, f))

    return {"fwd": fwd, "dq": dq, "dkdv": dkdv}


def best_config(rows, min_tokens_floor=8):
    """One KernelConfig per kernel: the (config, fold) with the smallest sum over cases of time
    relative to that case's best (every case weighs the same). Returns the 15-int list."""
    from collections import defaultdict

    best_case = defaultdict(lambda: float("inf"))
    for r in rows:
        if not math.isnan(r["ms"]):
            best_case[r["kernel"], r["case"]] = min(best_case[r["kernel"], r["case"]], r["ms"])
    score = defaultdict(float)
    for r in rows:
        ms = r["ms"] if not math.isnan(r["ms"]) else float("inf")
        score[r["kernel"], tuple(r["config"]), r["fold"]] += ms / best_case[r["kernel"], r["case"]]
    cfg = []
    for kernel in ("fwd", "dq", "dkdv"):
        (_, c, f), _s = min(
            ((k, v) for k, v in score.items() if k[0] == kernel), key=lambda kv: kv[1]
        )
        rows_per_step = c[1] if kernel == "dkdv" else c[0]
        cfg += [*c, max(min_tokens_floor, rows_per_step // f)]
        print(f"chosen {kernel}: {c} fold {f} (relative score {_s:.3f})")
    return cfg


def _compiled(fn) -> dict:
    """{cache key: compiled kernel} of the JIT kernel ``fn`` over every device it ran on."""
    return {k: v for cache in fn.device_caches.values() for k, v in cache[0].items()}


def _new_variants(fn, before: dict) -> list[dict]:
    """Registers and spills of the variants of ``fn`` compiled since ``before`` (_compiled)."""
    try:
        return [
            dict(n_regs=v.n_regs, n_spills=v.n_spills, shared=v.metadata.shared)
            for k, v in _compiled(fn).items()
            if k not in before
        ]
    except (AttributeError, IndexError, TypeError):  # triton internals moved
        return []


def _kernel_fns() -> dict:
    from hf_varlen.ops.attention.bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel
    from hf_varlen.ops.attention.fwd import _attn_fwd_kernel

    return {"fwd": _attn_fwd_kernel, "dq": _attn_bwd_dq_kernel, "dkdv": _attn_bwd_dkdv_kernel}


def tune(all_cases, names, heads, dtype, tune_set="short"):
    """Time every candidate config (x GQA fold) of each kernel on each case; print the best, with
    the registers and spills of each candidate's compiled kernel (spilling long-path kernels at
    head dim 128 were found this way)."""
    fwd_c, dq_c, dkdv_c = CANDIDATES[tune_set]
    fns = _kernel_fns()
    out, variants = [], {}  # (heads, kernel, config, fold) -> compiled variants (first compile)
    for h in heads:
        for case in names:
            s = _triton_setup(all_cases[case], h, dtype)
            launch = _launchers(s)
            launch["dq"](64, 64, 4, 2, 1)()  # delta for the dK/dV runs
            for kernel, cands in (
                ("fwd", fwd_c),
                ("dq", dq_c),
                ("dkdv", dkdv_c),
            ):
                res = []
                for c in cands:
                    for f in _folds(s["group"], c[1] if kernel == "dkdv" else c[0]):
                        before = _compiled(fns[kernel])
                        try:
                            ms = bench_ms(launch[kernel](*c, f))
                        except Exception as exc:  # e.g. out of shared memory for this config
                            ms = float("nan")
                            print(
                                f"  {kernel} {c} fold {f}: {type(exc).__name__}: {str(exc)[:100]}"
                            )
                        res.append((ms, c, f))
                        key = (h, kernel, tuple(c), f)
                        variants[key] = _new_variants(fns[kernel], before) or variants.get(key, [])
                        out.append(dict(heads=h, case=case, kernel=kernel, config=c, fold=f, ms=ms,
                                        compiled=variants[key]))  # fmt: skip
                res = sorted(r for r in res if not math.isnan(r[0]))
                top = ", ".join(
                    f"{c} f{f}: {ms:.3f}"
                    + "".join(
                        f" [{v['n_regs']} regs, {v['n_spills']} spilled]"
                        for v in variants.get((h, kernel, tuple(c), f), [])
                    )  # fmt: skip
                    for ms, c, f in res[:4]
                )
                print(f"{h} {case} {kernel}: best {top}", flush=True)
            del s
            torch.cuda.empty_cache()
    return out


def _issued_flops(lo, hi, tile_rows, rows_per_step, step, cols, matmuls, d, programs_per_tile):
    """FLOPs the kernel actually issues: every step multiplies a (rows x step) block, masked or not."""
    n = lo.numel()
    n_tiles = -(-n // tile_rows)
    pad = n_tiles * tile_rows - n
    lo = torch.nn.functional.pad(lo.long(), (0, pad), value=2**31 - 1).view(n_tiles, tile_rows)
    hi = torch.nn.functional.pad(hi.long(), (0, pad), value=-1).view(n_tiles, tile_rows)
    span = (hi.amax(1) - lo.amin(1) + 1).clamp_min(0)
    steps = (span + step - 1) // step
    return float(steps.sum()) * rows_per_step * cols * d * 2 * matmuls * programs_per_tile


def _backward_variants_ms(s, cfg) -> dict[str, float]:
    """The whole backward of the default config, split (the default) and fused (atomic dQ)."""
    import dataclasses

    from hf_varlen.ops.attention.bwd import attention_backward

    args = (s["do"], s["q"], s["k"], s["v"], s["o"], s["lse"], s["plan"])
    kw = dict(softmax_scale=s["scale"], softcap=0.0)
    labels = {False: "backward split (dq + dkdv)", True: "backward fused (delta + atomic-dq dkdv)"}
    cfgs = {label: dataclasses.replace(cfg, bwd_fused=f) for f, label in labels.items()}
    return {
        k: bench_ms(lambda c=c: attention_backward(*args, cfg=c, **kw)) for k, c in cfgs.items()
    }


def breakdown(all_cases, names, heads, dtype):
    """Per-kernel time, issued vs useful FLOPs and HBM floor of the triton backend's default config."""
    from hf_varlen.ops.attention.schedule import fold_factor, get_plan, pick_config

    out = []
    for h in heads:
        h_q, h_kv, d = HEADS[h]
        for case in names:
            lengths = all_cases[case]
            s = _triton_setup(lengths, h, dtype)
            cfg = pick_config(d, dtype, s["q"].device)
            f_fwd = fold_factor(s["group"], cfg.fwd_block_m, cfg.fwd_min_tokens)
            f_dq = fold_factor(s["group"], cfg.dq_block_m, cfg.dq_min_tokens)
            f_kv = fold_factor(s["group"], cfg.kv_block_m, cfg.kv_min_tokens)
            launch = _launchers(s)
            total = sum(lengths)

            def plan_build(
                cu=s["cu"],
                total=total,
                tiles=(cfg.fwd_block_m // f_fwd, cfg.dq_block_m // f_dq, cfg.kv_block_n),
            ):
                fresh = cu.clone()  # a new tensor object: a real (uncached) build
                plan = get_plan(fresh, fresh, total, total, -1, 0)
                plan.order_q(tiles[0])
                plan.order_q(tiles[1])
                plan.order_k(tiles[2])

            fwd_c = (cfg.fwd_block_m, cfg.fwd_block_n, cfg.fwd_warps, cfg.fwd_stages, f_fwd)
            dq_c = (cfg.dq_block_m, cfg.dq_block_n, cfg.dq_warps, cfg.dq_stages, f_dq)
            kv_c = (cfg.kv_block_n, cfg.kv_block_m, cfg.kv_warps, cfg.kv_stages_at(f_kv), f_kv)
            times = {
                "plan": bench_ms(plan_build),
                "fwd": bench_ms(launch["fwd"](*fwd_c)),
                "dq": bench_ms(launch["dq"](*dq_c)),
                "dkdv": bench_ms(launch["dkdv"](*kv_c)),
            }
            p = s["plan"]
            useful = useful_flops_fwd(lengths, h_q, d)
            bm, bn, bq, bk = cfg.fwd_block_m, cfg.fwd_block_n, cfg.dq_block_m, cfg.dq_block_n
            kn, km = cfg.kv_block_n, cfg.kv_block_m
            issued = {  # (lo, hi, tile rows, rows per step, step, cols, matmuls, d, programs/tile)
                "fwd": _issued_flops(p.lo_q, p.hi_q, bm // f_fwd, bm, bn, bn, 2, d, h_q // f_fwd),
                "dq": _issued_flops(p.lo_q, p.hi_q, bq // f_dq, bq, bk, bk, 3, d, h_q // f_dq),
                "dkdv": _issued_flops(
                    p.qlo_k, p.qhi_k, kn, km, km // f_kv, kn, 4, d, h_kv * (s["group"] // f_kv)
                ),  # fmt: skip
            }
            useful_k = {"fwd": useful, "dq": 1.5 * useful, "dkdv": 2.0 * useful}
            q_b, kv_b = total * h_q * d * 2, total * h_kv * d * 2
            bytes_k = {
                "fwd": 2 * q_b + 2 * kv_b,
                "dq": 4 * q_b + 2 * kv_b,
                "dkdv": 2 * q_b + 4 * kv_b,
            }
            for kern in ("fwd", "dq", "dkdv"):
                ms = times[kern]
                row = dict(
                    heads=h,
                    case=case,
                    kernel=kern,
                    ms=ms,
                    useful_tflops=useful_k[kern] / ms / 1e9,
                    issued_tflops=issued[kern] / ms / 1e9,
                    issued_over_useful=issued[kern] / useful_k[kern],
                    hbm_floor_ms=bytes_k[kern] / HBM_BYTES_PER_S * 1e3,
                )
                out.append(row)
                print(json.dumps(row), flush=True)
            out.append(dict(heads=h, case=case, kernel="plan (once per batch)", ms=times["plan"]))
            for label, ms in _backward_variants_ms(s, cfg).items():
                out.append(dict(heads=h, case=case, kernel=label, ms=ms))
                print(f"{h} {case}: {label} {ms:.3f} ms", flush=True)
            print(
                f"{h} {case}: plan build {times['plan']:.3f} ms (once per batch, cached across layers)"
            )
            del s
            torch.cuda.empty_cache()
    return out


def _resident_per_sm(fn, device) -> list[dict]:
    """Registers / shared memory of every compiled variant of the JIT kernel ``fn`` on ``device``
    and how many of its programs fit on one SM at once (the persistent launch's ceiling)."""
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    out = []
    for cache in fn.device_caches.values():
        for kern in cache[0].values():
            warps, shared = kern.metadata.num_warps, kern.metadata.shared
            by_regs = regs_sm // max(1, kern.n_regs * 32 * warps)
            # a program reserves 1 KiB of shared memory beyond what the kernel declares
            by_smem = smem_sm // (shared + 1024)
            out.append(dict(n_regs=kern.n_regs, n_spills=kern.n_spills, shared=shared,
                            warps=warps, stages=kern.metadata.num_stages, resident=min(by_regs, by_smem,
                                                      threads_sm // (32 * warps))))  # fmt: skip
    return out


def _long_launch(s, c, kernel, fold, order, bound):
    """A closure launching one kernel ("fwd", "dq", "kv") of config ``c`` over ``order``."""
    from hf_varlen.ops.attention.bwd import backward_dkdv, backward_dq
    from hf_varlen.ops.attention.fwd import attention_forward

    p, kw = s["plan"], dict(softmax_scale=s["scale"], softcap=0.0, bound=bound)
    if kernel == "fwd":
        return lambda: attention_forward(
            s["q"], s["k"], s["v"], p.lo_q, p.hi_q, order, fold=fold, block_m=c.fwd_block_m,
            block_n=c.fwd_block_n, num_warps=c.fwd_warps, num_stages=c.fwd_stages, **kw,
        )  # fmt: skip
    if kernel == "dq":
        return lambda: backward_dq(
            s["do"], s["q"], s["k"], s["v"], s["o"], s["lse"], s["delta"], s["dq"], p.lo_q,
            p.hi_q, order, fold=fold, block_m=c.dq_block_m, block_n=c.dq_block_n,
            num_warps=c.dq_warps, num_stages=c.dq_stages, **kw,
        )  # fmt: skip
    return lambda: backward_dkdv(
        s["do"], s["q"], s["k"], s["v"], s["lse"], s["delta"], s["dk"], s["dv"], p.qlo_k, p.qhi_k,
        order, fold=fold, block_m=c.kv_block_m, block_n=c.kv_block_n, num_warps=c.kv_warps,
        num_stages=c.kv_stages_at(fold), **kw,
    )  # fmt: skip


def programs_sweep(all_cases, names, heads, dtype, per_sm=(1, 2, 3, 4)):
    """Each kernel's long-path launch alone (persistent, over the plan's long tiles) at ``per_sm``
    programs per SM, against one program per tile of the long tiling (programs_per_sm 0: the
    hardware scheduler's occupancy; those past the long tiles exit at once), with the compiled
    kernels' resources: the data behind LongPath.programs_per_sm."""
    from hf_varlen.ops.attention.bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel
    from hf_varlen.ops.attention.fwd import _attn_fwd_kernel
    from hf_varlen.ops.attention.schedule import (
        _sm_count,
        kernel_tiling,
        pick_config,
        pick_long_path,
    )

    out = []
    for h in heads:
        d = HEADS[h][2]
        for case in names:
            s = _triton_setup(all_cases[case], h, dtype)
            dev = s["q"].device
            long, short = pick_long_path(d, dtype, dev), pick_config(d, dtype, dev)
            if long is None:
                print(f"{h}: no long path")
                break
            c, p, sms = long.cfg, s["plan"], _sm_count(dev.index or 0)
            launches = {}
            for kernel, fn in (("fwd", _attn_fwd_kernel), ("dq", _attn_bwd_dq_kernel),
                               ("kv", _attn_bwd_dkdv_kernel)):  # fmt: skip
                fold, tile = kernel_tiling(c, kernel, s["group"])
                side = "k" if kernel == "kv" else "q"
                tile_s = kernel_tiling(short, kernel, s["group"])[1]
                _, order_l, n_long = p.split(side, tile_s, tile, long.min_span)

                def launch(bound, kernel=kernel, fold=fold, order=order_l, s=s, c=c):
                    return _long_launch(s, c, kernel, fold, order, bound)

                launches[kernel] = (fn, launch, n_long, order_l)
            # delta = rowsum(dO * O) for the dK/dV runs, (H_q, T) fp32
            s["delta"].copy_((s["o"].float() * s["do"].float()).sum(-1).t())
            for kernel, (fn, launch, n_long, order_l) in launches.items():
                row = dict(heads=h, case=case, kernel=kernel, n_long=int(n_long.item()),
                           tiles=order_l.numel() - 1)  # fmt: skip
                for n in per_sm:
                    row[f"persistent x{n} ms"] = bench_ms(launch((n_long, sms * n)))
                # the same long tiles, one program each (programs_per_sm 0)
                row["one program per tile ms"] = bench_ms(launch((n_long, 0)))
                try:
                    row["compiled"] = _resident_per_sm(fn, dev)
                except (AttributeError, IndexError, TypeError) as exc:  # triton internals moved
                    row["compiled"] = f"n/a: {type(exc).__name__}: {exc}"
                out.append(row)
                print(json.dumps(row), flush=True)
            del s
            torch.cuda.empty_cache()
    return out
