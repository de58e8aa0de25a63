"""Shared test configuration.

GPU tests (``@pytest.mark.gpu``) never pass silently on a machine without CUDA: they are skipped
with a loud reason, and the session summary repeats how many were skipped and how to run them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Triton kernels run under the numpy interpreter on machines without CUDA. The variable is read when
# a kernel is decorated, so it must be set before any hf_varlen.ops module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The shared helpers (attn_cases, tiny_packed, tiny_runs, model_families, traced_triton_compile)
# live here, beside the per-folder test files that import them by module name.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

SHARED_DATA = Path(
    os.environ.get("HF_VARLEN_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)

_GPU_SKIPPED: list[str] = []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    reason = "NO CUDA GPU: GPU test not run here; run `pytest -m gpu tests/` on a CUDA machine (README: GPU tests and benchmarks)"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
            _GPU_SKIPPED.append(item.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _GPU_SKIPPED:
        terminalreporter.write_sep(
            "!",
            f"{len(_GPU_SKIPPED)} GPU tests were SKIPPED (no CUDA device): they are not verified by this run",
        )


def shared_data_path(*parts: str) -> Path:
    """Path under ../shared/data; skips the test loudly when the folder is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared data not found at {p} (set HF_VARLEN_SHARED_DATA)")
    return p


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global RNG state, so its unseeded draws (upstream gradients,
    model init) do not depend on which tests ran before it: a failure reproduces when run alone."""
    torch.manual_seed(0)


@pytest.fixture
def shared_data():
    return shared_data_path


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps one process-wide AcceleratorState: a test that trained with bf16 (HF
    Trainer, TRL) would make the next Accelerator() with another mixed precision raise. Reset it
    after every test that touched it (without importing accelerate for the tests that did not)."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def tiny_model():
    """Builds the shared tiny decoder (tiny_packed.TINY): ``tiny_model(kind="llama",
    attn="varlen_packed", **config_overrides)``, seeded, without KV cache."""
    from tiny_packed import tiny_model

    return tiny_model


@pytest.fixture
def fused_backward(monkeypatch):
    """Every triton attention call in the test takes the fused (atomic dQ) backward
    (``KernelConfig.bwd_fused``; off in the shipped configs)."""
    import dataclasses

    from hf_varlen.ops.attention import launch as attention

    pick = attention.pick_config
    monkeypatch.setattr(
        attention, "pick_config", lambda *a: dataclasses.replace(pick(*a), bwd_fused=True)
    )
