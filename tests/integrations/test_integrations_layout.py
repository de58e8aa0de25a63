"""``hf_varlen.integrations``: one package per concept, the old flat module paths (and
``training.auto_mode``, now ``captured_step``) kept for one release (they warn and are the moved
module itself), and the import rule of docs/ARCHITECTURE.md
(integrations/ never imports training/)."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

INTEGRATIONS = Path(__file__).resolve().parents[2] / "hf_varlen" / "integrations"
MOVED = {  # old path -> new path, both under hf_varlen
    "integrations.hub_layers": "integrations.hub.layers",
    "integrations.hub_attention": "integrations.hub.attention",
    "integrations.hub_package": "integrations.hub.package",
    "integrations.kernelize_probes": "integrations.kernelize.probes",
    "integrations.peft_lora": "integrations.kernelize.peft_lora",
    "integrations.loss": "integrations.fused_loss",
    "integrations.loss_audit": "integrations.fused_loss.audit",
    "integrations.loss_head": "integrations.fused_loss.head",
    "integrations.captured_trainer": "integrations.trainers.captured",
    "integrations.trainer_callbacks": "integrations.trainers.callbacks",
    "integrations.trl": "integrations.trainers.sft",
    "integrations.trl_preference": "integrations.trainers.preference",
    "training.auto_mode": "captured_step.auto_mode",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_is_the_new_module(old, monkeypatch):
    if old in ("integrations.trl", "integrations.trl_preference"):
        pytest.importorskip("trl")
    old_name, new_name = f"hf_varlen.{old}", f"hf_varlen.{MOVED[old]}"
    new = importlib.import_module(new_name)
    monkeypatch.delitem(sys.modules, old_name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old_name)
    assert module is new
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert any(f"{old_name} has moved to {new_name}" in m for m in messages), messages


def test_trainers_package_names_resolve_lazily():
    from hf_varlen.integrations import trainers
    from hf_varlen.integrations.trainers import callbacks, captured

    assert trainers.VarlenTrainer is captured.VarlenTrainer
    assert trainers.OffsetsCheckCallback is callbacks.OffsetsCheckCallback
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        trainers.Nope  # noqa: B018


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, absolute-or-relative module) of every import in ``path``, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


def _resolve(path: Path, level: int, module: str) -> str:
    if level == 0:
        return module
    parts = list(path.relative_to(INTEGRATIONS.parents[1]).with_suffix("").parts)
    base = parts[:-level]  # a module's own package is one level up
    return ".".join([*base, module] if module else base)


def test_integrations_never_import_training():
    paths = sorted(INTEGRATIONS.rglob("*.py"))
    assert INTEGRATIONS / "trainers" / "captured.py" in paths  # the scan sees the package
    offenders = [
        f"{path.relative_to(INTEGRATIONS)} imports {target}"
        for path in paths
        for level, module in _imports(path)
        if (target := _resolve(path, level, module)).startswith("hf_varlen.training")
    ]
    assert offenders == []
