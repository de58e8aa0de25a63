"""The parts of the end-of-run summary that need more than the step records.

``data_text``: one line saying what was trained on. ``static_shapes_summary``: with
``--static-shapes``, the bucket shapes that ran (over all ranks) and the padding they cost.
``ranks_summary``: with several processes, each rank's real tokens and peak memory and the per-step
rank imbalance. ``padded_alternative``: what a padded trainer would compute on the same examples.
``intro_text``: the run's first line. ``write_summary``: all of it with the whole-run numbers of the step records
(``metrics.summarize``), written to summary.json and printed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .config import TrainConfig
from .metrics import environment, finite_or_none, format_summary, plot_runs, summarize
from .model import attn_implementation


def data_text(cfg: TrainConfig, data_format: str, n_train: int, n_eval: int) -> str:
    source = (
        "built-in synthetic instructions"
        if cfg.dataset == "builtin"
        else f"{cfg.dataset} ({data_format})"
    )
    per_batch = (
        f"{cfg.batch_size} examples" if cfg.batch_size is not None else f"{cfg.token_budget} tokens"
    )
    return (
        f"{source}, {n_train} train / {n_eval} eval examples, max_length {cfg.max_length}, "
        f"{per_batch} per micro-batch x {cfg.grad_accum}"
    )


def static_shapes_summary(
    bucket_counts: dict[int, int],
    reduce: Callable[[list[float]], list[float]],
    records: list[dict[str, Any]],
    max_documents: int,
) -> dict[str, Any] | None:
    """--static-shapes numbers (None without): ``bucket_counts`` this rank's micro-batches per
    bucket, ``reduce`` the sum over processes (a collective: every rank calls it)."""
    if not bucket_counts:
        return None
    buckets = list(bucket_counts)
    counts = [int(c) for c in reduce([float(bucket_counts[b]) for b in buckets])]
    used = [b for b, c in zip(buckets, counts, strict=True) if c]
    held = sum(r["tensor_tokens"] for r in records)
    extra = held - sum(r["real_tokens"] for r in records)
    share = extra / held if held else 0.0
    m = max_documents
    return {
        "buckets": buckets,
        "max_documents": m,
        "shapes": used,
        "micro_batches_per_shape": [c for c in counts if c],
        "distinct_shapes": len(used),
        "extra_tokens": extra,
        "extra_share": share,
        "text": (
            f"{len(used)} distinct shape(s) of {len(buckets)} buckets ([1, T] with T in "
            f"{used}; cu_seq_lens of {m + 2}), padding {share:.1%} of the tokens computed "
            f"({extra:,} extra tokens)"
        ),
    }


def ranks_summary(
    acc, device: torch.device, rank_real_tokens: int, records: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Several processes (None for one): each rank's real tokens (``rank_real_tokens``: this
    process's steps) and peak memory, gathered from every rank (a collective: all ranks call it),
    and the per-step imbalance (max / mean real tokens over ranks, ``rank_imbalance`` of the
    records)."""
    if acc.num_processes == 1:
        return None
    peak = max((r["peak_mem_gib"] for r in records), default=0.0)
    # fp64: token counts stay exact far past fp32's 2^24
    mine = torch.tensor([[float(rank_real_tokens), peak]], dtype=torch.float64, device=device)
    tokens, peaks = zip(*acc.gather(mine).tolist(), strict=True)
    tokens = [int(t) for t in tokens]
    imbalance = [r["rank_imbalance"] for r in records if "rank_imbalance" in r]
    mean = sum(imbalance) / len(imbalance) if imbalance else 1.0
    worst = max(imbalance, default=1.0)
    return {
        "real_tokens": tokens,
        "peak_mem_gib": list(peaks),
        "imbalance_mean": mean,
        "imbalance_worst": worst,
        "text": (
            f"{len(tokens)} processes: real tokens per rank {tokens}, imbalance (max / mean real "
            f"tokens of a step over ranks) mean {mean:.3f}, worst {worst:.3f}; peak memory per "
            f"rank {', '.join(f'{p:.2f}' for p in peaks)} GiB"
        ),
    }


def padded_alternative(lengths: np.ndarray, micro_batches: int, seed: int) -> dict[str, Any]:
    """The padding this run avoids, against what a padded trainer does with the same examples.

    A token-budget run's micro-batches are best-fit packs (similar lengths together), so padding
    *them* to their longest example costs little and says nothing about the alternative. A padded
    trainer instead draws batches of B examples in shuffled order and pads each to its longest;
    this is that, with B the run's mean examples per micro-batch (``len(lengths)`` over
    ``micro_batches``, all ranks) and the run's seed for the shuffle.

    lengths: [N] tokens of each training example (after truncation).
    Returns ``examples_per_batch`` (B), ``efficiency`` (real / padded tokens) and ``text``.
    """
    n = len(lengths)
    per_batch = max(1, round(n / max(micro_batches, 1)))
    order = np.random.default_rng(seed).permutation(n)
    real = padded = 0
    for start in range(0, n, per_batch):
        chunk = lengths[order[start : start + per_batch]]
        real += int(chunk.sum())
        padded += len(chunk) * int(chunk.max())
    eff = real / padded if padded else 0.0
    return {
        "examples_per_batch": per_batch,
        "efficiency": eff,
        "text": f"shuffled batches of {per_batch} examples padded to their longest would be "
        f"{eff:.1%} real tokens: packing avoids computing {1 - eff:.1%} padding",
    }


def write_summary(trainer, records: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict:
    """The end-of-run summary of ``trainer`` (a ``PackedTrainer``) from its step ``records`` and
    ``evals``: written to OUTPUT_DIR/summary.json and printed on the main process (with --plot's
    PNGs), returned on every rank."""
    cfg = trainer.cfg
    n_eval = len(trainer.eval_ex) if trainer.eval_ex else 0
    data = data_text(cfg, trainer.format, len(trainer.train_ex), n_eval)
    summary = summarize(
        records,
        evals,
        model=cfg.model,
        params=trainer.params,
        trainable=trainer.trainable,
        mode="padded baseline" if cfg.padded else "packed",
        attention=attn_implementation(cfg)
        + ("" if cfg.padded else f" (backend {cfg.attn_backend})"),
        precision=trainer.precision,
        kernels=trainer.kernels,
        loss_impl=trainer.loss_impl,
        data=data,
        processes=trainer.acc.num_processes,
        distribution=trainer.distribution,
        device=str(trainer.device),
        output_dir=cfg.output_dir,
        resumed_from=trainer.resumed_from,
        skipped_steps=trainer.state.skipped,
        skipped_records=trainer.skipped_records,
        env=environment(trainer.device),
        compile=trainer.compiler.summary(records),
        cuda_graphs=trainer.graphs_summary(),
        static_shapes=static_shapes_summary(
            trainer.bucket_counts,
            trainer.sum_over_processes,
            records,
            trainer.sampler.max_documents,
        ),
        ranks=ranks_summary(trainer.acc, trainer.device, trainer.rank_real_tokens, records),
        profile=trainer.profiler.result,
        vs_padded=packing_gain(trainer),
    )
    if trainer.acc.is_main_process:
        import json

        with open(os.path.join(cfg.output_dir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(finite_or_none(summary), fh, indent=2, allow_nan=False)
        if cfg.plot:
            plot_runs([cfg.output_dir], cfg.output_dir)
        print(format_summary(summary), flush=True)
    return summary


def packing_gain(trainer) -> dict[str, Any] | None:
    """Token-budget packed runs of ``trainer``: the padding a padded trainer would compute on the
    same data (``padded_alternative``); --batch-size and --padded runs say it already."""
    cfg, train = trainer.cfg, trainer.train_ex
    if cfg.padded or cfg.batch_size is not None or not len(train):
        return None
    batches = len(trainer.sampler) * trainer.acc.num_processes
    return padded_alternative(train.lengths, batches, cfg.seed)


def intro_text(trainer) -> str:
    """The line a run starts with: the data, its micro-batches and packing, the steps, the kernels
    and the loss."""
    cfg, stats, vs_padded = trainer.cfg, trainer.sampler.stats, packing_gain(trainer)
    return (
        f"{len(trainer.train_ex)} train examples in {len(trainer.sampler)} micro-batches per rank "
        f"and epoch ({stats.real_tokens / max(stats.padded_tokens, 1):.1%} real tokens if "
        f"padded to the longest example of each"
        + (f"; {vs_padded['text']}" if vs_padded else "")
        + f"); {trainer.total_steps} steps of "
        f"{cfg.grad_accum} x {trainer.acc.num_processes} micro-batches; kernels: "
        f"{trainer.kernels}; loss: {trainer.loss_impl}"
    )


def graphs_summary(cfg: TrainConfig, graphed, note: str) -> dict[str, Any] | None:
    """--cuda-graphs in the summary: what ``graphed`` (a ``GraphedStep``, or None when the step
    ran eager) captured, or why auto left graphs off (``note``)."""
    if cfg.cuda_graphs == "off":  # asked for by name: nothing to explain
        return None
    if graphed is None:
        return {"on": False, "text": note}
    info = graphed.summary()
    return {"on": True, **info, "text": f"{note}: {info['text']}"}
