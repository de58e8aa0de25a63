"""hf_varlen inside ``transformers.Trainer`` and TRL's trainers.

    captured.py    CapturedStepMixin, VarlenTrainer: the CUDA-graph step (training_step override)
    sft.py         VarlenSFTTrainer: TRL's SFTTrainer with the fused cross-entropy (needs trl)
    preference.py  VarlenDPOTrainer, VarlenGRPOTrainer: packed log-prob passes (needs trl)
    callbacks.py   OffsetsCheckCallback: reads the deferred offsets checks in time

Names are resolved on first use, so importing this package does not import trl.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CaptureError": "captured",
    "CapturedStepMixin": "captured",
    "VarlenTrainer": "captured",
    "pad_to_bucket": "captured",
    "VarlenSFTTrainer": "sft",
    "PackedLogProbs": "preference",
    "VarlenDPOTrainer": "preference",
    "VarlenGRPOTrainer": "preference",
    "OffsetsCheckCallback": "callbacks",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
