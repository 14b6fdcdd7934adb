"""The shm weight channel's overlap: a receiver reads and verifies bucket k while the publisher
writes bucket k+1, and a publisher that stops writing (failed, killed) is refused at once.

Buckets of 16 KiB, one float32 tensor of 16 KiB each, so bucket k is exactly tensor k."""

from __future__ import annotations

import threading

import pytest
import torch

from areal_async.transport import TransportError, make_weight_channel
from areal_async.transport import buckets as B
from areal_async.transport import shm_weights as W
from areal_async.transport.shm import SHM_DIR
from tests.support.transport_helpers import assert_bit_exact, no_shm_leaks  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("no_shm_leaks"),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
]
NAMES = ("a", "b", "c")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(4096, generator=g) for n in NAMES}  # 16 KiB each: a bucket each


class Gated(dict):
    """A state dict whose tensor ``name`` is handed to the packer only once ``gate`` is set (or
    ``raises`` instead); records whether the gate was open when the packer asked."""

    def __init__(self, sd: dict, name: str, gate: threading.Event, raises: bool = False):
        super().__init__(sd)
        self.name, self.gate, self.raises, self.opened = name, gate, raises, None

    def __getitem__(self, key):
        if key == self.name:
            self.opened = self.gate.wait(timeout=5)
            if self.raises:
                raise RuntimeError("the trainer's gather failed")
        return super().__getitem__(key)


@pytest.fixture
def threaded(monkeypatch):
    monkeypatch.setattr(W, "INLINE_BYTES", 0)  # every version in the packer thread, however small


def test_bucket_zero_is_verified_while_the_publisher_waits_to_write_bucket_one(threaded, monkeypatch):
    verified = threading.Event()
    sizes = []
    real = B.checksum

    def spy(buf, algo):
        got = real(buf, algo)
        sizes.append(buf.numel())
        verified.set()  # the receiver checked a bucket
        return got

    monkeypatch.setattr(B, "checksum", spy)
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    sub = make_weight_channel("shm", role="receiver")
    sd = _weights(0)
    gated = Gated(sd, "b", verified)
    m = pub.publish_begin(1, gated)  # returns before bucket 1 is written: the packer waits for the receiver
    got = sub.receive(m)
    pub.publish_end()
    assert gated.opened is True  # bucket 0 was verified before bucket 1 was even read from the state dict
    assert sizes == [16384, 16384, 16384] and m["checksum"]["values"] is None  # checksums travel in band
    assert_bit_exact(got, sd)
    assert set(sub.phases) == {"wait_s", "verify_s", "lock_s", "unflatten_s", "receive_s"}
    del got
    pub.close()


def test_a_publisher_that_fails_mid_write_is_refused_at_once_and_raises_in_publish_end(threaded, monkeypatch):
    monkeypatch.setattr(W, "LOCK_TIMEOUT_S", 60.0)  # a receiver that waited for the deadline would say so
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    sub = make_weight_channel("shm", role="receiver")
    gate = threading.Event()
    m = pub.publish_begin(1, Gated(_weights(0), "c", gate, raises=True))
    gate.set()
    with pytest.raises(TransportError, match="v1: segment .*: its publisher failed while writing it"):
        sub.receive(m)
    with pytest.raises(RuntimeError, match="the trainer's gather failed"):
        pub.publish_end()
    sd2 = _weights(2)
    m2 = pub.publish_begin(2, sd2)  # the failed version's segment is free again: reused, no new one
    assert m2["handle"]["segment"] == m["handle"]["segment"]
    assert_bit_exact(sub.receive(m2), sd2)
    pub.publish_end()
    pub.close()


def test_a_receiver_waits_for_a_slow_bucket_up_to_its_deadline(threaded, monkeypatch):
    monkeypatch.setattr(W, "LOCK_TIMEOUT_S", 0.3)
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    sub = make_weight_channel("shm", role="receiver")
    gate = threading.Event()
    sd = _weights(0)
    m = pub.publish_begin(1, Gated(sd, "b", gate))
    with pytest.raises(TransportError, match=r"bucket 1 was not written for 0.3s"):
        sub.receive(m)
    gate.set()
    pub.publish_end()
    assert_bit_exact(sub.receive(m), sd)  # once written, the same manifest is served
    pub.close()


def test_release_waits_for_the_packer_and_a_late_reader_is_refused(threaded):
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    sub = make_weight_channel("shm", role="receiver")
    gate = threading.Event()
    m = pub.publish_begin(1, Gated(_weights(0), "b", gate))
    threading.Timer(0.05, gate.set).start()
    pub.release(1)  # waits for the packer (else it would unmark a segment still being written)
    with pytest.raises(TransportError, match="holds no version: v1 was released or superseded"):
        sub.receive(m)
    pub.publish_end()  # nothing pending any more
    pub.close()


def test_sum64_is_the_sum_of_the_words_modulo_two_to_the_64():
    words = torch.tensor([2**63 - 1, 1, 2**62, 2**62, 2**63 - 1, 7], dtype=torch.int64)
    # by hand: (2^63 - 1) + 1 = 2^63; + 2^62 + 2^62 = 2^64 = 0 (mod 2^64); + 2^63 - 1 + 7 = 2^63 + 6
    assert B.checksum(words.view(torch.uint8), "sum64") == 2**63 + 6
