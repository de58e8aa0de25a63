"""Packaging: triton is only where it is used. A CPU-only install has no triton (it is not a base
dependency; CUDA builds of torch bring it), so the package, its backend registry, the collator and a
packed forward must work without it; the test extra brings it for the interpreter-run CPU tests."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# sys.modules[name] = None is how Python spells "not installed": `import triton` raises
# ModuleNotFoundError and importlib.util.find_spec("triton") returns None, as without the package.
WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None
import torch
import hf_varlen
from transformers import AutoModelForCausalLM, LlamaConfig

names = hf_varlen.available_backends()
assert "triton" not in names and "sdpa" in names, names
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
model = AutoModelForCausalLM.from_config(config, attn_implementation="varlen_packed")
batch = hf_varlen.PackingCollator()([{"input_ids": list(range(1, 9))}, {"input_ids": [3, 4, 5]}])
loss = model(**batch).loss
loss.backward()
assert torch.isfinite(loss), loss
assert "triton" not in sys.modules or sys.modules["triton"] is None
print("OK", names)
"""


def _requirement_names(requirements):
    return {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}


def test_triton_is_a_test_extra_not_a_base_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "triton" not in _requirement_names(project["dependencies"])
    assert "triton" in _requirement_names(project["optional-dependencies"]["test"])


def test_import_backends_and_a_packed_step_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("OK"), result.stdout
