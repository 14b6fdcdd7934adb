"""Delta weight publication (transport/delta.py): bit-exact round trips, refusals, the full-weights fallback."""

from __future__ import annotations

import struct
import threading
import zlib

import pytest
import torch

from areal_async.transport import ManifestError, TransportError, make_weight_channel
from areal_async.transport.delta import apply, encode
from areal_async.transport.shm import SHM_DIR
from tests.support.transport_helpers import assert_bit_exact, no_shm_leaks  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("no_shm_leaks"),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
]
KINDS = ["shm", "zmq"]
BUCKET_MB = 1 / 64  # 16 KiB buckets: "b" spans several


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.arange(64, dtype=torch.float32), "b": torch.randn(300, 70, generator=g).to(torch.bfloat16)}


def _changed(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with w[0], w[1], w[5] changed: 0.0 -> 100.0 (0x00000000 -> 0x42c80000), 1.0 -> 101.0 (0x3f800000 ->
    0x42ca0000), 5.0 -> 105.0 (0x40a00000 -> 0x42d20000): the high 16-bit lane of each, 3 lanes of bucket 0."""
    out = {k: v.clone() for k, v in sd.items()}
    out["w"][[0, 1, 5]] += 100.0
    return out


def _pair(kind: str):
    pub = make_weight_channel(kind, role="publisher", delta=True, bucket_mb=BUCKET_MB)
    return pub, make_weight_channel(kind, role="receiver", delta=True)


def _full(kind: str, version: int, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a plain (non-delta) channel of ``kind`` delivers for ``sd``: the expected value."""
    pub = make_weight_channel(kind, role="publisher", bucket_mb=BUCKET_MB)
    rx = make_weight_channel(kind, role="receiver")
    try:
        return {k: v.clone() for k, v in rx.receive(pub.publish_begin(version, sd)).items()}
    finally:
        pub.close()
        rx.close()


def test_encode_writes_the_changed_lanes_and_apply_restores_them():
    old = torch.zeros(32, dtype=torch.uint8)
    new = old.clone()
    new.view(torch.int16)[0], new.view(torch.int16)[5] = 5, -256  # lane 5 = 0xFF00
    payload, n = encode(new, old)
    # by hand: count 2, gaps 4 bytes wide; gaps 0 and 5 as byte planes (first bytes 00 05, then three planes of
    # zeros); XORs 0x0005 and 0xFF00 as byte planes (low bytes 05 00, high bytes 00 ff)
    want = struct.pack("<qB", 2, 4) + b"\x00\x05" + b"\x00\x00" * 3 + b"\x05\x00" + b"\x00\xff"
    assert n == 2 and zlib.decompress(payload) == want
    apply(old, payload, 1, 0)
    assert torch.equal(old, new)
    same, n = encode(new, new.clone())
    assert n == 0 and zlib.decompress(same) == struct.pack("<qB", 0, 4)
    zero = torch.zeros(32, dtype=torch.uint8)
    assert encode(new, zero, dense=1 / 16) == (None, 2)  # 2 of 16 lanes changed: more than 1/16 is too dense
    assert encode(new, zero, dense=2 / 16)[0] is not None and encode(new, zero, dense=2 / 16 - 1e-9)[0] is None


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"not zlib", "bucket 3 does not decompress"),
        (zlib.compress(struct.pack("<qB2I", 2, 4, 0, 2)), "bucket 3 is 17 bytes, not a count and its lanes"),
        (zlib.compress(struct.pack("<qB2I", 1, 3, 0, 2)), "bucket 3 is 17 bytes, not a count and its lanes"),
        (zlib.compress(struct.pack("<qBIH", 1, 4, 16, 7)), "bucket 3 names lane 16 of 16"),
    ],
)
def test_a_malformed_delta_is_refused_and_the_buffer_is_untouched(payload, match):
    buf = torch.arange(32, dtype=torch.uint8)
    with pytest.raises(TransportError, match=f"weights v9: delta of {match}"):
        apply(buf, payload, 9, 3)
    assert torch.equal(buf, torch.arange(32, dtype=torch.uint8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_a_delta_round_trip_equals_the_full_publication_bit_for_bit(kind):
    pub, rx = _pair(kind)
    sd1, sd2 = _weights(), _changed(_weights())
    try:
        m1 = pub.publish_begin(1, sd1)
        assert m1["delta"] is None  # nothing to diff against yet
        assert_bit_exact(rx.receive(m1), _full(kind, 1, sd1))
        assert rx.path == "full"
        m2 = pub.publish_begin(2, sd2)
        assert m2["delta"]["base"] == 1
        assert m2["delta"]["changed"][0] == 3 and sum(m2["delta"]["changed"]) == 3
        assert pub.sizes["delta"] < pub.sizes["full"] / 20
        pub.inner.release(4)  # v2's full buckets (inner version 2 v) are gone: only the delta can deliver v2
        got = rx.receive(m2)
        assert rx.path == "delta"
        assert_bit_exact(got, _full(kind, 2, sd2))
        assert_bit_exact(got, sd2)
    finally:
        pub.close()
        rx.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_a_delta_that_misses_the_full_checksum_is_refused_and_the_old_weights_stay(kind):
    pub, rx = _pair(kind)
    sd1, sd2 = _weights(), _changed(_weights())
    sd3 = _changed(sd2)
    try:
        got1 = rx.receive(pub.publish_begin(1, sd1))
        got1["w"][3] = 99.0  # the receiver's copy of v1 is no longer v1 (a consumer wrote into it)
        with pytest.raises(TransportError, match=r"weights v2: bucket 0 .* sum64 .*the delta against v1 refused, "
                           r"this receiver keeps v1"):  # fmt: skip
            rx.receive(pub.publish_begin(2, sd2))
        want1 = {k: v.clone() for k, v in sd1.items()}
        want1["w"][3] = 99.0
        assert_bit_exact(got1, want1)  # the refused version wrote nothing into what it had
        m3 = pub.publish_begin(3, sd3)
        assert m3["delta"]["base"] == 2
        got3 = rx.receive(m3)  # it holds v1, not v2: the full weights
        assert rx.path == "full"
        assert_bit_exact(got3, _full(kind, 3, sd3))
    finally:
        pub.close()
        rx.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_a_receiver_without_the_base_gets_the_full_weights(kind):
    pub, rx = _pair(kind)
    late = make_weight_channel(kind, role="receiver", delta=True)  # a restarted rollout worker
    sd1, sd2 = _weights(), _changed(_weights())
    sd3 = _changed(sd2)
    try:
        rx.receive(pub.publish_begin(1, sd1))
        m2 = pub.publish_begin(2, sd2)
        assert_bit_exact(late.receive(m2), sd2)
        assert late.path == "full"
        m3 = pub.publish_begin(3, sd3)  # rx missed v2
        assert_bit_exact(rx.receive(m3), sd3)
        assert rx.path == "full"
        assert_bit_exact(late.receive(m3), sd3)
        assert late.path == "delta"
        sd4 = {k: v + 1 for k, v in sd3.items()}  # every element moved: too dense for a delta
        m4 = pub.publish_begin(4, sd4)
        assert m4["delta"] is None
        assert_bit_exact(late.receive(m4), sd4)
        assert late.path == "full"
        sd5 = {**sd4, "extra": torch.ones(3)}  # another layout: no delta for anyone
        m5 = pub.publish_begin(5, sd5)
        assert m5["delta"] is None
        assert_bit_exact(late.receive(m5), sd5)
        assert late.path == "full"
    finally:
        for ch in (pub, rx, late):
            ch.close()


def test_bad_manifests_and_a_waiting_inner_channel_are_refused():
    rx = make_weight_channel("shm", role="receiver", delta=True)
    with pytest.raises(ManifestError, match="delta manifest \\['format'\\]: expected keys"):
        rx.receive({"format": "areal-weights/1"})
    with pytest.raises(ValueError, match="publish_end waits for receivers"):
        make_weight_channel("zmq", role="publisher", delta=True, expect_receivers=1)


@pytest.mark.timeout(60)
def test_an_older_version_received_late_does_not_replace_the_newer_base():
    pub, rx = _pair("shm")
    sd = [_weights()]
    for _ in range(3):
        sd.append(_changed(sd[-1]))
    entered, go, got2 = threading.Event(), threading.Event(), {}
    inner_receive = rx.inner.receive

    def slow_v2_delta(m):  # v2's delta (inner version 5) waits until v3 is in
        if m["version"] == 5:
            entered.set()
            assert go.wait(30)
        return inner_receive(m)

    try:
        rx.receive(pub.publish_begin(0, sd[0]))
        m1, m2 = pub.publish_begin(1, sd[1]), pub.publish_begin(2, sd[2])
        rx.receive(m1)
        rx.inner.receive = slow_v2_delta
        late = threading.Thread(target=lambda: got2.update(sd=rx.receive(m2)))
        late.start()
        assert entered.wait(30)
        assert_bit_exact(rx.receive(pub.publish_begin(3, sd[3])), sd[3])  # holds v1, not v2: in full
        go.set()
        late.join(30)
        assert_bit_exact(got2["sd"], sd[2])  # v2 itself arrives intact ...
        assert_bit_exact(rx.receive(pub.publish_begin(4, _changed(sd[3]))), _changed(sd[3]))
        assert rx.path == "delta"  # ... but the base stayed v3: v4's delta against v3 applies
    finally:
        go.set()
        pub.close()
        rx.close()
