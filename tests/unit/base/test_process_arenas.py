"""cluster.malloc_arenas: memory one thread freed serves the next thread (base/process.limit_malloc_arenas).

Each case runs in a fresh interpreter (mallopt settings are process-wide): two long-lived threads take
turns, as a trainer's executor threads take its steps, three turns each; a turn mallocs and touches 40
blocks of 8 MiB (under the 32 MiB mmap threshold that ``retain_freed_heap(256)`` sets, as every torch
worker has it), then frees them. With glibc's default arenas the second thread gets an arena of its own
and each arena keeps its freed 320 MiB for its own thread: RSS ends >= 2 x 300 MiB up. With one arena
the second thread's turn reuses the first one's blocks, and the heap top is trimmed past 256 MiB free
down to the 64 MiB top pad: RSS ends under one turn's 320 MiB up."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

PROBE = """
import ctypes, sys, threading
from areal_async.base.process import limit_malloc_arenas, retain_freed_heap
took = limit_malloc_arenas(int(sys.argv[1]))
retain_freed_heap(256)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) >> 10
def work():
    blocks = [libc.malloc(8 << 20) for _ in range(40)]
    for b in blocks:
        libc.memset(b, 1, 8 << 20)
    for b in blocks:
        libc.free(b)
# two long-lived threads taking turns, as an executor's do: each waits for its turn, works, hands over
turns = [threading.Semaphore(0), threading.Semaphore(0)]
def loop(me):
    for _ in range(3):
        turns[me].acquire()
        work()
        turns[1 - me].release()
threads = [threading.Thread(target=loop, args=(i,)) for i in (0, 1)]
base = anon()
for t in threads:
    t.start()
turns[0].release()
for t in threads:
    t.join()
print(took, anon() - base)
"""


def _grown(arenas: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(arenas)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    took, grown = out.stdout.split()
    return took == "True", int(grown)


def test_with_one_arena_two_threads_taking_turns_keep_less_than_one_turn():
    took, grown = _grown(1)
    assert took
    assert grown < 320


def test_glibcs_default_arenas_keep_a_threads_freed_memory_for_it_alone():
    took, grown = _grown(0)  # 0: not applied, glibc's default
    assert not took
    assert grown >= 2 * 300  # each thread's turn kept apart
