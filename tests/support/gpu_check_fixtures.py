"""Checks for the GPU-check runner's own tests (tests/bench/test_gpu_check.py): one that fails, one that
raises, one that hangs, one that returns the wrong type."""

import time

from benchmarks.gpu_check.registry import Result


def fails() -> Result:
    return Result(False, "2 + 2 was 5", {"got": 5})


def raises() -> Result:
    raise RuntimeError("the device fell off")


def hangs() -> Result:
    time.sleep(60)
    return Result(True, "too late")


def wrong_type():
    return True
