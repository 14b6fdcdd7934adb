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
from tests.support.transport_helpers import assert_bit_exact, sample_tensors


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


BOUND = 4096  # the receiver's tensor_channel.max_message_mb, in bytes, for the tests below


@pytest.fixture
def bounded(monkeypatch):
    """A receiver bounded to BOUND bytes per message, a sender, a raw PUSH, and the count of tensor
    allocations the receiver made (every decoded tensor's memory comes from protocols.tensors._copy)."""
    import protocols.tensors as T

    copies = []
    real = T._copy
    monkeypatch.setattr(T, "_copy", lambda buf, dtype, shape: copies.append(len(buf)) or real(buf, dtype, shape))
    rx = make_tensor_channel("zmq", role="receiver", endpoint="tcp://127.0.0.1:*", max_message_bytes=BOUND)
    tx = make_tensor_channel("zmq", role="sender", endpoint=rx.endpoint)
    raw = make_socket(zmq.Context.instance(), zmq.PUSH, connect=rx.endpoint)
    yield tx, rx, raw, copies
    raw.close()
    tx.close()
    rx.close()


def _serves(tx, rx, copies) -> None:
    """The receiver is still up: a good message sent after the bad one arrives intact."""
    good = {"a": torch.arange(6, dtype=torch.int64), "b": torch.ones(3, dtype=torch.float32)}
    copies.clear()
    tx.send("after", good)
    key, _, got = rx.recv(timeout_s=30)
    assert key == "after" and torch.equal(got["a"], good["a"]) and torch.equal(got["b"], good["b"])
    assert copies == [48, 12]


def test_frames_larger_or_smaller_than_declared_are_refused_before_any_tensor_is_allocated(bounded):
    tx, rx, raw, copies = bounded
    # header: a int64[6] (48 bytes) then b float32[3] (12 bytes); a matches, b does not
    header, a, b = encode_tensors("k", {}, {"a": torch.arange(6), "b": torch.ones(3)})
    for frame_b, have in [(bytes(b) + b"\0" * 4, 16), (bytes(b)[:8], 8), (b"", 0)]:
        copies.clear()
        raw.send_multipart([header, bytes(a), frame_b])
        with pytest.raises(
            ProtocolError, match=f"tensor 'b': float32\\[3\\] needs 12 bytes; header says 12, payload has {have}"
        ):
            rx.recv(timeout_s=30)
        assert copies == []  # not even 'a', which matched, was allocated
        _serves(tx, rx, copies)


def test_a_header_declaring_more_than_the_bound_is_refused(bounded):
    tx, rx, raw, copies = bounded
    # two int32[600] tensors: 2400 bytes each, so every frame is under the socket bound of 4096 but the
    # declared total (4800) is over it
    tensors = {"a": torch.zeros(600, dtype=torch.int32), "b": torch.zeros(600, dtype=torch.int32)}
    raw.send_multipart(encode_tensors("big", {}, tensors))
    with pytest.raises(ProtocolError, match="'big': header declares 4800 bytes, more than the bound 4096"):
        rx.recv(timeout_s=30)
    assert copies == []
    _serves(tx, rx, copies)
    # a header that lies about a huge tensor (1 TiB declared, nothing sent) is refused the same way
    header = encode_tensors("lie", {}, {"x": torch.zeros(1, dtype=torch.uint8)})[0]
    fields = msgpack.unpackb(header, raw=False)
    fields["specs"][0].update(shape=[1 << 40], nbytes=1 << 40)
    raw.send_multipart([msgpack.packb(fields), b"\0"])
    with pytest.raises(ProtocolError, match=f"header declares {1 << 40} bytes, more than the bound 4096"):
        rx.recv(timeout_s=30)
    _serves(tx, rx, copies)


def test_a_frame_over_the_bound_is_dropped_at_the_socket(bounded):
    tx, rx, raw, copies = bounded
    raw.send_multipart(encode_tensors("huge", {}, {"x": torch.zeros(BOUND + 1, dtype=torch.uint8)}))
    _serves(tx, rx, copies)  # libzmq dropped raw's connection at the frame; the receiver never saw it
    with pytest.raises(TimeoutError):
        rx.recv(timeout_s=1.0)
    # a message exactly at the bound passes the socket (and decodes)
    raw.send_multipart(encode_tensors("edge", {}, {"x": torch.zeros(BOUND, dtype=torch.uint8)}))
    key, _, got = rx.recv(timeout_s=30)
    assert key == "edge" and got["x"].numel() == BOUND
    assert rx._pipe.sock.getsockopt(zmq.MAXMSGSIZE) == BOUND


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


def test_a_fetcher_gone_before_its_replies_leaves_the_server_serving():
    """A receiver that gives up (timeout, refused bucket, closed channel) closes its socket with
    requests still queued at the publisher; the replies to that gone peer are dropped and the
    server keeps serving the next fetcher (CI once saw it die on EHOSTUNREACH and hang a fleet)."""
    import time

    pub = make_weight_channel("zmq", role="publisher", bucket_mb=0.0001)
    sd = {k: v.contiguous() for k, v in sample_tensors().items()}
    m = pub.publish_begin(1, sd)
    gone = make_weight_channel("zmq", role="receiver", timeout_s=0.3)
    with pub._server._lock:  # the server thread blocks on its first reply until the fetcher is gone
        with pytest.raises(TransportError, match="bucket 0 did not arrive within 0.3s"):
            gone.receive(m)
        gone.close()
        time.sleep(0.5)  # the publisher's socket learns of the disconnect meanwhile
    rx = make_weight_channel("zmq", role="receiver", timeout_s=10)
    assert_bit_exact(rx.receive(m), sd)
    rx.close()
    pub.close()
