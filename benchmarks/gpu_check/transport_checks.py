"""NCCL through the project's own classes on one GPU, and trajectories from GPU memory to the trainer's host.

One GPU allows only one-rank NCCL groups (NCCL refuses two ranks on one device), so:
- ``nccl_group_loopback``: ``NcclGroup.send`` and ``recv`` to itself inside one outer NCCL group (a send to
  oneself needs its receive in the same group; the group's own groupStart/End nest inside it), payloads
  framed as ``CollectiveTensorChannel.send`` frames them (``flat_bytes``) and received into ``recv_buffer``s;
  bytes, dtypes and shapes back, and the sum64 checksum on the GPU equal to the one computed on the host.
- ``nccl_weight_publish``: ``NcclWeightChannel`` (world 1) publishes a bf16/fp32/int64 state dict in 1 MiB
  buckets; its manifest and the checksums it computed on the GPU equal the buckets packed on the host.
- ``trajectories_to_host``: a message's tensors as views of one CUDA buffer (what the NCCL receive hands the
  trainer) reach the host equal, as views of one host copy; ``pack`` and ``encode_batch`` of CUDA
  trajectories equal those of host trajectories.
The two-rank NCCL channels (two GPUs) are tests/gpu/test_gpu_transport.py. None of this has run on a GPU
(no GPU was lent to the session that wrote it).
"""

from __future__ import annotations

import torch

from areal_async.trainer.dp import encode_batch
from areal_async.trainer.packing import pack
from areal_async.trainer.types import Trajectory
from areal_async.transport import buckets as B
from areal_async.transport import make_weight_channel
from areal_async.transport.frames import flat_bytes, layout, to_host, view_as
from areal_async.transport.nccl import NcclGroup
from benchmarks.gpu_check.registry import Result
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


def _store() -> str:
    return f"127.0.0.1:{free_tcp_port('127.0.0.1')}"


def nccl_group_loopback() -> Result:
    g = NcclGroup(rank=0, world_size=1, store=_store(), name="gpu-check-loopback")
    try:
        zoo = payloads()
        sent = [flat_bytes(t.to(g.device)) for t in zoo.values()]
        rx = [g.recv_buffer(p.numel()) for p in sent]
        g.nccl.groupStart()
        try:
            g.send(sent, 0)
            g.recv(rx, 0)
        finally:
            g.nccl.groupEnd()
        g.stream.synchronize()  # the events recorded inside the outer group predate its launch (at groupEnd)
        bad = []
        for (name, t), r in zip(zoo.items(), rx):
            back = view_as(r, t.dtype, list(t.shape)).cpu()
            if not (back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)):
                bad.append(f"{name}: bytes differ")
            if B.checksum(r, "sum64") != B.checksum(flat_bytes(t), "sum64"):
                bad.append(f"{name}: sum64 on the GPU differs from the host's")
    finally:
        g.close()
    data = {"payloads": {k: [str(v.dtype), list(v.shape)] for k, v in zoo.items()}, "problems": bad}
    return Result(not bad, "; ".join(bad) or f"{len(zoo)} payloads back byte-equal, sum64 GPU == host", data)


def nccl_weight_publish() -> Result:
    pub = make_weight_channel("nccl", role="publisher", rank=0, world_size=1, store=_store(), bucket_mb=1)
    g = torch.Generator().manual_seed(1)
    host = {
        **{f"w{i}": torch.randn(1024, 700, generator=g).to(torch.bfloat16) for i in range(3)},
        "norm": torch.randn(300, generator=g),
        "steps": torch.arange(5),
    }
    computed: list[int] = []
    send_buckets = pub._send_buckets

    def recording(lay, sd):
        computed.extend(send_buckets(lay, sd))
        return computed

    pub._send_buckets = recording
    try:
        manifest = pub.publish_begin(1, {k: v.cuda() for k, v in host.items()})
        pub.publish_end()
    finally:
        pub.close()
    lay = B.plan(host, 1 << 20)
    want = []
    for k, n in enumerate(lay.bucket_sizes):
        buf = torch.empty(n, dtype=torch.uint8)
        B.pack(lay, host, k, buf)
        want.append(B.checksum(buf, "sum64"))
    data = {"buckets": len(lay.bucket_sizes), "manifest_buckets": len(manifest["bucket_bytes"])}
    ok = manifest["channel"] == "nccl" and manifest["bucket_bytes"] == list(lay.bucket_sizes) and computed == want
    return Result(ok, f"{len(want)} buckets; checksums on the GPU {'==' if computed == want else '!='} host's", data)


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
            t.behav_logp.cuda(),
            t.versions.cuda(),
            t.score,
        )
        for t in cpu
    ]
    same_pack = torch.equal(pack([t.seq_parts for t in gpu]).ids_T, pack([t.seq_parts for t in cpu]).ids_T)
    same_enc = all(torch.equal(a, b) for a, b in zip(encode_batch(gpu), encode_batch(cpu)))
    ok = equal and one_copy and same_pack and same_enc
    data = {"equal": equal, "one_host_buffer": one_copy, "pack_equal": same_pack, "encode_equal": same_enc}
    return Result(ok, ", ".join(f"{k}: {v}" for k, v in data.items()), data)
