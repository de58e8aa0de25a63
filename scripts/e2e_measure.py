"""bench_e2e's measurements of one trained cell besides its step times: how busy the GPU is in
one more step (``gpu_busy``), the profiled step of ``--profile`` (``profile_step``: device time
by category, top kernels and host ops, plus e2e_host_profile's and e2e_host_sampler's views), why
compiled cells recompiled, and the trainer's per-step records."""

from __future__ import annotations

import re

PEAK_TFLOPS_H200 = 790.0  # dense bf16 matmul peak as measured on our H200


def default_peak_tflops(cuda: bool) -> float | None:
    """MFU's denominator: the matmul peak measured on our H200 there; on another GPU its dense
    bf16 spec peak (hf-varlen train's table), so an H100's MFU is not divided by the H200's."""
    if not cuda:
        return None
    import torch

    from hf_varlen.training.metrics import peak_flops

    if "H200" in torch.cuda.get_device_name():
        return PEAK_TFLOPS_H200
    flops = peak_flops(torch.device("cuda"), None)
    return flops / 1e12 if flops else None


def gpu_busy(trainer) -> dict:
    """How busy the GPU is during one more training step (after the timed ones, so compiled and
    graph-captured modes are warm), and the attention kernels that step ran (bench_common's
    ``busy_share``, which the peers use alike)."""
    from bench_common import busy_share

    slot = list(trainer.sampler)[0]
    return busy_share(lambda: trainer.train_step([slot]))


def recompile_reasons() -> list[str]:
    """Why each recompile happened (the guard that failed), so a cell's count is explained."""
    from torch._dynamo.utils import guard_failures

    return [
        f"{code.co_name}: {reason}"[:300]
        for code, reasons in guard_failures.items()
        for reason in reasons
    ][:8]


def trainer_records(run_dir: str) -> list[dict]:
    from hf_varlen.training.metrics import read_log

    return [r for r in read_log(run_dir) if "loss" in r]


# Kernel / op name -> category for the step profile (first match wins).
CATEGORIES = (
    ("cross-entropy", r"_ce_rows|cross_entropy|log_softmax|nll_loss"),
    ("rope/glu/rmsnorm (fused)", r"rope|rotary|glu|rms_?norm"),
    ("attention", r"attn|attention|flash|fmha|varlen|sdpa"),
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("matmul", r"gemm|matmul|\bmm\b|aten::mm|aten::addmm|aten::bmm|cutlass|xmma|nvjet|sm90_"),
    ("copies/casts", r"copy|cast|to_copy|cat|fill|memset|memcpy|zero"),
)


def profile_step(trainer, run: dict) -> dict:
    """Time one training step under torch.profiler after ``warmup`` unprofiled ones."""
    import torch
    from bench_common import is_device_kernel
    from e2e_host_profile import PYTHON_STEPS, python_profile, sync_points
    from e2e_host_sampler import sampled_profile
    from torch.profiler import ProfilerActivity, profile

    slots = list(trainer.sampler)
    # The profiled batch runs once unprofiled first: a captured step captures each batch shape the
    # first time it sees it (warm-up passes + capture) and a compiled one may recompile, and
    # neither belongs in the step's profile.
    profiled = slots[run["warmup"]]
    for group in ([s] for s in [*slots[: run["warmup"]], profiled]):
        trainer.train_step(group)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        counts = trainer.train_step([profiled])
    on_gpu = torch.cuda.is_available()
    by_cat: dict[str, float] = {}
    kernels = []
    # Host side: self CPU time per op (with the profiler's own overhead, so compare modes with each
    # other, not with the unprofiled step).
    host = sorted(
        ((e.self_cpu_time_total, e.count, e.key) for e in prof.key_averages()),
        reverse=True,
    )
    for evt in prof.key_averages():
        if on_gpu:
            if not is_device_kernel(evt):
                continue
            us = getattr(evt, "self_device_time_total", None) or evt.self_cuda_time_total
        else:
            us = evt.self_cpu_time_total
        if us <= 0:
            continue
        name = evt.key
        cat = next(
            (c for c, pat in CATEGORIES if re.search(pat, name, re.IGNORECASE)), "other elementwise"
        )
        by_cat[cat] = by_cat.get(cat, 0.0) + us
        kernels.append((us, cat, name))
    kernels.sort(reverse=True)
    return {
        "status": "ok",
        "step_ms": 1e3 * counts["step_time"],
        "real_tokens": counts["real_tokens"],
        "clock": "GPU kernel time" if on_gpu else "CPU op time",
        "by_category_ms": {c: us / 1e3 for c, us in sorted(by_cat.items(), key=lambda x: -x[1])},
        "top": [(us / 1e3, cat, name[:100]) for us, cat, name in kernels[:25]],
        "host_ms": sum(us for us, _, _ in host) / 1e3,
        "host_top": [(us / 1e3, n, name[:100]) for us, n, name in host[:25]],
        **python_profile(trainer, slots, run["warmup"] + 1),
        **sync_points(trainer, slots[(run["warmup"] + 1 + PYTHON_STEPS) % len(slots)]),
        **sampled_profile(trainer, slots, run["warmup"] + 2 + PYTHON_STEPS),
        "recompile_reasons": recompile_reasons(),
    }
