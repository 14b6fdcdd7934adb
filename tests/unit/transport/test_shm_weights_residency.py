"""The shm weight channel's pages leave a process's page tables once it is done with a version (the
publisher after writing it, a receiver when the last tensor of it dies), while the bytes stay in
/dev/shm and every later version still reads bit-exact through the kept mapping.

Residency is read from this process's ``RssShmem`` (/proc/self/status): the shared-memory pages its
page tables map. The state is 32 MiB, so a segment kept mapped shows as >= 32 MiB of it; the bound for
"left" is 4 MiB (the segments' header and table pages, and other tests' shm in this process)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from areal_async.transport import make_weight_channel
from areal_async.transport.shm import SHM_DIR
from tests.support.transport_helpers import assert_bit_exact, no_shm_leaks  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("no_shm_leaks"),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
]

MIB = 1 << 20
STATE = 32 * MIB


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssShmem:"))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(STATE // 4 // 4, generator=g) for n in "abcd"}  # 4 x 8 MiB


def _allocated(ch) -> int:
    """Bytes /dev/shm holds for the publisher's segments (tmpfs blocks, not the files' lengths)."""
    return sum(os.stat(p).st_blocks * 512 for p in SHM_DIR.glob(f"{ch._prefix}_w*"))


def test_the_publisher_maps_no_segment_after_writing_and_the_bytes_stay():
    """Three versions into three segments (none released): before, each stayed mapped (>= 96 MiB here);
    now none is, /dev/shm still holds all three, and a receiver reads the first one bit-exact."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=8)
    rx = make_weight_channel("shm", role="receiver")
    try:
        base = _rss_shmem()
        states, manifests = [_weights(v) for v in range(3)], []
        for v, sd in enumerate(states):
            manifests.append(pub.publish_begin(v, sd))
            pub.publish_end()
        assert _rss_shmem() - base < 4 * MIB
        assert _allocated(pub) >= 3 * STATE
        got = rx.receive(manifests[0])
        assert_bit_exact(got, states[0])
    finally:
        rx.close()
        pub.close()


def test_a_receiver_maps_a_version_while_its_tensors_live_and_reads_the_next_exact():
    """v0 received: its checksum pass leaves no bucket mapped (< 4 MiB + one 8 MiB bucket); reading the
    tensors maps their 32 MiB, which leave with the last of them; v3 then lands in v0's segment (pool
    reuse after v0 and v1 are released) and reads bit-exact through the receiver's kept mapping, whose
    pages were dropped in between."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=8)
    rx = make_weight_channel("shm", role="receiver")
    try:
        base = _rss_shmem()
        sd0 = _weights(0)
        m0 = pub.publish_begin(0, sd0)
        pub.publish_end()
        got = rx.receive(m0)
        assert _rss_shmem() - base < 12 * MIB
        assert_bit_exact(got, sd0)
        assert _rss_shmem() - base >= STATE
        del got
        gc.collect()
        assert _rss_shmem() - base < 4 * MIB
        for v in (1, 2):
            pub.publish_begin(v, _weights(v))
            pub.publish_end()
        pub.release(0)
        pub.release(1)
        sd3 = _weights(3)
        m3 = pub.publish_begin(3, sd3)
        pub.publish_end()
        assert m3["handle"]["segment"] == m0["handle"]["segment"]  # the same segment, rewritten
        assert_bit_exact(rx.receive(m3), sd3)
    finally:
        rx.close()
        pub.close()


def test_released_tensors_leave_the_process_and_read_the_same_again():
    """What a loader that copies part by part does (TorchEngine.update_weights): after each part it
    releases the part's tensors; their pages leave (RssShmem back under 4 MiB after all four), and a
    released tensor read again holds the same bytes (mapped again from /dev/shm)."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=8)
    rx = make_weight_channel("shm", role="receiver")
    try:
        base = _rss_shmem()
        sd = _weights(5)
        m = pub.publish_begin(5, sd)
        pub.publish_end()
        got = rx.receive(m)
        peak = 0
        for name, t in got.items():
            assert torch.equal(t, sd[name])  # maps this tensor's 8 MiB
            peak = max(peak, _rss_shmem() - base)
            got.release([t])
        assert peak < 8 * MIB + 4 * MIB  # one part at a time
        assert _rss_shmem() - base < 4 * MIB
        assert_bit_exact(got, sd)
    finally:
        rx.close()
        pub.close()
