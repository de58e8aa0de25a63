"""The shape of hf_varlen/training (issue 43 item 4): small modules, a trainer built from small
builders, and imports of the rest of the package through public names only."""

from __future__ import annotations

import ast
from pathlib import Path

# The repository root is the first folder above this file that holds the package (this file may
# sit in a subfolder of tests/).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "hf_varlen").is_dir())
TRAINING = ROOT / "hf_varlen" / "training"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def test_no_training_module_is_over_450_lines():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in TRAINING.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 450} == {}


def test_training_imports_only_public_names_of_the_rest_of_the_package():
    private = []
    for path in TRAINING.glob("*.py"):
        for node in ast.walk(_tree(path)):
            # level 1 is training/ itself; level 2 (``from ..x import``) is the rest of hf_varlen
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                private += [
                    f"{path.name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert private == []


def test_the_trainer_is_built_from_small_builders():
    loop = _tree(TRAINING / "loop.py")
    trainer = next(
        n for n in loop.body if isinstance(n, ast.ClassDef) and n.name == "PackedTrainer"
    )
    sizes = {
        f.name: f.end_lineno - f.lineno + 1
        for f in trainer.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith(("__init__", "_build"))
    }
    assert set(sizes) == {"__init__", "_build_data", "_build_model", "_build_state"}
    assert max(sizes.values()) <= 45, sizes
