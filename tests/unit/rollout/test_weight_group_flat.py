"""``Bucket.flat``: the bytes rank 0 broadcasts to an SGLang server, packed into a fresh tensor or into the front
of a kept buffer (``SGLangClient._bucket_buffer``: no page faults per version); the bytes written by hand here."""

from __future__ import annotations

import struct

import pytest
import torch

from areal_async.rollout.clients.sglang_client import SGLangClient
from areal_async.rollout.clients.weight_group import flattened_buckets

# float32 [1, 2] then bfloat16 [3] (bf16 3.0 = the high half of float32 3.0, 0x40400000): little-endian bytes
SD = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0], dtype=torch.bfloat16)}
BYTES = struct.pack("<ff", 1.0, 2.0) + bytes([0x40, 0x40])


def test_flat_into_a_kept_buffer_writes_its_front_and_returns_that_view():
    [bucket] = flattened_buckets(SD, 1 << 20)
    assert bytes(bucket.flat().tolist()) == BYTES
    buf = torch.full((16,), 0xEE, dtype=torch.uint8)
    out = bucket.flat(buf)
    assert out.data_ptr() == buf.data_ptr() and out.numel() == len(BYTES) == bucket.nbytes
    assert bytes(buf.tolist()) == BYTES + bytes([0xEE] * (16 - len(BYTES)))  # the rest untouched


@pytest.mark.parametrize(
    "buf", [torch.zeros(9, dtype=torch.uint8), torch.zeros(16), torch.zeros(2, 8, dtype=torch.uint8)]
)
def test_a_buffer_that_cannot_hold_the_bucket_is_refused_and_left_alone(buf):
    [bucket] = flattened_buckets(SD, 1 << 20)
    before = buf.clone()
    with pytest.raises(ValueError, match="expected a 1-D uint8 tensor of >= 10"):
        bucket.flat(buf)
    assert torch.equal(buf, before)


def test_the_client_keeps_one_buffer_as_large_as_the_largest_bucket():
    c = SGLangClient("http://127.0.0.1:9", name="t")
    first = c._bucket_buffer(100)
    assert c._bucket_buffer(60) is first and c._bucket_buffer(100) is first  # reused: no new pages
    bigger = c._bucket_buffer(101)
    assert bigger is not first and bigger.numel() == 101 and c._bucket_buffer(7) is bigger


def test_flat_writes_a_buffer_on_another_device_than_the_tensors():
    """Item 1 of issue 36: a worker that received its weights on the GPU (weights over NCCL) packs them into the
    host buffer a gloo group broadcasts. ``torch.cat(..., out=)`` refuses an out tensor on another device than its
    inputs (a structured kernel's ``resize_out``); ``meta`` stands for the other device here, host tensors into a
    meta buffer (the reverse direction, the only one a CPU machine can run: nothing is ever read back from meta)."""
    [bucket] = flattened_buckets(SD, 1 << 20)
    buf = torch.empty(16, dtype=torch.uint8, device="meta")
    out = bucket.flat(buf)
    assert out.device.type == "meta" and out.shape == (len(BYTES),)
    host = torch.zeros(16, dtype=torch.uint8)  # and the same code on one device still writes the bytes
    assert bytes(bucket.flat(host).tolist()) == BYTES


def test_the_clients_buffer_is_where_its_group_broadcasts_from():
    c = SGLangClient("http://127.0.0.1:9", name="t", group_backend="gloo")
    assert c._bucket_buffer(8).device == torch.device("cpu")
