"""benchmarks/common/peers.py and channels.py with a real spawned peer and a real zmq channel pair."""

import time

import pytest
import torch

from benchmarks.common.channels import CHANNEL_OPS, endpoints, open_pair, time_each, time_stream, unavailable
from benchmarks.common.payloads import boba_batch, nbytes, pack_batch
from benchmarks.common.peers import Peer, reply
from benchmarks.common.timing import Copier, stats


def _count(state: dict, cmd: dict) -> dict:
    for i in range(cmd["n"]):  # extra replies before the last one, as the channel ops' acks
        reply(state, {"i": i})
    return {"total": cmd["n"] * 10, "device": state["device"]}


def _boom(state: dict, cmd: dict) -> dict:
    raise ValueError(f"bad size {cmd['size']}")


def _hang(state: dict, cmd: dict) -> dict:
    time.sleep(600)
    return {}


OPS = {"count": _count, "boom": _boom, "hang": _hang}


def test_peer_serves_ops_reports_errors_and_is_killed_when_stuck():
    with Peer("cpu", OPS) as peer:
        peer.ask("count", n=2)
        assert [peer.answer()["i"] for _ in range(2)] == [0, 1]
        assert peer.answer() == {"total": 20, "device": "cpu"}
        with pytest.raises(RuntimeError, match="ValueError: bad size 7"):
            peer.call("boom", size=7)
        with pytest.raises(RuntimeError, match="unknown peer op 'nope'"):
            peer.call("nope")
        assert peer.call("count", n=0)["total"] == 0  # still serving after the errors
        peer.ask("hang")
        t0 = time.monotonic()
        peer.close(timeout_s=1)
        assert time.monotonic() - t0 < 10
        assert not peer.proc.is_alive()


def test_zmq_channel_pair_times_messages_next_to_the_bound():
    assert unavailable("zmq", "cpu") is None
    assert unavailable("nccl", "cpu") == "nccl needs --device cuda"
    with Peer("cpu", CHANNEL_OPS) as peer:
        theirs, mine = endpoints("zmq")
        ch = open_pair(peer, "zmq", "traj", mine, theirs)
        try:
            x = torch.ones(4096 // 4)
            lat, b = time_each(peer, ch, {"x": x}, 3, Copier(4096, "cpu"))
            # 3 timed messages, the bound taken before each: ceil(5 / 3) = 2 samples each, 6 in all
            assert len(lat) == 3 and len(b.copy_s) == len(b.memmove_s) == 6
            assert all(0 < s < 10 for s in lat + b.copy_s + b.memmove_s)
            seqs = boba_batch(1, 3, max_len=50)
            lat, b = time_stream(peer, ch, seqs, 2, Copier(nbytes(pack_batch(seqs)), "cpu"))
            assert len(lat) == 2 and all(0 < s < 10 for s in lat) and len(b.fastest_s()) == 6
        finally:
            ch.close()
            peer.call("close", what="traj")


def test_stats_and_the_copy_bound():
    assert stats([3.0, 1.0, 2.0]) == {"p50_s": 2.0, "p99_s": pytest.approx(2.98)}
    with pytest.raises(ValueError, match="no samples"):
        stats([])
    c = Copier(1 << 20, "cpu")
    assert c.dst.numel() * 4 == 1 << 20 and bool((c.dst == 1).all())
    assert c.gbps([0.001, 0.002, 0.003]) == pytest.approx((1 << 20) / 0.002 / 1e9)
