"""gloo channels (the CPU twin of NCCL) with real processes: rank 0 here, ranks 1 and 2 spawned.

One group, one scenario, to spend the process start-up (~3 s of CPU each) only once:
rollout ranks send the tensor zoo, then a mislabelled and a garbage note, then a good message;
the trainer publishes two weight versions by pipelined bucket broadcast (and one serial), and
both receivers must report the sender's state checksum for each.
"""

from __future__ import annotations

import threading

import msgpack
import pytest
import torch
import zmq

from areal_async.transport import ProtocolError, make_tensor_channel, make_weight_channel
from areal_async.transport.buckets import state_checksum
from areal_async.transport.frames import header_bytes
from protocols.messages import encode
from protocols.side import GroupTensors
from protocols.sockets import free_tcp_port, make_socket
from tests.support.transport_helpers import Peer, ask, assert_bit_exact, reply, sample_tensors

WORLD = 3


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    sd = {k: v.contiguous() for k, v in sample_tensors(version).items()}
    sd["layer.weight"] = torch.randn(200, 96, generator=g).to(torch.bfloat16)
    sd["layer.bias"] = torch.randn(96, generator=g)
    return sd


def _rollout_rank(conn, rank: int, cfg: dict) -> None:
    torch.set_num_threads(1)
    tx = make_tensor_channel(
        "gloo", role="sender", endpoint=cfg["endpoint"], rank=rank, world_size=WORLD, store=cfg["traj_store"]
    )
    wx = make_weight_channel("gloo", role="receiver", rank=rank, world_size=WORLD, store=cfg["weight_store"])
    reply(conn, {"ready": rank})
    tx.send(f"zoo-{rank}", sample_tensors(rank), {"rank": rank})
    ask(conn)  # wait for our turn: the bad notes of two ranks must not interleave
    _send_mislabelled(tx, rank)
    tx._pipe.sock.send(b"\x01 not msgpack")  # garbage note: nothing follows it
    tx.send(f"after-{rank}", {"v": torch.tensor([rank])})
    for _ in range(3):
        sd = wx.receive(ask(conn)["manifest"])
        reply(conn, {"crc": state_checksum(sd)})
    tx.close()
    wx.close()


def _send_mislabelled(tx, rank: int) -> None:
    """A note whose header says float64[4] (32 bytes) while 16 bytes of payload follow."""
    header = header_bytes("bad", {}, {"x": torch.zeros(4, dtype=torch.float64)})
    tx._pipe.send_note(GroupTensors(src=rank, sizes=[16], header=header))
    tx.group.wait(tx.group.send([torch.zeros(16, dtype=torch.uint8)], 0))


@pytest.mark.timeout(90)
def test_gloo_trajectories_and_weight_broadcast_to_two_receivers():
    cfg = {
        "endpoint": f"tcp://127.0.0.1:{free_tcp_port()}",
        "traj_store": f"127.0.0.1:{free_tcp_port()}",
        "weight_store": f"127.0.0.1:{free_tcp_port()}",
    }
    peers = [Peer(_rollout_rank, r, cfg) for r in (1, 2)]
    rx = make_tensor_channel(
        "gloo", role="receiver", endpoint=cfg["endpoint"], rank=0, world_size=WORLD, store=cfg["traj_store"]
    )
    pub = make_weight_channel(
        "gloo", role="publisher", rank=0, world_size=WORLD, store=cfg["weight_store"], bucket_mb=1 / 64
    )
    try:
        assert sorted(p.recv()["ready"] for p in peers) == [1, 2]
        _check_trajectories(rx, peers)
        _check_weights(pub, peers)
        for p in peers:
            p.join()
    finally:
        rx.close()
        pub.close()


def _check_trajectories(rx, peers) -> None:
    seen = {}
    for _ in range(2):
        key, meta, got = rx.recv(timeout_s=30)
        assert_bit_exact(got, sample_tensors(meta["rank"]))
        seen[key] = meta["rank"]
    assert seen == {"zoo-1": 1, "zoo-2": 2}
    for rank, p in zip((1, 2), peers):
        p.send({"go": True})
        with pytest.raises(ProtocolError, match="float64.*needs 32 bytes.*payload has 16"):
            rx.recv(timeout_s=30)
        with pytest.raises(ProtocolError, match="not valid msgpack"):
            rx.recv(timeout_s=30)
        key, _, got = rx.recv(timeout_s=30)  # still in step with the sender
        assert key == f"after-{rank}" and got["v"].tolist() == [rank]


def _check_weights(pub, peers) -> None:
    for version, pipeline in ((1, True), (2, True), (3, False)):
        sd = _weights(version)
        pub.pipeline = pipeline
        manifest = pub.publish_begin(version, sd)
        assert len(manifest["bucket_bytes"]) > 2 and manifest["checksum"]["values"] is None  # in band
        msgpack.packb(manifest)  # plain data, ready for a WeightsPublished message
        for p in peers:
            p.send({"manifest": manifest})
        pub.publish_end()
        assert [p.recv()["crc"] for p in peers] == [state_checksum(sd)] * 2


@pytest.mark.timeout(120)
def test_a_gloo_note_over_the_bound_is_refused_before_allocating(monkeypatch):
    """Two ranks of a real gloo group (threads of this process): a note announcing more than the
    receiver's max_message_bytes is refused without allocating its buffer; the next message arrives."""
    cfg = {"endpoint": f"tcp://127.0.0.1:{free_tcp_port()}", "store": f"127.0.0.1:{free_tcp_port()}"}
    made = {}

    def rank(r: int) -> None:
        role = "receiver" if r == 0 else "sender"
        kw = {"max_message_bytes": 1024} if r == 0 else {}
        made[r] = make_tensor_channel(
            "gloo", role=role, endpoint=cfg["endpoint"], rank=r, world_size=2, store=cfg["store"], **kw
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    rx, tx = made[0], made[1]
    allocs = []
    real_alloc = rx.group.alloc
    monkeypatch.setattr(rx.group, "alloc", lambda n: allocs.append(n) or real_alloc(n))
    raw = make_socket(zmq.Context.instance(), zmq.PUSH, connect=rx.endpoint)
    try:
        header = header_bytes("big", {}, {"x": torch.zeros(2048, dtype=torch.uint8)})
        raw.send(encode(GroupTensors(src=1, sizes=[2048], header=header)))
        with pytest.raises(ProtocolError, match="announces 2048 bytes, more than the bound 1024"):
            rx.recv(timeout_s=30)
        assert allocs == []
        sender = threading.Thread(target=tx.send, args=("after", {"v": torch.arange(5)}))
        sender.start()
        key, _, got = rx.recv(timeout_s=30)
        sender.join(timeout=30)
        assert key == "after" and torch.equal(got["v"], torch.arange(5)) and allocs == [64]  # 40 bytes, aligned
    finally:
        raw.close()
        tx.close()
        rx.close()
