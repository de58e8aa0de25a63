"""Checkpoints: save and exactly resume a run; export the final model.

A checkpoint ``<output_dir>/checkpoint-<step>/`` is ``accelerator.save_state``'s folder (model
weights as ``model.safetensors``, optimizer, RNG states of every process, the LR scheduler and
``RunState`` as registered objects) plus a human-readable ``trainer_state.json``. ``RunState`` holds
the data position (epoch, micro-batches consumed in it): the sampler's order is a pure function of
``(seed, epoch)``, so skipping that many index lists puts every rank exactly where it stopped, and
the restored weights, optimizer moments, scheduler and RNG make the continuation bit-identical.

Resuming needs the options that shape the data order to match; ``RunState.fingerprint`` records
them and a mismatch is an error rather than a silently different run.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger("hf_varlen.training")

_CKPT = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class RunState:
    """Where the run is; saved with every checkpoint (``state_dict`` / ``load_state_dict``)."""

    step: int = 0
    epoch: int = 0
    micro: int = 0  # micro-batches of ``epoch`` already consumed (per rank; equal on all ranks)
    tokens: int = 0  # real tokens trained on, all ranks
    elapsed: float = 0.0  # training wall-clock seconds before this process started
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fingerprint", {})
        diff = {k: (saved.get(k), v) for k, v in self.fingerprint.items() if saved.get(k) != v}
        if saved and diff:
            raise ValueError(
                "--resume: the checkpoint was written with different data-order options "
                + ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
                + "; resume with the same options (or start a new run)"
            )
        for key, value in state.items():
            if key != "fingerprint":
                setattr(self, key, value)


def find_latest(output_dir: str) -> str | None:
    """The newest ``checkpoint-<step>`` folder under ``output_dir`` (None when there is none)."""
    if not os.path.isdir(output_dir):
        return None
    steps = [
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := _CKPT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    return os.path.join(output_dir, max(steps)[1]) if steps else None


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    if resume is None:
        return None
    if resume == "latest":
        path = find_latest(output_dir)
        if path is None:
            logger.warning("--resume latest: no checkpoint under %s; starting fresh", output_dir)
        return path
    if not os.path.exists(os.path.join(resume, "trainer_state.json")):
        raise ValueError(
            f"--resume {resume!r}: not a hf-varlen checkpoint (no trainer_state.json); pass a "
            "checkpoint-<step> folder or 'latest'"
        )
    return resume


def save_checkpoint(accelerator, output_dir: str, state: RunState) -> str:
    """Collective: every process must call it."""
    path = os.path.join(output_dir, f"checkpoint-{state.step}")
    accelerator.save_state(path, safe_serialization=True)
    if accelerator.is_main_process:
        with open(os.path.join(path, "trainer_state.json"), "w", encoding="utf-8") as fh:
            json.dump(state.state_dict(), fh, indent=2)
    accelerator.wait_for_everyone()
    return path


def export_model(accelerator, model, tokenizer, path: str) -> None:
    """Final weights (safetensors) + config + tokenizer, loadable with ``from_pretrained``.

    Collective (FSDP gathers the full state dict); only the main process writes. A peft model
    saves its adapter.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(path)
    accelerator.wait_for_everyone()
