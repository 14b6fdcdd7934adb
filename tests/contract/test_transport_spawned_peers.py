"""Tensor channels with a spawned peer that imports torch (each start ~2 s of CPU, so not in the unit tier):
shm trajectories and weights between two processes, a weight publisher killed in the middle of a version,
and the SGLang weight group's rendezvous with a second rank. Their in-process twins are
tests/unit/transport/test_transport_shm.py, test_shm_weights_overlap.py and test_transport_store.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from areal_async.rollout.clients.weight_group import destroy_group, init_custom_group
from areal_async.transport import TransportError, make_tensor_channel, make_weight_channel
from areal_async.transport import shm_weights as W
from areal_async.transport.buckets import state_checksum
from areal_async.transport.shm import SHM_DIR
from protocols.sockets import free_tcp_port
from tests.support.fleet import ROOT
from tests.support.procs import listeners
from tests.support.transport_helpers import Peer, ask, assert_bit_exact, no_shm_leaks, reply, sample_tensors  # noqa: F401


def _peer(conn) -> None:
    """Rollout side: send three samples over shm, then receive one weight version."""
    torch.set_num_threads(1)
    tx = make_tensor_channel("shm", role="sender", endpoint=ask(conn)["endpoint"])
    for seed in range(3):
        tx.send(f"traj-{seed}", sample_tensors(seed), {"seed": seed})
    rx = make_weight_channel("shm", role="receiver")
    sd = rx.receive(ask(conn)["manifest"])
    reply(conn, {"crc": state_checksum(sd), "names": list(sd)})
    del sd
    tx.close()
    reply(conn, {"bye": True})


class _Stuck(dict):
    """A state dict whose tensor "b" never comes (a trainer rank that hangs in its gather)."""

    def __getitem__(self, key):
        if key == "b":
            threading.Event().wait()
        return super().__getitem__(key)


def _stuck_publisher(conn) -> None:
    """Publish a version whose second bucket is never written; wait to be killed."""
    torch.set_num_threads(1)
    W.INLINE_BYTES = 0  # the packer thread, as for any real model
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    sd = {n: torch.full((4096,), float(i)) for i, n in enumerate("abc")}  # 16 KiB each: one bucket each
    reply(conn, {"manifest": pub.publish_begin(5, _Stuck(sd))})
    threading.Event().wait()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")
def test_a_killed_weight_publisher_is_noticed_by_its_free_lock(monkeypatch):
    """Alive, the publisher holds the segment's exclusive lock: a receiver waits for bucket 1 up to
    its deadline. SIGKILLed, the kernel drops that lock: the next receive refuses at once."""
    peer = Peer(_stuck_publisher)
    m = peer.recv()["manifest"]
    seg = SHM_DIR / m["handle"]["segment"]
    rx = make_weight_channel("shm", role="receiver")
    try:
        monkeypatch.setattr(W, "LOCK_TIMEOUT_S", 0.5)
        with pytest.raises(TransportError, match="v5: segment .* bucket 1 was not written for 0.5s"):
            rx.receive(m)
        peer.proc.kill()  # our own child, by its pid
        peer.proc.join(timeout=30)
        monkeypatch.setattr(W, "LOCK_TIMEOUT_S", 60.0)  # waiting for the deadline would say so
        with pytest.raises(TransportError, match=r"bucket 1 of 3 was never written \(its publisher stopped writing"):
            rx.receive(m)
    finally:
        if peer.proc.is_alive():
            peer.proc.kill()
        seg.unlink(missing_ok=True)  # a killed publisher leaves its segment behind (nothing ran its finalizer)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_shm_leaks")
@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")
def test_across_processes_trajectories_and_weights():
    rx = make_tensor_channel("shm", role="receiver", endpoint="tcp://127.0.0.1:*")
    pub = make_weight_channel("shm", role="publisher", bucket_mb=1 / 64)
    peer = Peer(_peer)
    try:
        peer.send({"endpoint": rx.endpoint})
        for seed in range(3):
            key, meta, got = rx.recv(timeout_s=30)
            assert (key, meta) == (f"traj-{seed}", {"seed": seed})
            assert_bit_exact(got, sample_tensors(seed))
        sd = {k: v.contiguous() for k, v in sample_tensors(0).items()}
        sd["w"] = torch.randn(300, 70).to(torch.bfloat16)  # spans several 16 KiB buckets
        manifest = pub.publish_begin(1, sd)
        pub.publish_end()
        assert len(manifest["bucket_bytes"]) > 1
        peer.send({"manifest": manifest})
        assert peer.recv() == {"crc": state_checksum(sd), "names": list(sd)}
        assert peer.recv() == {"bye": True}
        peer.join()
    finally:
        pub.close()
        rx.close()


RANK1 = """
import os, sys, torch, torch.distributed as dist
from areal_async.rollout.clients.weight_group import destroy_group, init_custom_group
pg = init_custom_group("gloo", "127.0.0.1", int(sys.argv[1]), 1, 2, sys.argv[2], timeout_s=60)
buf = torch.zeros(3)
dist.broadcast(buf, src=0, group=pg)
dist.barrier(group=pg)  # leave together: a rank whose peer still talks to it aborts in gloo's threads
destroy_group(pg)
print(buf.tolist(), flush=True)
os._exit(0)
"""


def test_sglang_weight_group_store_listens_only_on_the_master_address():
    """The SGLang weight group keeps torch's tcp:// rendezvous (SGLang's server joins it so; here another
    process, through the same function the CPU server uses), but rank 0's store serves a socket bound to
    the master address: the kernel shows 127.0.0.1, not '*' (torch's TCPStore on 127.0.0.1 listens on '*')."""
    port, name = free_tcp_port(), "areal-test-" + os.urandom(8).hex()
    peer = subprocess.Popen(
        [sys.executable, "-c", RANK1, str(port), name], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        pg = init_custom_group("gloo", "127.0.0.1", port, 0, 2, name, timeout_s=60)
        assert [s for s in listeners(os.getpid()) if s[1] == port] == [("127.0.0.1", port)]
        dist.broadcast(torch.full((3,), 7.0), src=0, group=pg)
        dist.barrier(group=pg)
        out, err = peer.communicate(timeout=60)
        assert peer.returncode == 0 and out.decode().strip() == "[7.0, 7.0, 7.0]", err.decode()[-2000:]
        destroy_group(pg)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
