"""The run folder (``--output-dir``): what a run leaves there, refusing to mix two runs, the
checks before anything is loaded, and which checkpoint ``--resume`` continues from."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from .checkpoint import CheckpointError, check_checkpoint, checkpoints, unfinished_saves
from .options import PROFILE_DIR, TENSORBOARD_DIR

logger = logging.getLogger("hf_varlen.training")

# What a run leaves in --output-dir (besides checkpoints): a new run there would mix with these.
RUN_FILES = (
    "metrics.jsonl",
    "summary.json",
    "loss_vs_step.png",
    "loss_vs_time.png",
    "tokens_per_s.png",
)


def run_artifacts(output_dir: str) -> list[str]:
    """What of a previous run ``output_dir`` holds (names relative to it)."""
    if not os.path.isdir(output_dir):
        return []
    found = [f for f in RUN_FILES if os.path.isfile(os.path.join(output_dir, f))]
    # --report-to tensorboard's event files, --profile-step's summaries and traces
    for folder in ("final", TENSORBOARD_DIR, PROFILE_DIR):
        if os.path.isdir(os.path.join(output_dir, folder)):
            found.append(folder + "/")
    found += [os.path.basename(c) + "/" for c in checkpoints(output_dir)]
    found += [os.path.basename(c) + "/" for c in unfinished_saves(output_dir)]
    return found


def remove_run(output_dir: str) -> list[str]:
    """Delete what a previous run left in ``output_dir`` (its checkpoints too); other files stay."""
    removed = run_artifacts(output_dir)
    for name in removed:
        path = os.path.join(output_dir, name.rstrip("/"))
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return removed


def _rng_hint(path: str, missing: list[str]) -> str:
    return (
        f"--resume {path!r}: {', '.join(missing)} is missing (the random states of that process), "
        "so the continuation would not be bit-identical. Pass --resume-without-rng to resume with "
        "fresh random states, or resume from another checkpoint"
    )


def resolve_resume(
    resume: str | None, output_dir: str, *, processes: int, without_rng: bool = False
) -> str | None:
    """The checkpoint folder to resume from (validated), or None to start fresh.

    Raises ``CheckpointError`` naming the missing or damaged file of an explicit folder, or when
    ``latest`` finds only incomplete checkpoints in a directory that holds a run.
    """
    if resume is None:
        return None
    if resume != "latest":
        problems = check_checkpoint(resume, processes)
        if problems.broken:
            raise CheckpointError(
                f"--resume {resume!r}: not a complete checkpoint: {problems.text()}. Pass another "
                "checkpoint-<step> folder, or 'latest' for the newest complete one"
            )
        if problems.rng:
            if not without_rng:
                raise CheckpointError(_rng_hint(resume, problems.rng))
            logger.warning(
                "--resume-without-rng: %s lacks %s; resuming with fresh random states",
                resume,
                ", ".join(problems.rng),
            )
        return resume
    for tmp in unfinished_saves(output_dir):
        logger.warning("--resume latest: ignoring %s, a save that did not finish", tmp)
    for path in checkpoints(output_dir):
        problems = check_checkpoint(path, processes)
        if problems.broken:
            logger.warning(
                "--resume latest: skipping incomplete checkpoint %s: %s", path, problems.text()
            )
            continue
        return resolve_resume(path, output_dir, processes=processes, without_rng=without_rng)
    if run_artifacts(output_dir):
        raise CheckpointError(
            f"--resume latest: no complete checkpoint under {output_dir!r}, which holds a run "
            f"({', '.join(run_artifacts(output_dir)[:6])}). Pass --overwrite-output-dir to start "
            "over there (the old run is deleted), or choose another --output-dir"
        )
    logger.warning("--resume latest: no checkpoint under %s; starting fresh", output_dir)
    return None


def check_output_paths(out: str, *, files: tuple[str, ...], folders: tuple[str, ...]) -> None:
    """Refuse, before anything is loaded, an ``--output-dir`` the run could not write to: one that
    is (or lies below) a regular file, one on a read-only file system or without write permission,
    and ``files`` / ``folders`` (names under ``out`` the run will write) that exist as the other
    kind. Creates ``out``. Raises ``ValueError`` naming the path and the fix; so a final export
    into a file that is in the way fails now, not after the last training step."""
    here = os.path.abspath(out)
    while here and not os.path.exists(here):  # the first existing folder above (or ``out``)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    if os.path.exists(here) and not os.path.isdir(here):
        where = "is" if here == os.path.abspath(out) else f"lies below {here!r}, which is"
        raise ValueError(
            f"--output-dir {out!r} {where} a file, not a folder; choose another --output-dir "
            "(or move the file away)"
        )
    try:
        os.makedirs(out, exist_ok=True)
        # not TMP_PREFIX: another rank's probe must not read as an unfinished save of a run
        fd, probe = tempfile.mkstemp(prefix=".hf-varlen-write-probe-", dir=out)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ValueError(
            f"--output-dir {out!r} cannot be written to ({exc.strerror or exc}); choose a folder "
            "on a writable file system where you have write permission"
        ) from None
    for name in files:
        if os.path.isdir(os.path.join(out, name)):
            raise ValueError(
                f"--output-dir {out!r}: {name} is a folder, but the run writes a file of that "
                "name; move it away or choose another --output-dir"
            )
    for name in folders:
        path = os.path.join(out, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ValueError(
                f"--output-dir {out!r}: {name} is a file, but the run writes a folder of that "
                "name there; move it away or choose another --output-dir"
            )


def prepare_output_dir(out: str, overwrite: bool, resumed_from: str | None, acc) -> None:
    """Refuse to mix two runs in one --output-dir ``out``; ``overwrite``
    (--overwrite-output-dir) removes the old one (on the main process; every rank waits)."""
    found = run_artifacts(out)
    parent = os.path.dirname(os.path.abspath(resumed_from or out))
    inside = resumed_from is not None and os.path.isdir(out) and os.path.samefile(parent, out)
    if overwrite:
        if inside:
            raise ValueError(
                f"--overwrite-output-dir would delete {resumed_from}, which --resume names; drop "
                "one of the two"
            )
        if found and acc.is_main_process:
            remove_run(out)
            logger.warning("--overwrite-output-dir: removed from %s: %s", out, ", ".join(found))
        acc.wait_for_everyone()
    elif found and not inside:
        start = "a new run" if resumed_from is None else "a resumed run"
        # --resume latest only works where a checkpoint exists (runs save none by default)
        if checkpoints(out):
            advice = (
                "Pass --resume latest to continue it, --overwrite-output-dir to replace it (its "
                "checkpoints are deleted too)"
            )
        else:
            advice = (
                "It saved no checkpoint to resume from (--save-every N saves them); pass "
                "--overwrite-output-dir to replace it"
            )
        raise ValueError(
            f"--output-dir {out!r} already holds a run ({', '.join(found[:6])}); {start} "
            f"there would mix with it. {advice}, or choose another --output-dir"
        )
