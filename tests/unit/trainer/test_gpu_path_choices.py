"""GPU-path choices checked on CPU: flash-attn only for bf16/fp16 compute and only when transformers
can run it (not for flash-attn-4's bare ``flash_attn/cute``), the NCCL unique id in the form the
installed CuPy takes (tuple up to CuPy 13, bytes from 14)."""

import importlib
import sys

import pytest
import torch
import transformers.utils.import_utils as tf_imports

from areal_async.trainer.compute import packing
from areal_async.transport.nccl import UID_BYTES, communicator, uid_from_bytes, uid_to_bytes


def test_flash_attention_only_for_half_precision_compute(monkeypatch):
    monkeypatch.setattr(packing, "flash_attn_available", lambda: True)
    assert packing.select_attn_implementation("cuda", torch.bfloat16) == "flash_attention_2"
    assert packing.select_attn_implementation("cuda", torch.float16) == "flash_attention_2"
    assert packing.select_attn_implementation("cuda", torch.float32) == packing.VARLEN_IMPL  # flash-attn refuses fp32
    assert packing.select_attn_implementation("cpu", torch.bfloat16) == packing.VARLEN_IMPL
    monkeypatch.setattr(packing, "flash_attn_available", lambda: False)
    assert packing.select_attn_implementation("cuda", torch.bfloat16) == packing.VARLEN_IMPL


def _site(root, dist: str, version: str, files: dict[str, str]):
    """A site directory holding ``files`` and the ``dist`` distribution's metadata (owning ``flash_attn``)."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("flash_attn\n")
    return root


def _flash_choice(monkeypatch, site) -> bool:
    """``select_attn_implementation('cuda', bf16)`` picks flash-attn with ``site`` first on sys.path and
    CUDA reported present (transformers' cached answers dropped before and after)."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(tf_imports, "is_torch_cuda_available", lambda: True)
    for f in (tf_imports.is_flash_attn_2_available, tf_imports._package_distribution_mapping):
        f.cache_clear()
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    importlib.invalidate_caches()
    try:
        return packing.select_attn_implementation("cuda", torch.bfloat16) == "flash_attention_2"
    finally:
        tf_imports.is_flash_attn_2_available.cache_clear()
        tf_imports._package_distribution_mapping.cache_clear()


def test_flash_attn_4_namespace_package_is_not_flash_attention_2(monkeypatch, tmp_path):
    """flash-attn-4 (sglang 0.5.23's dependency) ships only flash_attn/cute: find_spec("flash_attn")
    finds that namespace, transformers' own test does not take it for flash-attn 2."""
    fa4 = _site(tmp_path / "fa4", "flash-attn-4", "4.0.0b4", {"flash_attn/cute/__init__.py": ""})
    assert not _flash_choice(monkeypatch, fa4)


def test_a_flash_attn_2_install_is_chosen(monkeypatch, tmp_path):
    fa2 = _site(tmp_path / "fa2", "flash-attn", "2.8.3", {"flash_attn/__init__.py": "__version__ = '2.8.3'\n"})
    assert _flash_choice(monkeypatch, fa2)


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
