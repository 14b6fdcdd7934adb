"""GPU transport checks (marked ``gpu``; run by ``scripts/gpu_check.sh`` or ``pytest -m gpu tests/gpu``).

Covered: the device-to-device copy bound; CuPy NCCL through our ``NcclGroup`` on one rank (a
send-to-self loopback, and a weight publish whose broadcast has no receivers); NCCL across two
ranks (trajectories and weights) when the machine has two GPUs; CUDA IPC trajectories and
weights between two processes on one GPU, with the receiving process reporting checksums.
Not covered: multi-host NCCL (GPUDirect RDMA), which needs a cluster.

Nothing here imports cupy or touches CUDA at import time, so the module collects on CPU; on a box
without pyzmq/msgpack (scripts/gpu_check.sh's bare GPU box) it is skipped at collection, saying so.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib

import pytest
import torch

msgpack = pytest.importorskip("msgpack", reason="the project's transport needs msgpack (see scripts/gpu_check.sh)")
pytest.importorskip("zmq", reason="the project's transport needs pyzmq (see scripts/gpu_check.sh)")

from areal_async.transport.frames import flat_bytes  # noqa: E402
from protocols.sockets import free_tcp_port  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _zoo(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=g).half(),
        "i64": torch.arange(7),
        "i32": torch.arange(6, dtype=torch.int32),
        "bool": torch.rand(9, generator=g) > 0.5,
        "u8": torch.arange(13, dtype=torch.uint8),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
    }
    return {k: v.to(device) for k, v in t.items()}


def _crc(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for name, t in tensors.items():
        crc = zlib.crc32(f"{name}{t.dtype}{list(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def _spawn(target, *args):
    ctx = mp.get_context("spawn")  # CUDA cannot be used after fork
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent


def _send(conn, obj) -> None:
    conn.send_bytes(msgpack.packb(obj, use_bin_type=True))


def _recv(conn, timeout_s: float = 120):
    assert conn.poll(timeout_s), "peer process said nothing"
    msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
    assert "error" not in msg, msg
    return msg


def test_d2d_copy_bound():
    n = 256 << 20
    src = torch.ones(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    gbps = 10 * n / (time.perf_counter() - t0) / 1e9
    print(f"device-to-device copy: {gbps:.0f} GB/s")
    assert gbps > 100 and torch.equal(dst[:16], src[:16])


def test_nccl_single_rank_loopback_and_publish():
    """Through ``NcclGroup``'s own send/recv (not the raw communicator): a send to oneself and its receive in one
    outer NCCL group, the receive into ``recv_buffer``; the events recorded inside the outer group predate its
    launch (at the outer groupEnd), so the group's stream is synchronised before the bytes are read."""
    pytest.importorskip("cupy")
    from areal_async.transport import make_weight_channel
    from areal_async.transport.nccl import NcclGroup

    group = NcclGroup(rank=0, world_size=1, store=f"127.0.0.1:{free_tcp_port()}", name="loopback")
    zoo = _zoo("cuda")
    sent = [flat_bytes(t) for t in zoo.values() if t.numel()]
    got = [group.recv_buffer(p.numel()) for p in sent]
    group.nccl.groupStart()  # send to self needs its matching receive in the same group
    group.send(sent, 0)
    group.recv(got, 0)
    group.nccl.groupEnd()
    group.stream.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(sent, got))
    group.close()
    pub = make_weight_channel(
        "nccl", role="publisher", rank=0, world_size=1, store=f"127.0.0.1:{free_tcp_port()}", bucket_mb=1
    )
    manifest = pub.publish_begin(1, {"w": torch.randn(1000, 700, device="cuda"), "b": torch.zeros(3, device="cuda")})
    pub.publish_end()
    assert manifest["channel"] == "nccl" and len(manifest["bucket_bytes"]) == 2
    msgpack.packb(manifest)
    pub.close()


def _nccl_rank1(conn, cfg: dict) -> None:
    try:
        from areal_async.transport import make_tensor_channel, make_weight_channel

        torch.cuda.set_device(1)
        tx = make_tensor_channel(
            "nccl", role="sender", endpoint=cfg["ep"], rank=1, world_size=2, store=cfg["traj_store"], device=1
        )
        wx = make_weight_channel("nccl", role="receiver", rank=1, world_size=2, store=cfg["w_store"], device=1)
        tx.send("zoo", _zoo("cuda:1"), {"from": 1})
        sd = wx.receive(msgpack.unpackb(conn.recv_bytes(), raw=False))
        _send(conn, {"crc": _crc(sd), "device": str(next(iter(sd.values())).device)})
        tx.close()
        wx.close()
    except Exception as e:  # reported to the test, which fails with it
        _send(conn, {"error": f"{type(e).__name__}: {e}"})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs for two ranks")
def test_nccl_two_ranks_trajectories_and_weights():
    pytest.importorskip("cupy")
    from areal_async.transport import make_tensor_channel, make_weight_channel

    cfg = {
        "ep": f"tcp://127.0.0.1:{free_tcp_port()}",
        "traj_store": f"127.0.0.1:{free_tcp_port()}",
        "w_store": f"127.0.0.1:{free_tcp_port()}",
    }
    proc, conn = _spawn(_nccl_rank1, cfg)
    rx = make_tensor_channel(
        "nccl", role="receiver", endpoint=cfg["ep"], rank=0, world_size=2, store=cfg["traj_store"], device=0
    )
    pub = make_weight_channel(
        "nccl", role="publisher", rank=0, world_size=2, store=cfg["w_store"], device=0, bucket_mb=4
    )
    key, meta, got = rx.recv(timeout_s=60)
    assert got["bf16"].device == torch.device("cuda", 0) and _crc(got) == _crc(_zoo("cuda:0"))
    sd = {f"layer{i}": torch.randn(1024, 1024, device="cuda:0").to(torch.bfloat16) for i in range(6)}
    manifest = pub.publish_begin(1, sd)
    conn.send_bytes(msgpack.packb(manifest, use_bin_type=True))
    pub.publish_end()
    assert _recv(conn) == {"crc": _crc(sd), "device": "cuda:1"}
    proc.join(timeout=60)
    rx.close()
    pub.close()


def _ipc_peer(conn, ep: str) -> None:
    try:
        from areal_async.transport import make_tensor_channel, make_weight_channel

        rx = make_tensor_channel("cuda_ipc", role="receiver", endpoint=ep, device=0)
        _send(conn, {"ready": True})
        key, meta, got = rx.recv(timeout_s=60)
        _send(conn, {"crc": _crc(got), "key": key})
        del got
        sub = make_weight_channel("cuda_ipc", role="receiver", device=0)
        sd = sub.receive(msgpack.unpackb(conn.recv_bytes(), raw=False))
        _send(conn, {"crc": _crc(sd)})
        del sd
        rx.close()
    except Exception as e:  # reported to the test, which fails with it
        _send(conn, {"error": f"{type(e).__name__}: {e}"})


def test_cuda_ipc_between_two_processes():
    from areal_async.transport import make_tensor_channel, make_weight_channel

    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc, conn = _spawn(_ipc_peer, ep)
    assert _recv(conn) == {"ready": True}
    tx = make_tensor_channel("cuda_ipc", role="sender", endpoint=ep, device=0)
    zoo = _zoo("cuda")
    tx.send("zoo", zoo)
    assert _recv(conn) == {"crc": _crc(zoo), "key": "zoo"}
    pub = make_weight_channel("cuda_ipc", role="publisher", device=0, bucket_mb=1)
    sd = {f"w{i}": torch.randn(512, 700, device="cuda").to(torch.bfloat16) for i in range(4)}
    manifest = pub.publish_begin(1, sd)
    conn.send_bytes(msgpack.packb(manifest, use_bin_type=True))
    assert _recv(conn) == {"crc": _crc(sd)}
    proc.join(timeout=60)
    assert proc.exitcode == 0
    pub.release(1)
    pub.close()
    tx.close()
