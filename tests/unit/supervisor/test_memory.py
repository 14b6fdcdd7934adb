"""Per-worker peak RSS (supervisor/memory.py) against the kernel's other account and a known allocation."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from types import SimpleNamespace

import pytest

from areal_async.supervisor.memory import PeakRss, vm_hwm_kb


def test_vm_hwm_is_what_getrusage_reports_for_this_process():
    import os

    # both KiB on Linux; the kernel updates its two accounts at different moments: within 2 %
    assert vm_hwm_kb(os.getpid()) == pytest.approx(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rel=0.02)
    assert vm_hwm_kb(None) is None and vm_hwm_kb(2**22 + 12345) is None  # no such process


def test_a_child_that_touched_300_mib_peaks_above_it_and_the_peak_outlives_the_free():
    code = "b = bytearray(300 << 20); del b; print('freed', flush=True); import sys; sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "freed\n"
        rss = PeakRss(every_s=10.0)
        child = SimpleNamespace(name="rollout-0", proc=proc)
        rss.sample([child], now=0.0)
        rss.peak_kb["rollout-0"] -= 1  # a second sample within every_s is skipped ...
        rss.sample([child], now=5.0)
        assert 300 <= rss.mb()["rollout-0"] < 300 + 100  # the interpreter adds tens of MiB
        skipped = rss.peak_kb["rollout-0"]
        rss.sample([child], now=10.0)  # ... one after it is taken
        assert rss.peak_kb["rollout-0"] == skipped + 1
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    rss.sample([child], now=20.0)  # exited: the entry stays
    assert rss.mb()["rollout-0"] >= 300


def test_the_parts_split_own_memory_from_mapped_shared_memory():
    """A child that maps and touches a 96 MiB /dev/shm file and holds 64 MiB of its own: its sampled
    RssShmem is at least 96 MiB and its RssAnon at least 64 MiB (and the shared pages are not counted as
    its own: RssAnon stays under 64 + 96 MiB)."""
    code = (
        "import mmap, os, sys; fd = os.open('/dev/shm/' + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); "
        "os.ftruncate(fd, 96 << 20); m = mmap.mmap(fd, 96 << 20); m.write(b'x' * (96 << 20)); "
        "own = bytearray(b'y' * (64 << 20)); print('ready', flush=True); sys.stdin.read()"
    )
    name = f"areal_test_parts_{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        rss = PeakRss(every_s=0.0)
        rss.sample([SimpleNamespace(name="trainer", proc=proc)], now=0.0)
        parts = rss.parts_mb()["trainer"]
        assert parts["shmem"] >= 96 and 64 <= parts["anon"] < 64 + 96
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        os.unlink(f"/dev/shm/{name}")
