"""Fingerprints: what a checkpoint must share with the run that resumes it.

A checkpoint's ``RunState.fingerprint`` holds the options that shape the data order, the model
config (``model_fingerprint``: runtime-only keys left out) and a digest of the tokenized training
data (``data_fingerprint``); ``fingerprint_mismatch`` says what differs, in the words of the options
to change. ``checkpoint.check_fingerprint`` applies it before any weight is loaded.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Model config keys that may differ between the run that saved and the one that resumes: how the
# model runs (attention implementation, dtype, cache), not what it computes.
_RUNTIME_CONFIG_KEYS = frozenset(
    {
        "_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "dtype",
        "torch_dtype", "attn_implementation", "_attn_implementation",
        "_attn_implementation_autoset", "use_cache", "return_dict", "output_attentions",
        "output_hidden_states", "architectures",
    }
)  # fmt: skip
MODEL_KEY, DATA_KEY = "model_config", "data"


def model_fingerprint(config) -> dict[str, Any]:
    """A ``PretrainedConfig`` as the JSON-plain dict a checkpoint stores (runtime keys left out)."""
    values = {k: v for k, v in config.to_dict().items() if k not in _RUNTIME_CONFIG_KEYS}
    return json.loads(json.dumps(values, sort_keys=True, default=str))


def data_fingerprint(input_ids, labels) -> str:
    """A digest of the tokenized training examples (ids and labels, in order): the dataset, its
    format, the tokenizer and --max-length all show in it."""
    digest = hashlib.sha256()
    for ids, lab in zip(input_ids, labels, strict=True):
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.tobytes())
        digest.update(lab.tobytes())
    return digest.hexdigest()[:16]


def fingerprint_mismatch(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's fingerprint ``saved`` and this run's ``now`` (keys the
    checkpoint lacks are not compared: older checkpoints, see ``missing_fingerprints``)."""
    if not saved:
        return None
    parts = []
    if MODEL_KEY in saved and MODEL_KEY in now:
        a, b = saved[MODEL_KEY], now[MODEL_KEY]
        keys = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
        if keys:
            shown = ", ".join(
                f"{k}: checkpoint {a.get(k, '<unset>')!r} vs now {b.get(k, '<unset>')!r}"
                for k in keys[:6]
            )
            more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
            parts.append(
                f"the checkpoint is of another model config ({shown}{more}); resume with the "
                "--model and --config-overrides it was saved with"
            )
    if DATA_KEY in saved and DATA_KEY in now and saved[DATA_KEY] != now[DATA_KEY]:
        parts.append(
            f"the checkpoint was trained on other data (tokenized examples digest "
            f"{saved[DATA_KEY]} vs now {now[DATA_KEY]}: --dataset, its contents, --format, the "
            "tokenizer, --max-length or --max-examples differ); resume with the same data"
        )
    order = {
        k: (saved[k], v)
        for k, v in now.items()
        if k not in (MODEL_KEY, DATA_KEY) and k in saved and saved[k] != v
    }
    if order:
        parts.append(
            "the checkpoint was written with different data-order options "
            + ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in order.items())
            + "; resume with the same options"
        )
    return "; ".join(parts) + " (or start a new run)" if parts else None
