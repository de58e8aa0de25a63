"""The captured training step: static shapes + CUDA graphs, and the one rule that picks it.

    graphs.py     GraphedStep: a micro-batch's forward + backward (and the fused AdamW update)
                  captured per batch shape and replayed; model_blockers: what in a built model
                  stands in the way
    auto_mode.py  choose_step_mode: captured or eager for "auto" / "on" / "off"; capture_bytes:
                  the memory estimate it weighs

Two drivers use it: ``hf-varlen train --cuda-graphs`` (``hf_varlen.training``) and the HF Trainer /
TRL subclasses (``hf_varlen.integrations.trainers``). It imports neither, only torch and
``hf_varlen.coverage`` (the offsets check each replayed batch still gets).
"""

from __future__ import annotations

from .auto_mode import StepMode, capture_bytes, choose_step_mode
from .graphs import GraphedStep, model_blockers

__all__ = ["GraphedStep", "StepMode", "capture_bytes", "choose_step_mode", "model_blockers"]
