"""The ``auto`` rule (``hf_varlen.captured_step.auto_mode``): its choices and messages for given
inputs, explicit choices honoured or refused with the reason, never replaced."""

from __future__ import annotations

import pytest

from hf_varlen.captured_step.auto_mode import (
    CROSSOVER_REAL_TOKENS,
    MEMORY_MARGIN,
    capture_bytes,
    choose_step_mode,
)

GIB = 2**30


def test_auto_captures_below_the_crossover_on_cuda():
    mode = choose_step_mode("auto", device="cuda", real_tokens=2_400, free_bytes=60 * GIB,
                            need_bytes=20 * GIB)  # fmt: skip
    assert mode.captured and "2,400 real tokens per micro-batch, below the 10,000" in mode.text
    lora = choose_step_mode("auto", device="cuda", real_tokens=2_400, lora=True)
    assert lora.captured and "LoRA: same threshold; captured measured ahead" in lora.text


def test_auto_stays_eager_and_says_why():
    cases = {
        "above the 10,000 crossover": dict(device="cuda", real_tokens=CROSSOVER_REAL_TOKENS + 1),
        "CUDA graphs need a CUDA device (this run uses cpu)": dict(device="cpu", real_tokens=100),
        "one process only (this run has 2)": dict(device="cuda", real_tokens=100, processes=2),
        "--padded batches": dict(device="cuda", real_tokens=100, blockers=["--padded batches"]),
        "capturing needs ~20.0 GiB (x1.25 margin) and 24.0 GiB is free": dict(
            device="cuda", real_tokens=100, free_bytes=24 * GIB, need_bytes=20 * GIB
        ),
    }
    for needle, kw in cases.items():
        mode = choose_step_mode("auto", **kw)
        assert not mode.captured and mode.text.startswith("eager (auto: "), (needle, mode)
        assert needle in mode.text, (needle, mode.text)
    # Enough memory with the margin: captured.
    need = 20 * GIB
    fits = choose_step_mode("auto", device="cuda", real_tokens=100, free_bytes=int(need * MEMORY_MARGIN) + 1,
                            need_bytes=need)  # fmt: skip
    assert fits.captured


def test_explicit_choices_are_honoured_or_refused():
    off = choose_step_mode("off", device="cuda", real_tokens=100)
    assert not off.captured and off.text == "eager (off: requested)"
    # on above the crossover: honoured (the crossover is a speed rule, not a blocker).
    on = choose_step_mode("on", device="cuda", real_tokens=10 * CROSSOVER_REAL_TOKENS)
    assert on.captured and on.text == "captured (on: requested)"
    with pytest.raises(ValueError, match="cuda_graphs on cannot be honoured: CUDA graphs need"):
        choose_step_mode("on", device="cpu", real_tokens=100)
    with pytest.raises(ValueError, match="cannot be honoured: .*GiB is free"):
        choose_step_mode("on", device="cuda", real_tokens=100, free_bytes=GIB, need_bytes=GIB)
    with pytest.raises(ValueError, match="cuda_graphs: expected 'auto', 'on' or 'off'"):
        choose_step_mode("yes", device="cuda", real_tokens=100)


def test_capture_bytes_reproduces_its_measurement():
    """8 shapes of ~10K tokens on the 1B shape (hidden 2048, 16 layers): ~21.9 GiB measured."""
    est = capture_bytes(10_000, 2048, 16) / GIB
    assert 20 < est < 24
