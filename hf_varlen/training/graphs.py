"""``hf-varlen train --cuda-graphs``: whether this run captures its training step.

The captured step itself (``GraphedStep``, ``model_blockers``) is ``hf_varlen.captured_step``,
shared with the HF Trainer / TRL subclasses; both names are re-exported here. This module holds
what reads the CLI's ``TrainConfig``.

Requirements (``graph_blockers``; ``--cuda-graphs on`` raises with them, ``auto`` turns graphs
off and says why): CUDA, ``--static-shapes``, one process, AdamW, not ``--padded``, not
``--compile-mode reduce-overhead`` (which captures with Inductor's own graph trees); with
gradient checkpointing, a forward that draws no random numbers (``model_blockers``).
"""

from __future__ import annotations

import torch

from ..captured_step import GraphedStep, choose_step_mode, model_blockers
from .config import TrainConfig

__all__ = ["GraphedStep", "graph_blockers", "model_blockers", "resolve_graphs"]


def graph_blockers(
    cfg: TrainConfig, device: torch.device, processes: int, precision: str
) -> list[str]:
    """Why this run cannot capture its step in CUDA graphs (empty: it can); ``precision`` is the
    run's resolved one."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"CUDA graphs need a CUDA device (this run uses {device.type})")
    if cfg.static_shapes is False:  # None: auto, turned on with the captured step
        reasons.append("the batches must have static shapes: add --static-shapes")
    if cfg.padded:
        reasons.append("--padded batches are not bucketed; graphs capture packed batches")
    if cfg.pad_to_multiple_of is not None:
        reasons.append("--pad-to-multiple-of pads to a multiple, not to the static buckets")
    if processes > 1:
        reasons.append(f"one process only (this run has {processes}): DDP's all-reduce is eager")
    if cfg.optim != "adamw":
        reasons.append(f"--optim {cfg.optim}: the captured update is fused AdamW")
    if cfg.gradient_checkpointing and cfg.lora and cfg.lora_dropout > 0:
        reasons.append(
            f"--lora-dropout {cfg.lora_dropout} with --gradient-checkpointing: the recompute must "
            "redraw the same masks, which restores the RNG state on the host (use --lora-dropout 0)"
        )
    if cfg.compile and cfg.compile_mode == "reduce-overhead":
        reasons.append("--compile-mode reduce-overhead captures with Inductor's own CUDA graphs")
    return reasons


def resolve_graphs(
    cfg: TrainConfig,
    device: torch.device,
    processes: int,
    precision: str,
    *,
    real_tokens: float | None = None,
    free_bytes: int | None = None,
    need_bytes: int | None = None,
) -> tuple[bool, str]:
    """(on, why) for ``--cuda-graphs`` by the one ``auto`` rule (``captured_step/auto_mode.py``):
    ``on`` raises when it cannot be honoured; ``real_tokens`` (real tokens per micro-batch),
    ``free_bytes`` and ``need_bytes`` (CUDA memory) are given once known."""
    mode = choose_step_mode(
        cfg.cuda_graphs,
        # graph_blockers judges this run's device and processes (one list of reasons, in order)
        device="cuda",
        real_tokens=real_tokens,
        processes=1,
        blockers=graph_blockers(cfg, device, processes, precision),
        free_bytes=free_bytes,
        need_bytes=need_bytes,
        lora=cfg.lora,
        flag="--cuda-graphs",
    )
    return mode.captured, mode.text
