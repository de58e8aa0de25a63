"""Where ``--model``, ``--tokenizer`` and ``--dataset`` come from: a local path or a Hub id.

An argument that exists on disk is local. One that does not, but *looks like a path* (starts with
``/ ./ ../ ~``, has a backslash or more than one ``/``, is not a valid Hub repo id, or, for data,
ends in a data-file suffix) is "no such file or folder", with the closest existing name where there
is one, instead of a Hub lookup that fails deep inside ``datasets`` or ``huggingface_hub``. Only
the rest is tried as a Hub id (``org/name`` or ``name``).

Hub access fails fast, once: with ``HF_HUB_OFFLINE=1`` an id that is not in the local cache is an
error right away; otherwise one short connection probe (per process) tells whether the Hub can be
reached; when it cannot, a cached copy is used (``local_files_only``) and anything else is one clear
error, not a minute of retries.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import socket
from typing import Any
from urllib.parse import urlparse

logger = logging.getLogger("hf_varlen.training")

DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_PROBE_TIMEOUT_S = 3.0


def looks_like_path(text: str, *, data: bool = False) -> bool:
    """True when ``text`` is meant as a local path (see the module docstring)."""
    if text.startswith(("/", "./", "../", "~", ".\\")) or "\\" in text or text.count("/") > 1:
        return True
    if data and text.lower().endswith(DATA_SUFFIXES):
        return True
    return not _REPO_ID.match(text) or "--" in text or ".." in text


def closest_existing(path: str) -> str | None:
    """The existing path most like ``path`` (same folder, closest name), or None."""
    path = os.path.normpath(os.path.expanduser(path))
    parent, name = os.path.split(path)
    missing = [name]
    while parent and not os.path.isdir(parent):
        parent, name = os.path.split(parent)
        missing.insert(0, name)
    base = parent or "."
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    match = difflib.get_close_matches(missing[0], entries, n=1, cutoff=0.6)
    if not match:
        return None
    guess = os.path.join(parent, match[0]) if parent else match[0]
    if len(missing) > 1:  # a typo higher up: suggest the rest under the corrected folder if it fits
        rest = os.path.join(guess, *missing[1:])
        return rest if os.path.exists(rest) else closest_existing(rest) or guess
    return guess


def local_or_hub(flag: str, text: str, *, data: bool = False) -> tuple[str, bool]:
    """``(path or id, is_local)``. Raises ``FileNotFoundError`` for a path that does not exist."""
    expanded = os.path.expanduser(text)
    if os.path.exists(expanded):
        return expanded, True
    if looks_like_path(text, data=data):
        guess = closest_existing(text)
        hint = f"; did you mean {guess!r}?" if guess else ""
        raise FileNotFoundError(f"{flag} {text!r}: no such file or folder{hint}")
    return text, False


@functools.cache
def hub_reachable() -> str | None:
    """None when the Hub endpoint accepts a connection, else why not (probed once per process)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{url.scheme}://{url.hostname} cannot be reached ({exc})"
    return None


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cached(repo: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, filename), str)


def hub_access(flag: str, repo: str, *, filename: str = "config.json") -> dict[str, Any]:
    """Keyword arguments for ``from_pretrained(repo, ...)``; raises ``ConnectionError`` at once
    when ``repo`` can neither be downloaded nor found in the cache."""
    what = f"{flag} {repo!r} is not a local path, so it is a Hugging Face Hub id"
    if _offline_env():
        if not _cached(repo, filename):
            raise ConnectionError(
                f"{what}, but HF_HUB_OFFLINE=1 and it is not in the local cache: download it "
                "first (`hf download ...`), unset HF_HUB_OFFLINE, or pass a local folder"
            )
        return {}
    why = hub_reachable()
    if why is None:
        return {}
    if _cached(repo, filename):
        logger.warning("%s; using the cached copy of %s", why, repo)
        return {"local_files_only": True}
    raise ConnectionError(
        f"{what}, but {why} and it is not in the local cache: connect to the network, or pass a "
        "local folder"
    )


def dataset_access(flag: str, name: str) -> None:
    """Fail fast for a Hub dataset when the Hub cannot be reached (datasets' own cache is used
    with ``HF_HUB_OFFLINE=1``)."""
    if _offline_env():
        return
    why = hub_reachable()
    if why is not None:
        raise ConnectionError(
            f"{flag} {name!r} is not a local file, so it is a Hugging Face Hub dataset, but {why}. "
            "Connect to the network, pass a local .json/.jsonl/.parquet file, or set "
            "HF_HUB_OFFLINE=1 to use a copy in the datasets cache"
        )
