"""Registers, spills and shared memory of the Triton attention kernels, compiled for a GPU that
need not be here (triton's own ptxas, no driver): what a config costs a kernel before any GPU time.

    python scripts/gpu_evidence/kernel_resources.py [--arch 90] [--heads 32/8/128,16/16/64]
        [--kernels fwd,dq,kv] [--out FILE.md] [--json FILE.json]

For each head config, each path (the shipped short config and the long path) and each kernel
(forward, dQ, dK/dV), the launch the product makes (attention_schedule.launch_passes' fold, blocks,
warps, stages; the long launch persistent or bounded as shipped) is compiled twice: pointer loads,
and with ``KernelConfig.tma`` (tensor descriptors, attention_tma.py). The host launchers run on
small CPU tensors with a launcher that records the kernel's arguments instead of launching; the
arguments are specialised as triton's runtime does (divisibility 16, ints equal to 1 as constants),
then ``triton.compile`` targets ``cuda:<arch>``. Columns: registers per thread, the spill frame
(stack bytes per thread) and spill instructions (local stores + loads in the SASS), shared memory,
TMA copies, TMA (bulk) reductions and per-element global atomics in the PTX. ``--kernels`` may
also name ``kv_fused``: the dK/dV kernel of the fused backward, which adds dQ into an fp32 buffer
(per element with pointers, one bulk reduction per block with descriptors).

Triton's code generation changes between versions: to match the GPU machine put its triton first,
``pip install --target DIR --no-deps triton==3.6.0`` then ``PYTHONPATH=DIR python ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench_common's run header
os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret (read when kernels are defined)

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_varlen.ops.attention import bwd as attention_bwd  # noqa: E402
from hf_varlen.ops.attention import fwd as attention_fwd  # noqa: E402
from hf_varlen.ops.attention import schedule as attention_schedule  # noqa: E402
from hf_varlen.ops.attention import tma as attention_tma  # noqa: E402

TOKENS = 2048  # the host launchers' tensors (no kernel runs: only the argument types matter)
KERNELS = ("fwd", "dq", "kv")
KNOWN_KERNELS = (*KERNELS, "kv_fused")  # the fused backward's dK/dV kernel, on request


class _Record:
    """Stands in for a launcher: ``kernel[grid](*args, **kwargs)`` records instead of running."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


def record_launch(
    kernel: str, cfg, fold: int, heads: tuple[int, int, int], long, fused: bool = False
) -> tuple:
    """(kernel function, positional args, keyword args) of one launch of ``kernel`` under cfg;
    ``fused``: the dK/dV kernel of the fused backward (dQ added into an fp32 buffer)."""
    h_q, h_kv, dim = heads
    calls: list = []
    record = lambda k, traceable: _Record(k, calls)  # noqa: E731
    saved = attention_fwd.launcher, attention_bwd.launcher, attention_tma.tma_device
    attention_fwd.launcher = attention_bwd.launcher = record
    attention_tma.tma_device = lambda device: True  # this script compiles for sm_90+
    try:
        bf = dict(dtype=torch.bfloat16)
        q, o, do, dq = (torch.zeros(TOKENS, h_q, dim, **bf) for _ in range(4))
        k, v, dk, dv = (torch.zeros(TOKENS, h_kv, dim, **bf) for _ in range(4))
        lse = delta = torch.zeros(h_q, TOKENS)
        lo = hi = torch.zeros(TOKENS, dtype=torch.int32)
        order = torch.zeros(TOKENS + 1, dtype=torch.int32)
        bound = None
        if long is not None:
            programs = 132 * long.programs(kernel)  # an H200's SMs; only > 0 matters here
            bound = (torch.ones(1, dtype=torch.int32), programs)
        kw = dict(softmax_scale=dim**-0.5, softcap=0.0, fold=fold, bound=bound, tma=cfg.tma)
        if kernel == "fwd":
            attention_fwd.attention_forward(
                q, k, v, lo, hi, order, block_m=cfg.fwd_block_m, block_n=cfg.fwd_block_n,
                num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages, **kw,
            )  # fmt: skip
        elif kernel == "dq":
            attention_bwd.backward_dq(
                do, q, k, v, o, lse, delta, dq, lo, hi, order, block_m=cfg.dq_block_m,
                block_n=cfg.dq_block_n, num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, **kw,
            )  # fmt: skip
        else:
            attention_bwd.backward_dkdv(
                do, q, k, v, lse, delta, dk, dv, lo, hi, order, block_m=cfg.kv_block_m,
                block_n=cfg.kv_block_n, num_warps=cfg.kv_warps,
                num_stages=cfg.kv_stages_at(fold),
                dq_acc=torch.zeros(TOKENS, h_q, dim) if fused else None, **kw,
            )  # fmt: skip
    finally:
        attention_fwd.launcher, attention_bwd.launcher, attention_tma.tma_device = saved
    (call,) = calls
    return call


def compile_launch(fn, args, kwargs, arch: int):
    """``triton.compile`` of one recorded launch for cuda:<arch>, specialised as the runtime does."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name, value = param.name, values[param.name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        specialize = not param.do_not_specialize
        ty, key = native_specialize_impl(CUDABackend, value, False, specialize, specialize)
        if ty == "constexpr":  # an int equal to 1
            signature[name], constexprs[name] = "constexpr", key
            continue
        signature[name] = ty
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 64), options=options)


def resources(compiled) -> dict:
    """Registers, spill frame and instructions, shared bytes, TMA copies / reductions and global
    atomics of a compiled kernel."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        dump = lambda flag: (
            subprocess.run(  # noqa: E731
                [str(tool), flag, str(cubin)], capture_output=True, text=True, check=True
            ).stdout
        )
        usage, sass = dump("-res-usage"), dump("-sass")
    field = lambda key: int(re.search(rf"\b{key}:(\d+)", usage).group(1))  # noqa: E731
    return {
        "registers": field("REG"),
        "stack_bytes": field("STACK"),  # the spill frame
        "spill_insts": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
        "shared_bytes": compiled.metadata.shared,
        "tma_copies": compiled.asm["ptx"].count("cp.async.bulk.tensor"),
        "tma_reductions": compiled.asm["ptx"].count("cp.reduce.async.bulk.tensor"),
        "atomics": len(re.findall(r"\b(?:red|atom)\.global", compiled.asm["ptx"])),
    }


def launches(heads: tuple[int, int, int], kernels=KERNELS):
    """(path, kernel, config, fold, long path or None) of every launch the product makes
    (kernel "kv_fused": the dK/dV kernel of the fused backward)."""
    h_q, h_kv, dim = heads
    group = h_q // h_kv
    key = attention_schedule._key(dim)
    short = attention_schedule._CUDA_CONFIGS[key]
    long = attention_schedule._CUDA_LONG.get(key)
    for kernel in kernels:
        base = "kv" if kernel == "kv_fused" else kernel
        fold, _ = attention_schedule.kernel_tiling(short, base, group)
        yield "short", kernel, short, fold, None
        if long is not None:
            fold, _ = attention_schedule.kernel_tiling(long.cfg, base, group)
            yield "long", kernel, long.cfg, fold, long


def describe(kernel: str, cfg, group: int) -> str:
    fold, _tile, block_a, block_b, warps, stages, _tma = attention_schedule.kernel_launch(
        cfg, kernel, group
    )
    return f"({block_a}, {block_b}, {warps}, {stages}) f{fold}"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    p.add_argument("--heads", default="32/8/128,16/16/64", help="H_q/H_kv/D, comma-separated")
    p.add_argument(
        "--kernels", default=",".join(KERNELS), help=f"comma-separated, of {KNOWN_KERNELS}"
    )
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    kernels = args.kernels.split(",")
    if unknown := [k for k in kernels if k not in KNOWN_KERNELS]:
        p.error(f"--kernels: unknown {unknown}; known: {list(KNOWN_KERNELS)}")
    rows = []
    for spec in args.heads.split(","):
        try:
            heads = tuple(int(x) for x in spec.split("/"))
            h_q, h_kv, _dim = heads
            if h_q % h_kv:
                raise ValueError
        except ValueError:
            p.error(f"--heads: {spec!r} is not H_q/H_kv/D with H_q a multiple of H_kv")
        for path, kernel, cfg, fold, long in launches(heads, kernels):
            base = "kv" if kernel == "kv_fused" else kernel
            launch = describe(base, cfg, heads[0] // heads[1])
            row = {"heads": spec, "path": path, "kernel": kernel, "launch": launch}
            for tma in (False, True):
                c = dataclasses.replace(cfg, tma=tma)
                fn, a, kw = record_launch(base, c, fold, heads, long, fused=kernel == "kv_fused")
                compiled = compile_launch(fn, a, dict(kw), args.arch)
                row["tma" if tma else "pointers"] = resources(compiled)
            rows.append(row)
            print(row, flush=True)
    text = table(rows, args.arch)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def table(rows: list[dict], arch: int) -> str:
    from bench_common import run_header

    info = run_header()
    head = (
        f"Header: `target: cuda sm_{arch} (compiled offline, no GPU) | triton: {triton.__version__} "
        f"| torch: {torch.__version__} | commit: {info['commit']} | {info['date']}`"
    )
    lines = [
        head,
        "",
        "| heads | path | kernel | launch (blocks, warps, stages) fold | registers ptr / tma | "
        "spill frame bytes ptr / tma | spill insts ptr / tma | shared KiB ptr / tma | TMA copies |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["pointers"], r["tma"]
        lines.append(
            f"| {r['heads']} | {r['path']} | {r['kernel']} | {r['launch']} | "
            f"{a['registers']} / {b['registers']} | {a['stack_bytes']} / {b['stack_bytes']} | "
            f"{a['spill_insts']} / {b['spill_insts']} | "
            f"{a['shared_bytes'] / 1024:.0f} / {b['shared_bytes'] / 1024:.0f} | {b['tma_copies']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
