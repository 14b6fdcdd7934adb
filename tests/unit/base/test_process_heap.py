"""cluster.retained_heap_mb: a freed block's pages stay in the process (base/process.retain_freed_heap).

Each case runs in a fresh interpreter (mallopt settings are process-wide and stick): it mallocs a
4 MiB block, touches every page, frees it, mallocs 4 MiB again and counts the minor page faults of
touching that second block. 4 MiB / 4 KiB = 1024 pages: with glibc's defaults a block this size is
mmapped and unmapped on free, so the second touch faults once per page; with the heap retained it
is the first block's memory again and faults (almost) never."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

PROBE = """
import ctypes, resource, sys
from areal_async.base.process import retain_freed_heap
took = retain_freed_heap(int(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
n = 4 << 20
a = libc.malloc(n); libc.memset(a, 1, n); libc.free(a)
b = libc.malloc(n)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.memset(b, 1, n)
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, resource.getpagesize())
"""


def _second_touch(mb: int) -> tuple[bool, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(mb)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    took, faults, page = out.stdout.split()
    return took == "True", int(faults), int(page)


def test_a_retained_heap_gives_a_freed_block_back_without_page_faults():
    took, faults, page = _second_touch(64)
    assert took
    assert faults < 0.05 * (4 << 20) // page, faults


def test_zero_keeps_glibcs_defaults_where_the_block_faults_in_again():
    took, faults, page = _second_touch(0)
    assert not took
    assert faults >= 0.9 * (4 << 20) // page, faults  # one fault per page of the 4 MiB block
