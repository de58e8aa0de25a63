"""The ``auto`` rule: captured step (static shapes + CUDA graphs) or eager step, in one place.

Every ``auto`` in hf_varlen that chooses between the captured and the eager training step asks
``choose_step_mode`` (``hf-varlen train --cuda-graphs auto``, ``VarlenTrainer`` /
``VarlenSFTTrainer(cuda_graphs="auto")``), so the rule and its numbers live here only.

Measurements it comes from (H100 80GB, Llama 1B shape, alpaca, max_length 1024, one process,
bf16, fused kernels; eager / captured / compiled + captured tokens per second, same call):

    batch   8:  9.2K / 17.4K / 22.9K   (capture ahead: the eager step waits on the host)
    batch  32: 38.7K / 40.8K / 49.3K   (capture still ahead, by 5%)
    batch 128:  capture behind: bucket padding costs more device time than the host time saved

Alpaca's documents average ~300 tokens, so the crossover sits around 8-10K real tokens per
micro-batch: below ``CROSSOVER_REAL_TOKENS`` the captured step wins, above it eager + fused kernels
does. The same rule holds where measured beyond that setup (H100, captured / eager):

    LoRA r=16, batch 4 / 8 / 16 / 32:    12.0K / 2.3K, 20.2K / 6.5K, 26.1K / 8.3K, 33.5K / 27.1K
    QLoRA, Qwen3-8B shape, batch 8:       5.4K / 1.6K
    Qwen3-8B shape (8 layers), batch 8:  11.8K / 8.9K
    TRL's defaults (fp32 weights, bf16 autocast; VarlenSFTTrainer), steady state, batch 8 / 32:
                                          8.5K / 4.9K, 21.4K / 18.3K

LoRA's crossover is likely higher (a third of the device work per token), so the shared threshold is
conservative there. Under TRL, each new batch shape costs one capture (1-3 s) inside the run: a
30-step run that still captured 3-5 shapes in its timed steps ran 0.85-0.86x the eager step over
all of them; a run of a few hundred steps sees the steady state.

Memory: the captures of 8 batch shapes reserved 21.9 GiB at batch 32 on the 1B model (the graphs'
private pool keeps each shape's activations). ``capture_bytes`` scales that measurement by
tokens x hidden size x layers (``BYTES_PER_TOKEN_UNIT``: 21.9 GiB / (8 shapes x ~10K tokens x
2048 x 16 layers) ~ 9 bytes); the caller adds what else is still to be allocated (``hf-varlen
train``: gradients and AdamW moments), and ``choose_step_mode`` wants that much free, times
``MEMORY_MARGIN``, before it captures.

Explicit choices are honoured or refused with the reason, never replaced: ``on`` raises where a
blocker or the memory estimate says no; ``off`` is eager; only ``auto`` falls back, with one line
that says why.
"""

from __future__ import annotations

from dataclasses import dataclass

CROSSOVER_REAL_TOKENS = 10_000  # real tokens per micro-batch (see the module docstring)
BYTES_PER_TOKEN_UNIT = 9.0  # capture pool bytes per (token x hidden unit x layer), measured
EXPECTED_SHAPES = 8  # bucket shapes a run captures (8 at batch 32 on alpaca)
MEMORY_MARGIN = 1.25


def capture_bytes(tokens: int, hidden_size: int, layers: int, shapes: int = EXPECTED_SHAPES) -> int:
    """Estimated CUDA memory the captures of ``shapes`` batch shapes of up to ``tokens`` tokens
    reserve (see the module docstring)."""
    return int(shapes * tokens * hidden_size * layers * BYTES_PER_TOKEN_UNIT)


@dataclass(frozen=True)
class StepMode:
    """What ran and why: ``captured`` True for static shapes + CUDA graphs."""

    captured: bool
    reason: str

    @property
    def text(self) -> str:
        return ("captured" if self.captured else "eager") + f" ({self.reason})"


def choose_step_mode(
    requested: str,
    *,
    device: str,
    real_tokens: float | None,
    processes: int = 1,
    blockers: tuple[str, ...] | list[str] = (),
    free_bytes: int | None = None,
    need_bytes: int | None = None,
    lora: bool = False,
    flag: str = "cuda_graphs",
) -> StepMode:
    """The step mode for ``requested`` in ``("auto", "on", "off")``.

    ``device``: the run's device type; ``real_tokens``: real (unpadded) tokens per micro-batch
    (None: unknown, no crossover test); ``processes``: data-parallel processes; ``blockers``:
    reasons found elsewhere why this run cannot capture (``graph_blockers``, ``model_blockers``,
    the Trainer's); ``free_bytes`` / ``need_bytes``: free CUDA memory and the captures' estimate
    (``capture_bytes``), None when not known; ``flag``: the option's name in messages. Raises
    ValueError for ``on`` when it cannot be honoured."""
    if requested not in ("auto", "on", "off"):
        raise ValueError(f"{flag}: expected 'auto', 'on' or 'off', got {requested!r}")
    if requested == "off":
        return StepMode(False, "off: requested")
    reasons = list(blockers)
    own = []
    if device != "cuda":
        own.append(f"CUDA graphs need a CUDA device (this run uses {device})")
    if processes > 1:
        own.append(f"one process only (this run has {processes}): DDP's all-reduce is eager")
    reasons = [r for r in own if r not in reasons] + reasons
    short = (
        free_bytes is not None
        and need_bytes is not None
        and need_bytes * MEMORY_MARGIN > free_bytes
    )
    if short:
        reasons.append(
            f"capturing needs ~{need_bytes / 2**30:.1f} GiB (x{MEMORY_MARGIN} margin) and "
            f"{free_bytes / 2**30:.1f} GiB is free"
        )
    if requested == "on":
        if reasons:
            raise ValueError(f"{flag} on cannot be honoured: " + "; ".join(reasons))
        return StepMode(True, "on: requested")
    if reasons:
        return StepMode(False, "auto: " + "; ".join(reasons))
    if real_tokens is not None and real_tokens > CROSSOVER_REAL_TOKENS:
        return StepMode(
            False,
            f"auto: {real_tokens:,.0f} real tokens per micro-batch is above the "
            f"{CROSSOVER_REAL_TOKENS:,} crossover, where bucket padding costs more than the host "
            "time capture saves; eager with fused kernels",
        )
    size = "" if real_tokens is None else f"{real_tokens:,.0f} real tokens per micro-batch, "
    lora_note = (
        " (LoRA: same threshold; captured measured ahead of eager at batch 4-32)" if lora else ""
    )
    return StepMode(
        True,
        f"auto: {size}below the {CROSSOVER_REAL_TOKENS:,} crossover, where the eager step waits "
        f"on the host{lora_note}",
    )
