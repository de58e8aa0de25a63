"""Checkpoints: save atomically, validate, exactly resume a run; export the final model.

A checkpoint ``<output_dir>/checkpoint-<step>/`` is ``accelerator.save_state``'s folder (model
weights as ``model.safetensors``, optimizer, RNG states of every process, the LR scheduler and
``RunState`` as registered objects) plus ``trainer_state.json`` (the run state and a manifest: the
size of every file). ``RunState`` holds the data position (epoch, micro-batches consumed in it):
the sampler's order is a pure function of ``(seed, epoch)``, so skipping that many index lists puts
every rank exactly where it stopped, and the restored weights, optimizer moments, scheduler and RNG
make the continuation bit-identical.

Atomic saves. Everything is written into ``.tmp-checkpoint-<step>/``, fsynced, and renamed to
``checkpoint-<step>`` only when complete, so a kill or a full disk never leaves a folder with the
checkpoint name that is not complete. The final model goes the same way (``.tmp-final`` ->
``final``). A failed save is an error (``CheckpointError``), never a log line.

Resume. ``--resume latest`` takes the newest *complete* checkpoint (incomplete ones are skipped
with a warning naming them); an explicit folder is validated up front and the missing or damaged
file is named. Missing random states are an error unless ``--resume-without-rng``. Options that
shape the data order, the model config (``model_fingerprint``) and the tokenized training data
(``data_fingerprint``) must match (``RunState.fingerprint``, checked before any weight is loaded); a
mismatch is an error naming the difference rather than a silently different run. A checkpoint
older than the model and data fingerprints resumes with one warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
import zipfile
from dataclasses import asdict, dataclass, field
from typing import Any

from .fingerprint import (
    DATA_KEY,
    MODEL_KEY,
    data_fingerprint,
    fingerprint_mismatch,
    model_fingerprint,
)

logger = logging.getLogger("hf_varlen.training")

_CKPT = re.compile(r"^checkpoint-(\d+)$")
TMP_PREFIX = ".tmp-"
STATE_FILE = "trainer_state.json"
_ZIP_CHECK_MAX_BYTES = 64 * 2**20  # CRC-check small torch.save archives; open big ones only


class CheckpointError(RuntimeError):
    """A checkpoint or the final model could not be written, or cannot be resumed from."""


class ResumeMismatchError(CheckpointError, ValueError):
    """The checkpoint is of another model, config, data or data order than this run's options."""


@dataclass
class RunState:
    """Where the run is; saved with every checkpoint (``state_dict`` / ``load_state_dict``)."""

    step: int = 0
    epoch: int = 0
    micro: int = 0  # micro-batches of ``epoch`` already consumed (per rank; equal on all ranks)
    tokens: int = 0  # real tokens trained on, all ranks
    elapsed: float = 0.0  # training wall-clock seconds before this process started
    skipped: int = 0  # optimizer steps skipped as non-finite (--on-nonfinite skip)
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problem = fingerprint_mismatch(state.get("fingerprint", {}), self.fingerprint)
        if problem:
            raise ResumeMismatchError(f"--resume: {problem}")
        for key, value in state.items():
            if key != "fingerprint":
                setattr(self, key, value)


# --------------------------------------------------------------------------------------------- #
# Fingerprints (fingerprint.py): checked before any weight is loaded


def check_fingerprint(path: str, now: dict[str, Any]) -> None:
    """Before any weight is loaded: refuse a checkpoint of another model, config, data or data
    order (``CheckpointError`` naming the difference); warn once for a checkpoint that predates
    the model and data fingerprints."""
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
        saved = json.load(fh).get("fingerprint", {})
    problem = fingerprint_mismatch(saved, now)
    if problem:
        raise ResumeMismatchError(f"--resume {path!r}: {problem}")
    missing = [k for k in (MODEL_KEY, DATA_KEY) if k not in saved]
    if missing:
        logger.warning(
            "--resume %s: the checkpoint predates the %s fingerprint, so nothing checks that it "
            "is of this model and data; resuming anyway",
            path,
            " and ".join(missing),
        )


# --------------------------------------------------------------------------------------------- #
# Validation


@dataclass
class Problems:
    """What is wrong with one checkpoint folder: ``broken`` (missing or damaged files) and
    ``rng`` (missing random-state files, resumable with --resume-without-rng)."""

    broken: list[str] = field(default_factory=list)
    rng: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.broken or self.rng)

    def text(self) -> str:
        return "; ".join(self.broken + [f"{f} is missing" for f in self.rng])


def _damaged(path: str) -> str | None:
    """A cheap structural check of one file (no full read of large files): why it is damaged."""
    name = os.path.basename(path)
    try:
        if name.endswith(".safetensors"):
            with open(path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    return "shorter than a safetensors header"
                (n,) = struct.unpack("<Q", head)
                if n > os.path.getsize(path) - 8:  # garbage: do not try to read n bytes
                    return f"its header length ({n} bytes) runs past the end of the file"
                header = json.loads(fh.read(n))
                if not isinstance(header, dict):
                    return "its header is not a JSON object"
            tensors = [v for k, v in header.items() if k != "__metadata__"]
            end = max((v["data_offsets"][1] for v in tensors), default=0)
            if os.path.getsize(path) < 8 + n + end:
                return "truncated (tensor data ends past the end of the file)"
        elif name.endswith((".bin", ".pkl", ".pt")):  # torch.save archives are zip files
            with zipfile.ZipFile(path) as zf:
                if os.path.getsize(path) <= _ZIP_CHECK_MAX_BYTES and zf.testzip() is not None:
                    return "fails its checksum"
        elif name.endswith(".json"):
            with open(path, encoding="utf-8") as fh:
                json.load(fh)
    except (
        OSError, ValueError, KeyError, TypeError, OverflowError, AttributeError, IndexError,
        zipfile.BadZipFile, struct.error,
    ) as exc:  # fmt: skip
        return f"unreadable ({type(exc).__name__}: {exc})"
    return None


def _manifest(root: str) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` except the state file."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root)
            if rel != STATE_FILE:
                out[rel] = os.path.getsize(full)
    return dict(sorted(out.items()))


def check_checkpoint(path: str, processes: int) -> Problems:
    """Everything wrong with the checkpoint folder ``path`` for a run of ``processes`` ranks."""
    p = Problems()
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isdir(path):
        p.broken.append("not a folder")
        return p
    if not os.path.exists(state_path):
        p.broken.append(
            f"{STATE_FILE} is missing (a save that did not finish, or not a hf-varlen checkpoint)"
        )
        return p
    try:
        with open(state_path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        p.broken.append(f"{STATE_FILE} is damaged ({exc})")
        return p
    files = state.get("files")
    if files is None:  # written before manifests existed: the files accelerate always writes
        files = {f"custom_checkpoint_{i}.pkl": None for i in range(2)}  # scheduler, RunState
        for options in (
            ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp_0"),
            ("optimizer.bin", "optimizer_0"),
        ):
            present = [x for x in options if os.path.exists(os.path.join(path, x))]
            files[present[0] if present else options[0]] = None
    rng = {f"random_states_{i}.pkl" for i in range(processes)}
    for rel, size in files.items():
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            if rel not in rng:
                p.broken.append(f"{rel} is missing")
        elif size is not None and os.path.getsize(full) != size:
            got = os.path.getsize(full)
            p.broken.append(f"{rel} is damaged (size {got} bytes, the save wrote {size})")
        elif why := _damaged(full):
            p.broken.append(f"{rel} is damaged: {why}")
    p.rng = sorted(f for f in rng if not os.path.exists(os.path.join(path, f)))
    return p


def checkpoints(output_dir: str) -> list[str]:
    """``checkpoint-<step>`` folders under ``output_dir``, newest first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := _CKPT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    return [os.path.join(output_dir, name) for _, name in sorted(steps, reverse=True)]


def unfinished_saves(output_dir: str) -> list[str]:
    """Temporary folders of saves that never finished (killed or failed)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(
        os.path.join(output_dir, n) for n in os.listdir(output_dir) if n.startswith(TMP_PREFIX)
    )


# --------------------------------------------------------------------------------------------- #
# Saving


def _fsync_tree(root: str) -> None:
    """Flush every file and folder under ``root`` (and ``root``) to disk."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: str, final: str) -> None:
    """fsync ``tmp`` and rename it to ``final`` (replacing an existing folder of that name)."""
    _fsync_tree(tmp)
    parent = os.path.dirname(os.path.abspath(final))
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(f"{final} exists and is not a folder; remove it or move it away")
    if os.path.isdir(final):  # the same step saved again: swap, then delete the old copy
        old = os.path.join(parent, TMP_PREFIX + "old-" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(parent)


def _on_main(accelerator, what: str, fn) -> None:
    """Run ``fn`` on the main process; every process raises ``CheckpointError`` if it failed
    (so no rank waits forever in a collective when the main process could not write)."""
    error = None
    if accelerator.is_main_process:
        try:
            fn()
        except CheckpointError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"{what} failed: {exc}"
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error is not None:
        raise CheckpointError(error)


def save_checkpoint(accelerator, output_dir: str, state: RunState) -> str:
    """Write ``checkpoint-<step>`` atomically. Collective: every process must call it."""
    name = f"checkpoint-{state.step}"
    final = os.path.join(output_dir, name)
    tmp = os.path.join(output_dir, TMP_PREFIX + name)
    what = f"saving {final}"

    def clear():
        os.makedirs(output_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    _on_main(accelerator, what, clear)
    accelerator.wait_for_everyone()
    try:
        with _quiet_save():
            accelerator.save_state(tmp, safe_serialization=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(
            f"{what} failed: {exc}. Nothing was renamed: the previous checkpoints are intact and "
            f"the partial save stays in {tmp} (ignored by --resume latest)"
        ) from exc
    accelerator.wait_for_everyone()

    def finish():
        record = {**state.state_dict(), "files": _manifest(tmp)}
        with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2)
        _publish(tmp, final)

    _on_main(accelerator, what, finish)
    return final


class _SharedTensorNote(logging.Filter):
    """Drops accelerate's "Removed shared tensor ... check by verifying" warning (a tied LM head is
    the input embedding: saving it once is right, and loading ties it again); the first time, one
    INFO line says so instead."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Removed shared tensor" not in record.getMessage():
            return True
        if not _SharedTensorNote.said:
            _SharedTensorNote.said = True
            logger.info(
                "checkpoints store tied weights once (the LM head is the input embedding); "
                "resuming ties them again, so nothing is lost"
            )
        return False


@contextlib.contextmanager
def _quiet_save():
    """accelerate's save_state logs ~7 INFO lines per checkpoint (one per file) and a warning for
    tied weights; the run prints one line per checkpoint itself, so those stay below WARNING."""
    chatty = [logging.getLogger(n) for n in ("accelerate.accelerator", "accelerate.checkpointing")]
    levels = [lg.level for lg in chatty]
    note, other = _SharedTensorNote(), logging.getLogger("accelerate.utils.other")
    for lg in chatty:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    other.addFilter(note)
    try:
        yield
    finally:
        other.removeFilter(note)
        for lg, level in zip(chatty, levels, strict=True):
            lg.setLevel(level)


def prune_checkpoints(accelerator, output_dir: str, keep: int | None) -> list[str]:
    """--save-total-limit: delete all but the newest ``keep`` ``checkpoint-<step>`` folders of
    ``output_dir`` (on the main process; every process raises if it failed). Only folders named
    ``checkpoint-<step>`` go: ``final/``, unfinished saves and anything else stay. Returns the
    deleted paths (on the main process)."""
    if keep is None:
        return []
    old = checkpoints(output_dir)[keep:]

    def delete():
        for path in old:
            shutil.rmtree(path)

    _on_main(accelerator, f"--save-total-limit {keep}: removing old checkpoints", delete)
    return old if accelerator.is_main_process else []


def export_model(accelerator, model, tokenizer, path: str) -> None:
    """Final weights (safetensors) + config + tokenizer, loadable with ``from_pretrained``.

    Collective (FSDP gathers the full state dict); only the main process writes, into a temporary
    folder renamed to ``path`` when complete. A peft model saves its adapter. transformers'
    ``save_pretrained`` logs instead of raising in some failures, so the weights are checked.
    """
    state_dict = accelerator.get_state_dict(model)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), TMP_PREFIX + os.path.basename(path))

    def write():
        if os.path.lexists(path) and not os.path.isdir(path):
            raise CheckpointError(
                f"cannot save the final model to {path}: it exists and is not a folder; remove it "
                "or choose another --output-dir"
            )
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        names = set(os.listdir(tmp)) if os.path.isdir(tmp) else set()
        weights = {"model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors"}
        if not names & weights:
            raise CheckpointError(
                f"saving the final model to {path} failed: save_pretrained wrote no weights "
                f"(found {sorted(names)}); see the transformers log lines above"
            )
        _publish(tmp, path)

    _on_main(accelerator, f"saving the final model to {path}", write)


# Kept importable from here: the run folder's checks and ``--resume``'s choice live in
# output_dir.py (which imports this module, hence the lazy forward).
_MOVED = {
    "RUN_FILES", "check_output_paths", "prepare_output_dir", "remove_run", "resolve_resume",
    "run_artifacts",
}  # fmt: skip
__all__ = [
    "DATA_KEY", "MODEL_KEY", "CheckpointError", "Problems", "ResumeMismatchError", "RunState",
    "check_checkpoint", "check_fingerprint", "checkpoints", "data_fingerprint", "export_model",
    "fingerprint_mismatch", "model_fingerprint", "prune_checkpoints", "save_checkpoint",
    "unfinished_saves", *sorted(_MOVED),
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from . import output_dir

        return getattr(output_dir, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
