"""NCCL through the project's own classes on one GPU, CUDA IPC between two processes, and trajectories from GPU
memory to the trainer's host.

One GPU allows only one-rank NCCL groups (NCCL refuses two ranks on one device), so:
- ``nccl_group_loopback``: ``NcclGroup.send`` and ``recv`` to itself inside one outer NCCL group (a send to
  oneself needs its receive in the same group; the group's own groupStart/End nest inside it), payloads
  received into one frame laid out as ``CollectiveTensorChannel.recv`` lays it (``frames.layout``: each payload
  at a 64-byte aligned offset, the padding zero); bytes, dtypes and shapes back, and the sum64 of the frame on
  the device equal to the host's. (Main checksummed each payload alone: 8198, 924, 4004 and 77 bytes, which
  sum64, a sum of 8-byte words, refuses; the check failed on a healthy GPU, issue 36 item 2.)
- ``nccl_weight_publish``: ``NcclWeightChannel`` (world 1) publishes a bf16/fp32/int64 state dict in 1 MiB
  buckets; its manifest and the checksums it computed on the device equal the buckets packed on the host.
- ``nccl_run_store``: the same publication in a group whose unique id travels through the run's own store
  (``transport.store``, ZeroMQ: needs pyzmq and msgpack); CPU twin: a gloo group through that store.
- ``cuda_ipc_two_processes``: ``CudaIpcWeightChannel`` shares a version from this process; a spawned one opens it
  and sends back the bytes it read.
- ``trajectories_to_host``: a message's tensors as views of one CUDA buffer (what the NCCL receive hands the
  trainer) reach the host equal, as views of one host copy; ``pack`` and ``encode_batch`` of CUDA
  trajectories equal those of host trajectories.
The loopback and publish checks run on CPU against ``twins.loopback_group`` (``--cpu-twins``): the same code,
a host communicator that refuses what NCCL refuses on one rank. The groups built here take their unique id
from a rendezvous callable (one rank: its own), not from the store: no pyzmq. The two-rank NCCL channels (two
GPUs) are tests/gpu/test_gpu_transport.py. None of this has run on a GPU (no GPU was lent to the sessions that
wrote it).
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from areal_async.trainer.compute.dp import encode_batch
from areal_async.trainer.compute.packing import pack
from protocols.trajectories import Trajectory
from areal_async.transport import buckets as B
from areal_async.transport import make_weight_channel
from areal_async.transport.collective import CollectiveWeightChannel
from areal_async.transport.frames import flat_bytes, layout, to_host, view_as
from areal_async.transport.nccl import NcclGroup
from benchmarks.gpu_check.registry import Result
from benchmarks.gpu_check.twins import loopback_group
from protocols.ports import free_tcp_port


def payloads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "bf16": torch.randn(4099, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(33, 7, generator=g),
        "int32": torch.arange(-500, 501, dtype=torch.int32),
        "bool": torch.rand(77, generator=g) > 0.5,
        "bf16_16MiB": torch.randn(8 << 20, generator=g).to(torch.bfloat16),
    }


def _own_id(uid: bytes) -> bytes:
    """The rendezvous of a one-rank group: rank 0 is handed its own unique id back."""
    return uid


def one_rank_group(dev: str, name: str) -> NcclGroup:
    """A one-rank NCCL group on GPU 0, or its host twin (``twins.loopback_group``)."""
    if dev == "cuda":
        return NcclGroup(rank=0, world_size=1, rendezvous=_own_id, device=0, name=name)
    return loopback_group()


def _frame(g: NcclGroup, sizes: list[int]) -> tuple[torch.Tensor, list[int], int]:
    """The receive frame (on the group's stream, its padding zeroed there too, so before the receive)."""
    offsets, total = layout(sizes)
    flat = g.recv_buffer(total)
    with g.streams.use(g.stream):
        flat.zero_()
    return flat, offsets, total


def nccl_group_loopback(dev: str) -> Result:
    g = one_rank_group(dev, "gpu-check-loopback")
    try:
        zoo = payloads()
        sent = [flat_bytes(t.to(g.device)) for t in zoo.values()]
        flat, offsets, total = _frame(g, [p.numel() for p in sent])
        g.nccl.groupStart()
        try:
            g.send(sent, 0)
            g.recv([flat[o : o + p.numel()] for o, p in zip(offsets, sent)], 0)
        finally:
            g.nccl.groupEnd()
        g.stream.synchronize()  # the events recorded inside the outer group predate its launch (at groupEnd)
        host = torch.zeros(total, dtype=torch.uint8)
        bad = []
        for (name, t), o, p in zip(zoo.items(), offsets, sent):
            host[o : o + p.numel()] = flat_bytes(t)
            back = view_as(flat[o : o + p.numel()], t.dtype, list(t.shape)).cpu()
            if not (back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)):
                bad.append(f"{name}: bytes differ")
        on_dev, on_host = B.checksum(flat, "sum64"), B.checksum(host, "sum64")
        if on_dev != on_host:
            bad.append(f"sum64 of the frame on {g.device.type} {on_dev} != the host's {on_host}")
    finally:
        g.close()
    data = {"payloads": {k: [str(v.dtype), list(v.shape)] for k, v in zoo.items()}, "frame_bytes": total}
    return Result(not bad, "; ".join(bad) or f"{len(zoo)} payloads back byte-equal, sum64 of the frame == host's", data)


def weights(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        **{f"w{i}": torch.randn(1024, 700, generator=g).to(torch.bfloat16) for i in range(3)},
        "norm": torch.randn(300, generator=g),
        "steps": torch.arange(5),
    }


def host_sums(host: dict[str, torch.Tensor], bucket: int = 1 << 20) -> list[int]:
    """The buckets' sum64, packed on the host: what the device's must equal."""
    lay, out = B.plan(host, bucket), []
    for k, n in enumerate(lay.bucket_sizes):
        buf = torch.empty(n, dtype=torch.uint8)
        B.pack(lay, host, k, buf)
        out.append(B.checksum(buf, "sum64"))
    return out


def _publish_recorded(pub, host: dict[str, torch.Tensor], device: torch.device) -> tuple[dict, list[int]]:
    """Publish version 1 of ``host`` (moved to ``device``), recording the checksums computed while sending."""
    computed: list[int] = []
    send_buckets = pub._send_buckets

    def recording(lay, sd):
        computed.extend(send_buckets(lay, sd))
        return computed

    pub._send_buckets = recording
    try:
        manifest = pub.publish_begin(1, {k: v.to(device) for k, v in host.items()})
        pub.publish_end()
    finally:
        pub.close()
    return manifest, computed


def _publish_result(manifest: dict, computed: list[int], host: dict, channel: str) -> Result:
    want = host_sums(host)
    lay = B.plan(host, 1 << 20)
    data = {"buckets": len(lay.bucket_sizes), "manifest_buckets": len(manifest["bucket_bytes"])}
    ok = manifest["channel"] == channel and manifest["bucket_bytes"] == list(lay.bucket_sizes) and computed == want
    return Result(ok, f"{len(want)} buckets; checksums on the device {'==' if computed == want else '!='} host's", data)


def nccl_weight_publish(dev: str) -> Result:
    host = weights()
    if dev == "cuda":
        pub = make_weight_channel("nccl", role="publisher", rank=0, world_size=1, rendezvous=_own_id, bucket_mb=1)
    else:
        pub = CollectiveWeightChannel(one_rank_group(dev, "gpu-check-publish"), role="publisher", bucket_mb=1)
    manifest, computed = _publish_recorded(pub, host, pub.group.device)
    return _publish_result(manifest, computed, host, "nccl")


def nccl_run_store(dev: str) -> Result:
    """NCCL (cuda) or gloo (the CPU twin) with the rendezvous through the run's own store (``transport.store``:
    served by rank 0 over ZeroMQ, the unique id under the group's key)."""
    store = f"tcp://127.0.0.1:{free_tcp_port('127.0.0.1')}"
    kind = "nccl" if dev == "cuda" else "gloo"
    pub = make_weight_channel(kind, role="publisher", rank=0, world_size=1, store=store, bucket_mb=1)
    host = weights(2)
    manifest, computed = _publish_recorded(pub, host, pub.group.device)
    res = _publish_result(manifest, computed, host, kind)
    res.data["store"] = store
    return res


def _open_shared(manifest: dict, out) -> None:
    """The receiving process: opens the publisher's buffer, verifies it, sends back what it read (plain data)."""
    try:
        torch.cuda.set_device(0)
        rx = make_weight_channel("cuda_ipc", role="receiver", rank=1)
        got = rx.receive(manifest)
        out.put(
            {
                k: (str(v.dtype), list(v.shape), v.cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                for k, v in got.items()
            }
        )
    except BaseException as e:  # reported to the parent, which fails the check with it
        out.put({"error": f"{type(e).__name__}: {e}"})


def cuda_ipc_two_processes() -> Result:
    """A version shared from this process (``CudaIpcWeightChannel``, a torch IPC reference for the one receiver)
    and read in a spawned process that opens the handles from the manifest: the bytes it read equal the host's.
    (The manifest crosses by a multiprocessing queue here, by msgpack in a run.)"""
    host = weights(3)
    pub = make_weight_channel("cuda_ipc", role="publisher", bucket_mb=1, n_receivers=1, device=0)
    manifest = pub.publish_begin(1, {k: v.cuda() for k, v in host.items()})
    pub.publish_end()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_open_shared, args=(manifest, q))
    proc.start()
    try:
        got = q.get(timeout=90)
    finally:
        proc.join(timeout=30)
        pub.release(1)
        pub.close()
    if "error" in got:
        return Result(False, f"the receiving process: {got['error']}", {})
    want = {
        k: (str(v.dtype), list(v.shape), v.reshape(-1).view(torch.uint8).numpy().tobytes()) for k, v in host.items()
    }
    bad = sorted(k for k in want if got.get(k) != want[k])
    data = {"tensors": len(want), "differ": bad, "receiver_exit": proc.exitcode}
    return Result(
        not bad, "; ".join(f"{k} differs" for k in bad) or f"{len(want)} tensors read equal in another process", data
    )


def trajectories_to_host() -> Result:
    msg = {
        "output_ids": torch.arange(7, dtype=torch.int32),
        "logprobs": torch.linspace(-3, 0, 7),
        "versions": torch.full((7,), 4, dtype=torch.int32),
        "lengths": torch.tensor([3, 4]),
    }
    offsets, total = layout([flat_bytes(t).numel() for t in msg.values()])
    flat = torch.zeros(total, dtype=torch.uint8, device="cuda")
    for off, t in zip(offsets, msg.values()):
        b = flat_bytes(t)
        flat[off : off + b.numel()] = b.cuda()
    on_gpu = {
        k: view_as(flat[o : o + flat_bytes(t).numel()], t.dtype, list(t.shape))
        for (k, t), o in zip(msg.items(), offsets)
    }
    back = to_host(on_gpu)
    equal = all(back[k].is_cpu and torch.equal(back[k], msg[k]) for k in msg)
    one_copy = len({t.untyped_storage().data_ptr() for t in back.values()}) == 1
    cpu = [
        Trajectory(f"s{i}", "g", [1, 2], torch.arange(3 + i, dtype=torch.int32), [-1.0] * (3 + i), [0] * (3 + i), 1.0)
        for i in range(4)
    ]
    gpu = [
        Trajectory(
            t.sample_id,
            t.group_id,
            t.prompt_ids.cuda(),
            t.output_ids.cuda(),
            t.logprobs.cuda(),
            t.versions.cuda(),
            t.score,
        )
        for t in cpu
    ]
    same_pack = torch.equal(pack([t.seq_parts for t in gpu]).ids_T, pack([t.seq_parts for t in cpu]).ids_T)
    same_enc = torch.equal(encode_batch(gpu), encode_batch(cpu))
    ok = equal and one_copy and same_pack and same_enc
    data = {"equal": equal, "one_host_buffer": one_copy, "pack_equal": same_pack, "encode_equal": same_enc}
    return Result(ok, ", ".join(f"{k}: {v}" for k, v in data.items()), data)
