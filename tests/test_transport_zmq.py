"""ZeroMQ channels: bit-exact round trips, bad frames, timeouts, weights served to fetchers."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

from areal_async.transport import ProtocolError, TransportError, make_tensor_channel, make_weight_channel
from protocols.messages import PROTOCOL_VERSION
from protocols.sockets import make_socket
from protocols.tensors import encode_tensors
from test_transport_helpers import assert_bit_exact, sample_tensors


@pytest.fixture
def pair():
    rx = make_tensor_channel("zmq", role="receiver", endpoint="tcp://127.0.0.1:*")
    tx = make_tensor_channel("zmq", role="sender", endpoint=rx.endpoint)
    yield tx, rx
    tx.close()
    rx.close()


def test_round_trip_every_dtype_bit_exact(pair):
    tx, rx = pair
    for i in range(2):
        t = sample_tensors(seed=i)
        tx.send(f"sample-{i}", t, {"version": i, "tags": ["a"]})
        key, meta, got = rx.recv(timeout_s=10)
        assert (key, meta) == (f"sample-{i}", {"version": i, "tags": ["a"]})
        assert_bit_exact(got, t)


def test_bad_frames_raise_and_the_receiver_keeps_serving(pair):
    tx, rx = pair
    raw = make_socket(zmq.Context.instance(), zmq.PUSH, connect=rx.endpoint)
    good = {"x": torch.arange(4, dtype=torch.int32)}
    header, frame = encode_tensors("k", {}, good)
    bad_header = msgpack.unpackb(header, raw=False)
    bad_header["specs"][0]["dtype"] = "float64"  # mislabelled: 16 bytes cannot be float64[4]
    cases = [
        ([b"\x93not-a-header"], "not valid msgpack"),
        ([header], "header lists 1 tensors, got 0 frames"),  # truncated: the raw frame is missing
        ([header, bytes(frame)[:10]], "payload has 10"),  # truncated frame
        ([msgpack.packb(bad_header), bytes(frame)], "float64"),
        ([msgpack.packb({**bad_header, "v": PROTOCOL_VERSION + 1}), bytes(frame)], "protocol version"),
    ]
    for frames, match in cases:
        raw.send_multipart(frames)
        with pytest.raises(ProtocolError, match=match):
            rx.recv(timeout_s=10)
        tx.send("after", good)
        key, _, got = rx.recv(timeout_s=10)
        assert key == "after" and torch.equal(got["x"], good["x"])
    raw.close()


def test_recv_times_out(pair):
    _, rx = pair
    with pytest.raises(TimeoutError, match="no tensor message"):
        rx.recv(timeout_s=0.05)


def test_weights_fetched_by_two_receivers_and_checked():
    pub = make_weight_channel("zmq", role="publisher", bucket_mb=0.0001, expect_receivers=2)
    rxs = [make_weight_channel("zmq", role="receiver", timeout_s=10) for _ in range(2)]
    sd = {k: v.contiguous() for k, v in sample_tensors().items()}
    m = pub.publish_begin(4, sd)
    assert len(m["bucket_bytes"]) > 4  # more buckets than the request window
    for rx in rxs:
        assert_bit_exact(rx.receive(m), sd)
    pub.publish_end()  # both receivers fetched everything: returns at once
    m["checksum"]["values"][1] ^= 1
    with pytest.raises(TransportError, match="bucket 1 .* sum64"):
        rxs[0].receive(m)
    pub.release(4)
    with pytest.raises(TransportError, match="version 4 bucket 0 is not published"):
        rxs[0].receive(m)
    pub.close()


def test_closing_a_receiver_cancels_a_fetch_from_a_silent_publisher():
    """A publisher that went away mid-fetch (here: a socket that never answers) must not hold a
    closing worker for the whole timeout: close() makes the waiting receive() raise at once."""
    import threading
    import time

    pub = make_weight_channel("zmq", role="publisher", bucket_mb=0.0001)
    m = pub.publish_begin(1, {"w": torch.ones(8)})
    pub.close()
    silent = make_socket(zmq.Context.instance(), zmq.ROUTER, bind="tcp://127.0.0.1:*")
    m["handle"]["endpoint"] = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    rx = make_weight_channel("zmq", role="receiver", timeout_s=60)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(TransportError, rx.receive, m)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    rx.close()
    t.join(timeout=5)
    assert not t.is_alive() and time.monotonic() - t0 < 2
    assert "cancelled: the channel was closed" in str(errors[0].value)
    silent.close(0)
