"""GPU-path choices checked on CPU: flash-attn only for bf16/fp16 compute, the NCCL unique id in
the form the installed CuPy takes (tuple up to CuPy 13, bytes from 14)."""

import pytest
import torch

from areal_async.trainer import packing
from areal_async.transport.nccl import UID_BYTES, communicator, uid_from_bytes, uid_to_bytes


def test_flash_attention_only_for_half_precision_compute(monkeypatch):
    monkeypatch.setattr(packing, "flash_attn_available", lambda: True)
    assert packing.select_attn_implementation("cuda", torch.bfloat16) == "flash_attention_2"
    assert packing.select_attn_implementation("cuda", torch.float16) == "flash_attention_2"
    assert packing.select_attn_implementation("cuda", torch.float32) == packing.VARLEN_IMPL  # flash-attn refuses fp32
    assert packing.select_attn_implementation("cpu", torch.bfloat16) == packing.VARLEN_IMPL
    monkeypatch.setattr(packing, "flash_attn_available", lambda: False)
    assert packing.select_attn_implementation("cuda", torch.bfloat16) == packing.VARLEN_IMPL


class TupleCupy:
    """CuPy <= 13: ``NcclCommunicator(int, tuple commId, int)`` (Cython refuses bytes)."""

    class NcclCommunicator:
        def __init__(self, n, comm_id, rank):
            if not isinstance(comm_id, tuple):
                raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(comm_id).__name__})")
            self.id = comm_id


class BytesCupy:
    """CuPy >= 14: the id is bytes, as ``get_unique_id`` returns it."""

    class NcclCommunicator:
        def __init__(self, n, comm_id, rank):
            if not isinstance(comm_id, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(comm_id).__name__})")
            self.id = comm_id


def test_nccl_unique_id_goes_in_the_form_the_installed_cupy_takes():
    raw = bytes(range(UID_BYTES))
    assert uid_to_bytes(raw) == raw  # CuPy >= 14 hands out bytes
    assert uid_to_bytes(uid_from_bytes(raw)) == raw  # CuPy <= 13: a tuple of C chars
    assert communicator(TupleCupy, 2, raw, 0).id == uid_from_bytes(raw)
    assert communicator(BytesCupy, 2, raw, 1).id == raw

    class Neither:
        class NcclCommunicator:
            def __init__(self, n, comm_id, rank):
                raise TypeError("no")

    with pytest.raises(TypeError, match="neither as a tuple"):
        communicator(Neither, 2, raw, 0)
