"""The rendezvous store of the gloo/NCCL groups (``transport/store.py``), over real sockets: it answers
as torch's own in-memory store does, listens only where it was told (the kernel's view, /proc), and
a peer without the run's CURVE keys never gets a key in or out; a gloo group forms through it."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import zmq

from protocols.curve import CurveKeys, current_keys, use_curve
from protocols.messages import encode
from protocols.side import StoreRequest
from protocols.sockets import free_tcp_port

from areal_async.base.runkeys import install_run_keys, write_run_keys
from areal_async.transport.collective import GlooGroup
from areal_async.transport.store import StoreServer, ZmqStore, gloo_host, store_endpoint
from tests.support.procs import listeners


@pytest.fixture
def keyed(tmp_path):
    write_run_keys(tmp_path, {"trainer": "trainer"})
    install_run_keys(tmp_path)
    yield tmp_path
    use_curve(None)


@pytest.fixture
def served(keyed):
    server = StoreServer(f"tcp://127.0.0.1:{free_tcp_port()}")
    yield server
    server.close()


def test_answers_as_torchs_own_store(served):
    """The same calls on torch's HashStore (the reference) and on ours give the same answers."""
    ours, ref = ZmqStore(served.endpoint, timeout_s=2.0), dist.HashStore()
    try:
        for s in (ours, ref):
            s.set("a", "1")
            s.set("b", b"\x00\xff")
        assert ours.get("a") == ref.get("a") == b"1" and ours.get("b") == ref.get("b") == b"\x00\xff"
        assert [ours.add("n", 3), ours.add("n", -1)] == [ref.add("n", 3), ref.add("n", -1)] == [3, 2]
        assert ours.check(["a", "n"]) == ref.check(["a", "n"]) is True
        assert ours.check(["a", "zz"]) == ref.check(["a", "zz"]) is False
        for expected, desired in [("1", "2"), ("1", "3"), ("", "x")]:  # match, mismatch, missing key
            assert ours.compare_set("a", expected, desired) == ref.compare_set("a", expected, desired)
        assert ours.compare_set("new", "", "v") == ref.compare_set("new", "", "v") == b"v"
        assert ours.compare_set("none", "e", "v") == ref.compare_set("none", "e", "v") == b"e"
        assert ours.num_keys() == ref.num_keys() == 4
        assert ours.delete_key("a") == ref.delete_key("a") is True
        assert ours.delete_key("a") == ref.delete_key("a") is False
        with pytest.raises(dist.DistStoreError, match="timed out waiting for keys"):
            ours.wait(["never"], datetime.timedelta(seconds=0.3))
        assert ours.get("n") == b"2"  # the connection still lines up after a timed-out wait
    finally:
        ours.close()


def test_a_wait_is_answered_when_another_member_sets_the_key(served):
    import threading

    a, b = ZmqStore(served.endpoint, timeout_s=5.0), ZmqStore(served.endpoint, timeout_s=5.0)
    got = []
    t = threading.Thread(target=lambda: got.append(a.get("late")))
    t.start()
    b.set("late", b"here")
    t.join(timeout=5)
    assert got == [b"here"]
    a.close(), b.close()


def test_listens_only_on_the_address_it_was_given(served):
    """The kernel's view: the store's port is bound on 127.0.0.1 only (torch's TCPStore: on '*')."""
    port = int(served.endpoint.rsplit(":", 1)[1])
    mine = [s for s in listeners(os.getpid()) if s[1] == port]
    assert mine == [("127.0.0.1", port)]
    with pytest.raises(ValueError, match="no wildcard"):
        store_endpoint(f"0.0.0.0:{port}")
    assert store_endpoint(f"127.0.0.1:{port}") == f"tcp://127.0.0.1:{port}"


def _stranger(keys: CurveKeys | None) -> CurveKeys | None:
    """Keys of a peer that knows the server's public key but holds a client key of its own (or no keys)."""
    if keys is None:
        return None
    public, secret = zmq.curve_keypair()
    return CurveKeys(server_public=keys.server_public, client_public=public, client_secret=secret)


@pytest.mark.parametrize("how", ["own key", "no CURVE"])
def test_a_peer_without_the_runs_keys_gets_nothing_in_or_out(served, how):
    run_keys = current_keys()
    member = ZmqStore(served.endpoint, timeout_s=2.0)
    member.set("areal/weights/0/addr", b"secret")
    use_curve(_stranger(run_keys) if how == "own key" else None)
    try:
        stranger = ZmqStore(served.endpoint, timeout_s=0.2, grace_s=0.3)
    finally:
        use_curve(run_keys)
    try:
        for call in (lambda: stranger.get("areal/weights/0/addr"), lambda: stranger.set("areal/weights/0/addr", "x")):
            with pytest.raises(dist.DistStoreError, match="no answer"):
                call()
        with pytest.raises(dist.DistStoreError, match="no answer"):
            stranger.add("areal/weights/0/count", 1)
    finally:
        stranger.close()
    assert member.get("areal/weights/0/addr") == b"secret" and member.num_keys() == 1  # nothing changed
    member.close()


def test_a_bad_request_is_answered_with_an_error_and_the_server_keeps_serving(served):
    ctx = zmq.Context()
    from protocols.sockets import make_socket

    sock = make_socket(ctx, zmq.DEALER, connect=served.endpoint)
    try:
        sock.send(b"\x93not msgpack of a store request")
        assert sock.poll(3000)
        assert b"bad store request" in sock.recv()
        sock.send(encode(StoreRequest(id=7, op="num_keys", keys=[])))
        assert sock.poll(3000) and b"store_reply" in sock.recv()
    finally:
        sock.close(0)
        ctx.term()
    with pytest.raises(Exception, match="op 'drop_all'"):
        encode(StoreRequest(id=1, op="drop_all", keys=["a"]))


def test_gloo_pairs_bind_loopback_for_a_group_on_one_host():
    assert gloo_host("ipc:///tmp/x/traj_store", None) == "127.0.0.1"
    assert gloo_host("tcp://127.0.0.1:5", None) == "127.0.0.1"
    assert gloo_host("tcp://10.0.0.3:5", "10.0.0.4") == "10.0.0.4"  # a placed worker: its node's address
    assert gloo_host("tcp://10.0.0.3:5", None) is None  # gloo's default: the host name's address


def test_a_gloo_group_forms_through_the_keyed_store(keyed):
    """Two ranks (threads here; processes in a run) meet through the store over CURVE; the broadcast
    carries rank 0's tensor; nothing of this process listens beyond loopback (gloo's pairs included)."""
    import threading

    bufs, errors, endpoint = {}, [], f"tcp://127.0.0.1:{free_tcp_port()}"

    def member(rank: int) -> None:
        try:
            g = GlooGroup(rank=rank, world_size=2, store=endpoint, name="t", timeout_s=30)
            bufs[rank] = torch.full((4,), float(rank + 1))
            g.wait(g.broadcast(bufs[rank], 0))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and bufs[1].tolist() == [1.0] * 4
    assert [s for s in listeners(os.getpid()) if s[0] != "127.0.0.1"] == []
