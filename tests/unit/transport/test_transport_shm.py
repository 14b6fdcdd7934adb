"""Shared-memory channels: zero-copy views, slab reuse, bad notes, weights, no leaks (between two processes:
tests/contract/test_transport_spawned_peers.py)."""

from __future__ import annotations

import gc

import msgpack
import pytest
import torch
import zmq

from areal_async.transport import ManifestError, ProtocolError, TransportError, make_tensor_channel, make_weight_channel
from areal_async.transport.frames import header_bytes
from areal_async.transport.shm import CTRL, SHM_DIR
from areal_async.transport.shm_weights import data_start
from protocols.messages import PROTOCOL_VERSION
from protocols.sockets import make_socket
from tests.support.transport_helpers import assert_bit_exact, no_shm_leaks, sample_tensors  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("no_shm_leaks"),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
]


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    sd = {k: v.contiguous() for k, v in sample_tensors(seed).items()}
    sd["w"] = torch.randn(300, 70).to(torch.bfloat16)  # spans several 16 KiB buckets
    return sd


@pytest.fixture
def pair():
    rx = make_tensor_channel("shm", role="receiver", endpoint="tcp://127.0.0.1:*")
    tx = make_tensor_channel("shm", role="sender", endpoint=rx.endpoint)
    yield tx, rx
    gc.collect()
    tx.close()
    rx.close()


def test_views_share_the_slab_and_slabs_are_reused_once_dropped(pair):
    tx, rx = pair
    x = {"x": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    tx.send("a", x)
    _, _, held = rx.recv(timeout_s=5)
    slab = tx._pool.slabs[0]
    held["x"][0] = 42.0  # the receiver's tensor *is* the shared slab: the sender's mapping sees it
    assert torch.from_numpy(slab.seg.array(CTRL))[:4].view(torch.float32).item() == 42.0
    tx.send("b", x)  # slab 0 is still held -> a second slab
    _, _, other = rx.recv(timeout_s=5)
    assert len(tx._pool.slabs) == 2 and not slab.is_free()
    del held, other
    gc.collect()
    assert all(s.is_free() for s in tx._pool.slabs)
    for i in range(3):
        tx.send(f"c{i}", x)
        _, _, got = rx.recv(timeout_s=5)
        assert torch.equal(got["x"], x["x"])
        del got
    assert len(tx._pool.slabs) == 2  # reused, not grown


def test_batches_of_held_messages_reuse_the_pool_and_never_share_a_held_slab(pair):
    """As a trainer does: a batch of messages held until all arrived, then dropped; the next batch
    (other sizes, other order) reuses the freed slabs and never one that is still held."""
    tx, rx = pair
    kib = [2500, 300, 1200, 40, 2500, 700, 1900, 300]
    for batch, order in enumerate((kib, kib[::-1], sorted(kib))):
        sent = {f"m{i}": torch.full((n * 256,), batch * 100 + i, dtype=torch.int32) for i, n in enumerate(order)}
        held = {}
        for key, x in sent.items():
            tx.send(key, {"x": x, "n": torch.tensor([x.numel()])})
            got_key, _, got = rx.recv(timeout_s=5)
            held[got_key] = got
        assert list(held) == list(sent)
        for key, x in sent.items():  # each held message still reads as sent: no slab was lent twice
            assert torch.equal(held[key]["x"], x) and held[key]["n"].item() == x.numel()
        assert len({h["x"].data_ptr() for h in held.values()}) == len(sent)
        if batch == 0:
            pooled = [s.seg.name for s in tx._pool.slabs]
        assert [s.seg.name for s in tx._pool.slabs] == pooled  # later batches made no slab
        del held, got
        gc.collect()
        assert all(s.is_free() for s in tx._pool.slabs)


def test_slabs_freed_out_of_order_are_found_while_the_oldest_is_held(pair):
    tx, rx = pair
    x = {"x": torch.arange(300_000, dtype=torch.int32)}
    held = []
    for i in range(9):
        tx.send(f"a{i}", x)
        held.append(rx.recv(timeout_s=5)[2])
    made = len(tx._pool.slabs)
    del held[1:]  # the oldest message stays held, every later one is dropped
    gc.collect()
    counts = []
    for i in range(20):
        tx.send(f"b{i}", x)
        _, _, got = rx.recv(timeout_s=5)
        assert torch.equal(got["x"], x["x"]) and torch.equal(held[0]["x"], x["x"])
        del got
        gc.collect()
        counts.append(len(tx._pool.slabs))
    # lent slabs are polled in full once 1/SCAN_EVERY of them are new: at most that many are made meanwhile,
    # then the freed eight serve every message (the held one is never lent again: its data stayed intact above)
    assert made == 9 and counts[-1] <= made + 1 + made // tx._pool.SCAN_EVERY and counts[2:] == [counts[-1]] * 18


def pack_note(kind: str, body: dict) -> bytes:
    """A note as the untyped code built it (hand-made here, so it can be wrong)."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": kind, **body}, use_bin_type=True)


def test_bad_notes_raise_and_the_receiver_keeps_serving(pair):
    tx, rx = pair
    good = {"x": torch.arange(6, dtype=torch.int64)}
    tx.send("seed", good)  # make a slab we can point bad notes at
    _, _, got = rx.recv(timeout_s=5)
    del got
    gc.collect()
    slab = tx._pool.slabs[0]
    raw = make_socket(zmq.Context.instance(), zmq.PUSH, connect=rx.endpoint)
    mislabelled = header_bytes("bad", {}, {"x": torch.zeros(6, dtype=torch.float16)})  # 12 bytes, payload has 48
    note = {"seg": slab.seg.name, "size": slab.seg.size, "pooled": True, "offsets": [0], "sizes": [48]}
    cases = [
        (b"\x00garbage", ProtocolError, "not valid msgpack"),
        (pack_note("shm_tensors", {**note, "header": mislabelled}), ProtocolError, "needs 12 bytes"),
        (
            pack_note("shm_tensors", {**note, "size": slab.seg.size + 4096, "header": mislabelled}),
            ProtocolError,
            "was mapped with",
        ),
        (
            pack_note("shm_tensors", {**note, "seg": "areal_missing_0", "header": mislabelled}),
            TransportError,
            "does not exist",
        ),
        (
            pack_note("shm_tensors", {**note, "seg": "../etc/passwd", "header": mislabelled}),
            TransportError,
            "segment name",
        ),
        (pack_note("shm_tensors", {**note, "sizes": [48, 8], "header": mislabelled}), ProtocolError, "payload has 2"),
        (pack_note("shm_tensors", {"seg": slab.seg.name}), ProtocolError, "shm_tensors: missing field 'size'"),
        (
            pack_note("shm_tensors", {**note, "header": mislabelled, "ttl": 5}),
            ProtocolError,
            "shm_tensors: unknown field 'ttl'",
        ),
        (
            pack_note("shm_tensors", {**note, "pooled": "yes", "header": mislabelled}),
            ProtocolError,
            "shm_tensors.pooled: expected bool, got str",
        ),
        (pack_note("shm_retire", {"segs": [slab.seg.name, 7]}), ProtocolError, "shm_retire.segs: expected list"),
    ]
    for raw_note, exc, match in cases:
        slab.ctrl[0] = 1  # as if the sender had just filled it
        raw.send(raw_note)
        with pytest.raises(exc, match=match):
            rx.recv(timeout_s=5)
        tx.send("after", good)
        key, _, got = rx.recv(timeout_s=5)
        assert key == "after" and torch.equal(got["x"], good["x"])
        del got
    raw.close()


def test_pool_cap_falls_back_to_one_shot_slabs():
    rx = make_tensor_channel("shm", role="receiver", endpoint="tcp://127.0.0.1:*")
    tx = make_tensor_channel("shm", role="sender", endpoint=rx.endpoint, pool_mb=1)
    x = {"x": torch.randn(1 << 19)}  # 2 MiB > the 1 MiB pool
    kept = []
    for i in range(3):
        tx.send(f"m{i}", x)
        kept.append(rx.recv(timeout_s=5)[2])
    assert tx._pool.slabs == [] and all(torch.equal(k["x"], x["x"]) for k in kept)
    tx.close()
    rx.close()


def test_weights_checksum_truncation_release_and_private_writes():
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    sub = make_weight_channel("shm", role="receiver")
    sd = _weights()
    m = pub.publish_begin(7, sd)
    got = sub.receive(m)
    assert_bit_exact(got, sd)
    got["w"].zero_()  # copy-on-write: our write never reaches the publisher or other receivers
    assert_bit_exact(make_weight_channel("shm", role="receiver").receive(m), sd)
    del got
    assert_bit_exact(sub.receive(m), sd)  # the kept mapping holds our write: read again through a fresh one
    with open(SHM_DIR / m["handle"]["segment"], "r+b") as f:  # corrupt one byte of bucket 0
        f.seek(data_start(len(m["bucket_bytes"])) + m["tensors"][0]["offset"])
        f.write(b"\x7f")
    with pytest.raises(TransportError, match="bucket 0 .* sum64 .* corrupt"):
        sub.receive(m)
    with pytest.raises(ManifestError, match="expected .*'size': at least"):
        sub.receive({**m, "handle": {**m["handle"], "size": data_start(len(m["bucket_bytes"]))}})
    with pytest.raises(TransportError, match="truncated or mislabelled"):
        sub.receive({**m, "handle": {**m["handle"], "size": m["handle"]["size"] + 64}})
    with pytest.raises(ManifestError, match="is for channel 'shm', this receiver is 'zmq'"):
        make_weight_channel("zmq", role="receiver").receive(m)
    pub.release(7)
    with pytest.raises(TransportError, match="holds no version: v7 was released or superseded"):
        sub.receive(m)
    pub.close()
    with pytest.raises(TransportError, match="does not exist"):
        sub.receive(m)


def test_weight_segments_are_reused_but_never_under_a_reader():
    """A version's segment is rewritten only once it is released and no receiver holds its tensors."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    sub = make_weight_channel("shm", role="receiver")
    sds = [_weights(seed) for seed in range(4)]
    m0 = pub.publish_begin(0, sds[0])
    held = sub.receive(m0)
    pub.release(0)
    m1 = pub.publish_begin(1, sds[1])  # v0's tensors are alive: its segment is not touched
    assert m1["handle"]["segment"] != m0["handle"]["segment"]
    assert_bit_exact(held, sds[0])
    assert_bit_exact(sub.receive(m1), sds[1])  # dropped at once
    del held
    gc.collect()
    pub.release(1)
    m2 = pub.publish_begin(2, sds[2])  # both free now: one of the two is reused, no third one made
    assert m2["handle"]["segment"] in (m0["handle"]["segment"], m1["handle"]["segment"])
    assert len(list(SHM_DIR.glob(pub._prefix + "_*"))) == 2
    assert_bit_exact(sub.receive(m2), sds[2])
    stale = m0 if m2["handle"]["segment"] == m0["handle"]["segment"] else m1
    with pytest.raises(TransportError, match=f"now holds version 2: v{stale['version']} was released or superseded"):
        sub.receive(stale)  # a late reader of the old version is refused, never served v2's bytes
    assert set(sub._maps) == {m0["handle"]["segment"], m1["handle"]["segment"]}
    pub.close()  # unlinks both: the receiver forgets its mappings of them at its next receive
    pub2 = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    assert_bit_exact(sub.receive(pub2.publish_begin(3, sds[3])), sds[3])
    assert list(sub._maps) == [SHM_DIR.joinpath(pub2._prefix + "_w0").name]
    pub2.close()


def test_publisher_close_unlinks_every_version():
    pub = make_weight_channel("shm", role="publisher")
    for v in range(3):
        pub.publish_begin(v, {"a": torch.ones(10)})
    assert len([p for p in SHM_DIR.glob(pub._prefix + "_*")]) == 3
    pub.close()
    assert not list(SHM_DIR.glob(pub._prefix + "_*"))


def test_manifest_travels_in_a_weights_published_message():
    from protocols.messages import WeightsPublished, decode, encode

    pub = make_weight_channel("shm", role="publisher")
    sd = _weights(1)
    msg = decode(encode(WeightsPublished(version=3, manifest=pub.publish_begin(3, sd))))
    assert_bit_exact(make_weight_channel("shm", role="receiver").receive(msg.manifest), sd)
    pub.close()
