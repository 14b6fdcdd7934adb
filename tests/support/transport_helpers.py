"""Shared fixtures of the transport tests: a tensor zoo, bit-exact comparison, leak checks, a peer.

Holds no tests itself; the ``test_transport_*`` modules import it (pytest puts ``tests/`` on
``sys.path``, and spawned peer processes inherit that path).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import msgpack
import pytest
import torch

SHM = Path("/dev/shm")


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype the channels must carry, in awkward shapes (empty, 0-d, non-contiguous, odd sizes)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "f32_2d": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16_3d": torch.randn(2, 3, 1, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**62), 2**62, (5,), generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=g, dtype=torch.int32),
        "bool": torch.rand(11, generator=g) > 0.5,
        "u8": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "empty_f32": torch.empty(0, 4),
        "empty_i64": torch.empty(0, dtype=torch.int64),
        "scalar_f32": torch.tensor(3.25),
        "scalar_bool": torch.tensor(True),
        "f32_t": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        gb = g.contiguous().reshape(-1).view(torch.uint8)
        wb = w.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(gb, wb), name


def shm_names() -> set[str]:
    """Segments that this test process could have leaked: made by it, or by a process that has
    exited (a spawned peer). Live processes of other runs on the machine are not ours to judge."""
    names = {p.name for p in SHM.glob("areal_*")} if SHM.is_dir() else set()
    return {n for n in names if _owner_gone_or_me(n)}


def _owner_gone_or_me(name: str) -> bool:
    parts = name.split("_")  # areal_<run id>_<pid>_<random>...
    if len(parts) < 3 or not parts[2].isdigit():
        return True
    pid = int(parts[2])
    return pid == os.getpid() or not Path(f"/proc/{pid}").exists()


@pytest.fixture
def no_shm_leaks():
    before = shm_names()
    yield
    import gc

    gc.collect()
    assert shm_names() - before == set(), "shared-memory segments left in /dev/shm"


class Peer:
    """A spawned process running ``target(conn, *args)``; messages are msgpack bytes on a pipe."""

    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def send(self, obj) -> None:
        self.conn.send_bytes(msgpack.packb(obj, use_bin_type=True))

    def recv(self, timeout_s: float = 60):
        assert self.conn.poll(timeout_s), f"peer {self.proc.pid} said nothing for {timeout_s}s"
        msg = msgpack.unpackb(self.conn.recv_bytes(), raw=False)
        assert not (isinstance(msg, dict) and "error" in msg), msg.get("error")
        return msg

    def join(self) -> None:
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()  # our own child, by its recorded pid
        assert self.proc.exitcode == 0, f"peer exit code {self.proc.exitcode}"


def reply(conn, obj) -> None:
    conn.send_bytes(msgpack.packb(obj, use_bin_type=True))


def ask(conn):
    return msgpack.unpackb(conn.recv_bytes(), raw=False)
