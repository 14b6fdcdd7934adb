"""cuda_ipc weights: one torch IPC reference per receiver (issue 23, item 7).

torch counts CUDA IPC references per ``_share_cuda_()`` call: each call wraps the storage in a new
``CudaIPCSentData`` holding one reference, and each receiving process releases exactly one when its
storage dies (``torch/multiprocessing/reductions.py`` ``rebuild_cuda_tensor``: a receiver that already
holds the storage calls ``_release_ipc_counter`` for the extra share it was sent). One share handed to
N receivers is released N times against one reference. There is no CUDA here, so ``share`` and
``open_shared`` (the two calls into torch's CUDA IPC) are replaced by stand-ins that hand out distinct
reference slots over the real buffer and record who opened which; everything else is the channel's
own code (bucket planning, packing, checksums, manifest, unpacking).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from areal_async.transport import buckets as B
from areal_async.transport import cuda_ipc as C


@pytest.fixture
def ipc(monkeypatch):
    """share() -> a handle with its own ref slot; open_shared() -> the buffer, recording the slot."""
    slots, opened, buffers = itertools.count(), [], {}

    def share(buf):
        k = next(slots)
        buffers[k] = buf
        return {"ref_offset": k, "nbytes": buf.numel()}

    def open_shared(handle):
        opened.append(handle["ref_offset"])
        return buffers[handle["ref_offset"]]

    monkeypatch.setattr(C, "require_cuda", lambda device: torch.device("cpu"))
    monkeypatch.setattr(C, "share", share)
    monkeypatch.setattr(C, "open_shared", open_shared)
    return opened


def test_each_receiver_opens_its_own_share_of_one_publish(ipc):
    gen = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(300, generator=gen), "b": torch.randn(7, 5, generator=gen).to(torch.bfloat16)}
    pub = C.CudaIpcWeightChannel(role="publisher", bucket_mb=0.001, n_receivers=3)
    manifest = pub.publish_begin(4, sd)
    assert len(manifest["handle"]["ipc"]) == 3  # three references for three receivers
    for rank in (1, 2, 3):
        got = C.CudaIpcWeightChannel(role="receiver", rank=rank).receive(manifest)
        assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert sorted(ipc) == [0, 1, 2]  # every share opened once, none twice
    with pytest.raises(B.ManifestError, match="receiver rank 4 needs its own"):
        C.CudaIpcWeightChannel(role="receiver", rank=4).receive(manifest)
    with pytest.raises(ValueError, match="n_receivers=0"):
        C.CudaIpcWeightChannel(role="publisher", n_receivers=0)
