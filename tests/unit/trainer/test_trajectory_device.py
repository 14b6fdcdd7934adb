"""Trajectories received into GPU memory reach the trainer's packed batch with one device-to-host copy per
message (item 4 of issue 23), and tensors on two devices are refused with a clear error.

No GPU here: the ``meta`` device stands for CUDA (tensors with a device, shapes and dtypes, no data), and
``HostCopies`` intercepts every meta -> host copy, counts it and hands back zeros of the right shape, as
the GPU's bytes would arrive. The expected counts are what one copy per buffer means, by hand.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from areal_async.trainer.compute.dp import encode_batch
from areal_async.trainer.compute.packing import pack
from areal_async.trainer.buffer import TrajectoryBuffer
from protocols.trajectories import Trajectory
from areal_async.transport.frames import to_host

DEV = "meta"


class HostCopies(TorchDispatchMode):
    """Counts device -> host copies (``_to_copy`` to the CPU, ``copy_`` into a CPU tensor) of meta tensors."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[1] if func is torch.ops.aten.copy_.default else args[0]
        if isinstance(src, torch.Tensor) and src.device.type == DEV:
            if func is torch.ops.aten._to_copy.default and torch.device(kwargs.get("device", DEV)).type == "cpu":
                self.n += 1
                return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)
            if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu":
                self.n += 1
                return args[0]
        return func(*args, **kwargs)


def _trajs(device: str, n: int = 6) -> list[Trajectory]:
    out = []
    prompts = [torch.arange(2, dtype=torch.int32, device=device) for _ in range(n // 2 + 1)]
    for i in range(n):
        ids = torch.arange(3 + i, dtype=torch.int32, device=device)
        out.append(
            Trajectory(
                f"s{i}",
                f"g{i // 2}",
                prompts[i // 2],  # one a group, as the rows of a received message share it
                ids,
                torch.zeros(3 + i, device=device),
                torch.zeros(3 + i, dtype=torch.int32, device=device),
                float(i % 2),
            )
        )
    return out


def test_pack_copies_device_sequences_to_the_host_once():
    trajs = _trajs(DEV)
    with HostCopies() as copies:
        packed = pack([t.seq_parts for t in trajs])
    assert copies.n == 1  # before: one copy per piece, 2 x 6 = 12
    assert packed.ids_T.is_cpu and packed.lengths == [2 + 3 + i for i in range(6)]
    assert packed.position_ids_T[:5].tolist() == [0, 1, 2, 3, 4]


def test_encode_batch_of_device_trajectories_copies_to_the_host_once():
    trajs = _trajs(DEV)
    with HostCopies() as copies:
        buf = encode_batch(trajs)
    assert copies.n == 1  # the columns are laid out on the device, then one copy (before: one per part, 2)
    assert buf.is_cpu and buf.dtype == torch.uint8
    n_header = int.from_bytes(bytes(buf[:8].tolist()), "little")
    header = json.loads(bytes(buf[8 : 8 + n_header].tolist()))  # the host part: the real header (JSON)
    assert header["meta"]["sample_ids"] == [f"s{i}" for i in range(6)] and header["meta"]["group_sizes"] == [2, 2, 2]
    # by hand, each column 64-byte aligned: prompts 3 x 2 x 4 B = 24 -> 64; outputs, logprobs, versions
    # (3 + ... + 8) = 33 tokens x 4 B = 132 -> 192 each; scores 6 x 8 B = 48 -> 64
    assert buf.numel() - (8 + n_header + 63) // 64 * 64 == 64 + 3 * 192 + 64


def test_tensors_on_two_devices_are_refused_by_name():
    cpu, dev = _trajs("cpu", 2), _trajs(DEV, 2)
    with pytest.raises(ValueError, match=r"token ids are on \['cpu', 'meta'\]; expected all on one device"):
        pack([cpu[0].seq_parts, dev[1].seq_parts])
    with pytest.raises(ValueError, match=r"trajectory tensors are on \['cpu', 'meta'\]; expected all on one"):
        encode_batch([cpu[0], dev[1]])


def test_to_host_copies_one_message_buffer_once():
    flat = torch.empty(64, dtype=torch.uint8, device=DEV)
    msg = {
        "output_ids": flat[:16].view(torch.int32),
        "logprobs": flat[16:48].view(torch.float32),
        "lengths": flat[48:56].view(torch.int64),
    }
    with HostCopies() as copies:
        got = to_host(msg)
    assert copies.n == 1
    assert {k: (v.device.type, v.dtype, tuple(v.shape)) for k, v in got.items()} == {
        "output_ids": ("cpu", torch.int32, (4,)),
        "logprobs": ("cpu", torch.float32, (8,)),
        "lengths": ("cpu", torch.int64, (1,)),
    }
    # views of one host buffer, at the offsets they had on the device
    assert got["logprobs"].untyped_storage().data_ptr() == got["output_ids"].untyped_storage().data_ptr()
    assert got["logprobs"].storage_offset() == 4 and got["lengths"].storage_offset() == 6


def test_to_host_keeps_host_tensors_and_their_values():
    msg = {"a": torch.arange(5), "b": torch.ones(3)}
    assert to_host(msg) is msg


class OneMessage:
    """A trajectory channel that delivers one group received into device memory, then stops the buffer."""

    def __init__(self, buf_ref: list):
        self.buf_ref, self.sent = buf_ref, False

    def recv(self, timeout_s=None):
        if self.sent:
            self.buf_ref[0].stopping.set()
            raise TimeoutError
        self.sent = True
        flat = torch.empty(128, dtype=torch.uint8, device=DEV)  # the message's one receive buffer
        meta = {"group_ids": ["g"], "group_sizes": [2], "prompt_lengths": [2]}
        meta.update(sample_ids=["a", "b"], lengths=[2, 3])
        return (
            "grp",
            meta,  # the sizes travel as host values in the header
            {
                "prompt_ids": flat[:8].view(torch.int32),
                "output_ids": flat[8:28].view(torch.int32),
                "logprobs": flat[28:48].view(torch.float32),
                "versions": flat[48:68].view(torch.int32),
            },
        )


def test_trajectory_buffer_keeps_received_groups_on_the_host():
    ref: list = [None]
    buf = TrajectoryBuffer(OneMessage(ref))
    ref[0] = buf
    assert threading.current_thread() is threading.main_thread()
    with HostCopies() as copies:
        buf._run()  # in this thread (dispatch modes are per thread): one message, then it stops
    assert copies.n == 1 and sorted(buf.items) == ["a", "b"]
    assert all(t.is_cpu for v in buf.items.values() for t in (v.prompt_ids, v.output_ids, v.logprobs, v.versions))
