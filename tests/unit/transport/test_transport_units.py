"""Transport pieces without processes: bucketing, manifests, checksums, headers, the factory."""

from __future__ import annotations

import copy

import msgpack
import pytest
import torch

from areal_async.transport import (
    KINDS,
    ManifestError,
    ProtocolError,
    TransportError,
    TransportUnavailable,
    make_tensor_channel,
    make_weight_channel,
)
from areal_async.transport import buckets as B
from areal_async.transport.frames import ALIGN, header_bytes, layout, parse_header, tensor_views
from tests.support.transport_helpers import assert_bit_exact, sample_tensors


def _sd() -> dict[str, torch.Tensor]:
    sd = sample_tensors()
    sd.pop("f32_t")  # state dicts hold contiguous parameters; strided ones are covered by the channels
    sd["big"] = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: larger than the bucket below
    return sd


def test_plan_keeps_order_aligns_and_caps_buckets():
    sd = _sd()
    lay = B.plan(sd, bucket_bytes=256)
    assert [s.name for s in lay.slots] == list(sd)
    assert all(s.offset % ALIGN == 0 and s.offset + s.nbytes <= lay.bucket_sizes[s.bucket] for s in lay.slots)
    big = next(s for s in lay.slots if s.name == "big")
    assert big.offset == 0 and lay.bucket_sizes[big.bucket] == 4032  # alone in its own bucket
    assert all(n <= 256 for k, n in enumerate(lay.bucket_sizes) if k != big.bucket)
    assert [s.bucket for s in lay.slots] == sorted(s.bucket for s in lay.slots)


def test_pack_unflatten_round_trip_and_manifest_is_msgpack_data():
    sd = _sd()
    lay = B.plan(sd, 300)
    flat = torch.full((lay.total,), 0xAB, dtype=torch.uint8)  # garbage padding must be zeroed by pack
    bufs = [flat[o : o + n] for o, n in zip(lay.bucket_offsets(), lay.bucket_sizes)]
    for k, b in enumerate(bufs):
        B.pack(lay, sd, k, b)
    values = [B.checksum(b, "sum64") for b in bufs]
    m = B.manifest("shm", 3, lay, "sum64", values, {"segment": "x", "size": 1})
    m2 = msgpack.unpackb(msgpack.packb(m, use_bin_type=True), raw=False)
    lay2, _ = B.parse_manifest(m2, "shm")
    B.verify(bufs, "sum64", m2["checksum"]["values"], 3)
    assert_bit_exact(B.unflatten(lay2, bufs), sd)
    again = torch.zeros_like(flat)  # same weights -> same bytes -> same checksums
    for k, (o, n) in enumerate(zip(lay.bucket_offsets(), lay.bucket_sizes)):
        B.pack(lay, sd, k, again[o : o + n])
    assert torch.equal(again, flat)


@pytest.mark.parametrize("piece", [64, 1 << 20])
def test_fused_pack_sum_writes_the_same_bytes_and_sums_every_word_once(monkeypatch, piece):
    """The fused pass (partial sums every ``piece`` bytes, tails summed after their padding is zeroed)
    against pack + a word sum in numpy (uint64 wraps modulo 2**64)."""
    monkeypatch.setattr(B, "PIECE", piece)
    sd = _sd()
    sd["odd"] = torch.arange(333, dtype=torch.int16)  # 666 bytes: a word holds tail and padding
    lay = B.plan(sd, 1024)
    for k, n in enumerate(lay.bucket_sizes):
        fused = torch.full((n,), 0xCD, dtype=torch.uint8)  # garbage padding
        plain = torch.zeros(n, dtype=torch.uint8)
        got = B.pack_sum(lay, sd, k, fused, "sum64")
        B.pack(lay, sd, k, plain)
        assert torch.equal(fused, plain)
        assert got == int(plain.numpy().view("uint64").sum(dtype="uint64"))
        assert B.pack_sum(lay, sd, k, fused, "none") == 0


@pytest.mark.parametrize("algo", ["sum64", "crc32"])
def test_checksums_see_a_single_flipped_bit(algo):
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    before = B.checksum(buf, algo)
    buf[1234] ^= 0x10
    assert B.checksum(buf, algo) != before
    with pytest.raises(TransportError, match=r"bucket 0 .*corrupt"):
        B.verify([buf], algo, [before], version=5)


def _manifest() -> dict:
    sd = _sd()
    lay = B.plan(sd, 300)
    return B.manifest("gloo", 1, lay, "sum64", None, {"root": 0, "world_size": 2})


def _set(path, value):
    def edit(m):
        target = m
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    "edit, match",
    [
        (_set(["channel"], "shm"), "is for channel 'shm'"),
        (_set(["format"], "areal-weights/0"), "format"),
        (_set(["version"], -1), "version -1"),
        (_set(["tensors", 0, "dtype"], "complex64"), "dtype 'complex64'"),
        (_set(["tensors", 0, "shape"], [3, 6]), "is 72 bytes, entry says 60"),
        (_set(["tensors", 0, "offset"], 32), "misaligned"),
        (_set(["tensors", 0, "bucket"], 99), "bucket 99"),
        (_set(["tensors", 1, "name"], "f32_2d"), "twice"),
        (_set(["bucket_bytes", 0], 64), "outside bucket 0"),
        (_set(["checksum", "values"], [1]), "values"),
        (_set(["checksum", "algo"], "md5"), "checksum"),
        (lambda m: m.pop("handle"), "manifest keys"),
    ],
)
def test_parse_manifest_rejects_inconsistent_manifests(edit, match):
    m = copy.deepcopy(_manifest())
    edit(m)
    with pytest.raises(ManifestError, match=match):
        B.parse_manifest(m, "gloo")


def test_parse_manifest_rejects_overlapping_tensors():
    m = _manifest()
    first, second = m["tensors"][0], m["tensors"][1]
    second.update(bucket=first["bucket"], offset=first["offset"])
    with pytest.raises(ManifestError, match="overlap"):
        B.parse_manifest(m, "gloo")


def test_tensor_views_are_views_and_reject_mislabels():
    t = sample_tensors()
    sizes = [x.numel() * x.element_size() for x in t.values()]
    offsets, total = layout(sizes)
    flat = torch.zeros(total, dtype=torch.uint8)
    for x, o, n in zip(t.values(), offsets, sizes):
        if n:
            flat[o : o + n].view(x.dtype).view(x.shape).copy_(x)
    header = parse_header(header_bytes("k", {"a": 1}, t))
    for buf in (flat, flat.numpy()):  # a uint8 tensor, or host memory as numpy (the shm channel's views)
        views = tensor_views(header, buf, offsets, sizes)
        assert_bit_exact(views, t)
        assert views["u8"].data_ptr() == flat.data_ptr() + offsets[list(t).index("u8")]
        assert views["bf16"].data_ptr() == flat.data_ptr() + offsets[list(t).index("bf16")]
        with pytest.raises(ProtocolError, match="needs 60 bytes"):
            tensor_views(header, buf, offsets, [sizes[0] - 4] + sizes[1:])
        with pytest.raises(ProtocolError, match="misaligned"):
            tensor_views(header, buf, [offsets[0] + 4] + offsets[1:], sizes)
        with pytest.raises(ProtocolError, match=f"outside the {total}-byte buffer"):
            tensor_views(header, buf, offsets[:-1] + [total], sizes)
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        parse_header(b"\xc1garbage")


def test_factory_names_kinds_and_roles():
    with pytest.raises(ValueError, match="shm \\| zmq \\| gloo \\| nccl \\| cuda_ipc"):
        make_tensor_channel("rdma", role="sender", endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="'publisher' or a 'receiver'"):
        make_weight_channel("shm", role="sender")
    assert set(KINDS) == {"shm", "zmq", "gloo", "nccl", "cuda_ipc"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine error")
@pytest.mark.parametrize(
    "make, kw",
    [
        (
            make_tensor_channel,
            dict(role="sender", endpoint="tcp://127.0.0.1:1", rank=1, world_size=2, store="127.0.0.1:1"),
        ),
        (make_weight_channel, dict(role="publisher", rank=0, world_size=2, store="127.0.0.1:1")),
    ],
)
def test_nccl_on_cpu_names_what_is_missing(make, kw):
    with pytest.raises(TransportUnavailable) as e:
        make("nccl", **kw)
    msg = str(e.value)
    assert "a CUDA device" in msg and "'gloo'" in msg
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "cupy (pip install cupy-cuda13x" in msg  # a CPU torch: the gpu extra's CUDA 13 wheels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine error")
def test_cuda_ipc_on_cpu_names_what_is_missing():
    with pytest.raises(TransportUnavailable, match="'cuda_ipc' tensor channel needs a CUDA device"):
        make_tensor_channel("cuda_ipc", role="receiver", endpoint="tcp://127.0.0.1:*")
    with pytest.raises(TransportUnavailable, match="needs a CUDA device"):
        make_weight_channel("cuda_ipc", role="receiver")


def test_scale_model_fit_recovers_alpha_and_beta():
    from benchmarks.scale_model import fit_alpha_beta

    alpha, beta = 150e-6, 5e9
    points = [(n, alpha + n / beta) for n in (1 << 10, 1 << 16, 1 << 22, 1 << 28)]
    a, b = fit_alpha_beta(points)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_scale_model_weight_update_adds_the_exposed_copies_to_the_broadcast():
    from benchmarks.scale_model import Cluster, copies_from, parse_args, weight_broadcast, weight_update

    # copies: one copy of 1e9 bytes at the row's bound of 1 GB/s takes 1 s; pack 2 s and verify 0.5 s are 2 and
    # 0.5 copies; the end-to-end row's copy (1e9 bytes at 2 GB/s) takes 0.5 s, its load 0.25 s: 0.5 copy
    rows = [
        {"metric": "weight_sync", "transport": "shm", "bytes": 10**9, "bound_gbps": 1.0,
         "pub_phases": {"pack_checksum_s": 2.0}, "recv_phases": {"verify_s": 0.5}},
        {"metric": "weight_sync_e2e", "transport": "shm", "bytes": 10**9, "bound_gbps": 2.0, "load_s": 0.25},
    ]  # fmt: skip
    assert copies_from(rows) == pytest.approx({"pack": 2.0, "verify": 0.5, "load": 0.5})
    c = Cluster(parse_args(["--hbm-copy-gbs", "1000", "--bucket-mb", "64"]))
    got = weight_update(c, 1e9, 8, {"pack": 1.0, "verify": 1.0, "load": 1.0})
    # by hand: one 64 MiB bucket packed and one verified at 1e12 B/s, then 2e9 bytes loaded at 1e12 B/s
    assert got["exposed_s"] == pytest.approx(2 * 64 * 2**20 / 1e12) and got["load_s"] == pytest.approx(2e-3)
    assert got["broadcast_s"] == pytest.approx(sum(weight_broadcast(c, "ring", 1e9, 8)))
    assert got["value"] == pytest.approx(got["broadcast_s"] + got["exposed_s"] + got["load_s"])


def test_lora_payload_and_the_7b_prediction_count_r_times_in_plus_out():
    from benchmarks.common.payloads import MODELS, lora_state_dict, nbytes
    from benchmarks.scale_model import MODELS as SCALE, lora_numel

    # tiny-0.6M: hidden 128, MLP 352, 2 layers, 2 KV heads of 128 (kv 256): per layer r (in + out) over
    # q 128+128, k 128+256, v 128+256, o 128+128, gate 128+352, up 128+352, down 352+128 = 2720 r
    sd = lora_state_dict(MODELS["tiny-0.6M"], rank=16)
    assert nbytes(sd) == 2 * 2720 * 16 * 2 and len(sd) == 2 * 7 * 2  # bf16, 2 layers, A and B per layer
    assert lora_numel(hidden=128, inter=352, layers=2, kv=256, rank=16) == 2720 * 16 * 2
    # Qwen2-7B (hidden 3584, MLP 18944, 28 layers, 4 KV heads of 128), r = 16: 28 * 16 * 90,112
    assert SCALE["7B-lora-r16"] == 40_370_176


def test_boba_batch_shape_and_packing():
    from benchmarks.common.payloads import boba_batch, nbytes, pack_batch

    seqs = boba_batch(n_prompts=2, n_samples=4, max_len=300)
    assert len(seqs) == 8 and all(1 <= len(s["ids_T"]) <= 300 for s in seqs)
    packed = pack_batch(seqs)
    assert packed["ids_T"].dtype == torch.int32 and packed["logp_T"].dtype == torch.float32
    assert packed["cu_seqlens"][-1].item() == packed["ver_T"].numel() == sum(len(s["ids_T"]) for s in seqs)
    assert nbytes(packed) == 12 * packed["ids_T"].numel() + 4 * 9


def test_publish_end_waits_only_where_receivers_take_part():
    """The trainer calls publish_end without a thread only where it cannot wait for a receiver."""
    shm = make_weight_channel("shm", role="publisher")
    alone = make_weight_channel("zmq", role="publisher")
    awaited = make_weight_channel("zmq", role="publisher", expect_receivers=2, timeout_s=0.2)
    try:
        assert not shm.publish_end_waits and not alone.publish_end_waits and awaited.publish_end_waits
        for ch in (shm, alone):  # returns at once with nobody fetching
            ch.publish_begin(0, _sd())
            ch.publish_end()
        awaited.publish_begin(0, _sd())
        with pytest.raises(TransportError, match="0 of 2 receivers fetched"):
            awaited.publish_end()  # two fetches awaited, none comes
    finally:
        for ch in (shm, alone, awaited):
            ch.close()


def test_receiver_buffer_pool_reuses_only_what_nobody_holds():
    from areal_async.transport.collective import BufferPool

    pool = BufferPool()
    a = pool.take(4096)
    a.fill_(7)
    view = a[100:200]  # a tensor made from the buffer keeps it lent
    del a
    b = pool.take(1024)  # the first is still held through ``view``: a new array
    assert b.data_ptr() != view.data_ptr() - 100 and view.eq(7).all()
    b_ptr = b.data_ptr()
    del b
    c = pool.take(1000)  # the second is free again: reused (the smallest that fits)
    assert c.data_ptr() == b_ptr and c.numel() == 1000
    del view
    d = pool.take(2048)  # the first is free now
    assert d.numel() == 2048 and len(pool.free) == 0
    c_ptr, d_ptr = c.data_ptr(), d.data_ptr()
    del c, d  # two free arrays of different sizes: taking the larger passes over the smaller
    e = pool.take(3000)
    assert e.data_ptr() == d_ptr and [a.size for a in pool.free] == [1024]
    assert pool.take(16).data_ptr() == c_ptr
