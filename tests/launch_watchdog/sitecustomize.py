"""Test launches only (tests/training/test_train_distributed.py puts this folder first on
PYTHONPATH): every Python process of a launch -- accelerate's launcher and each rank -- prints all
of its threads' stacks to stderr and exits 1 once HF_VARLEN_TEST_WATCHDOG_S seconds have passed, so
a launch that hangs fails before the test's own subprocess timeout, with the frame each process was
stuck in, instead of leaving orphaned ranks and a bare TimeoutExpired. Being first on the path, it
stands in for any sitecustomize of the interpreter in those launches (a venv has none)."""

import faulthandler
import os

_seconds = os.environ.get("HF_VARLEN_TEST_WATCHDOG_S")
if _seconds:
    faulthandler.dump_traceback_later(float(_seconds), exit=True)
