"""The GPU extras install one CUDA major: CuPy and NCCL wheels of the major of the torch that the pinned
SGLang requires, flash-attn (an sdist that compiles) in an extra of its own; ``require_nccl`` names
the wheels of the running torch's CUDA major.

Independent fact (read from the sglang 0.5.23 wheel's METADATA): Requires-Dist torch==2.14.1,
cuda-python>=13.0, flashinfer_python[cu13]==0.7.2, flash-attn-4>=4.0.0b18: a CUDA 13 stack. sglang 0.5.0
required torch==2.8.0 (CUDA 12.8); the cu13 line is taken here from 0.5.21 on (0.5.20, also cu13, lacks the
weight-update session routes).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from areal_async.transport import nccl
from areal_async.transport.base import TransportUnavailable

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"
CUDA_SUFFIX = re.compile(r"^(?:cupy-cuda(\d+)x|nvidia-[a-z-]+-cu(\d+))$")


def extras() -> dict[str, list[Requirement]]:
    raw = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in raw.items()}


def expand(name: str, table: dict[str, list[Requirement]]) -> list[Requirement]:
    """An extra's requirements with self-references (``areal-async[x]``) resolved."""
    out = []
    for r in table[name]:
        out += [q for x in sorted(r.extras) for q in expand(x, table)] if r.name == "areal-async" else [r]
    return out


def cuda_majors(reqs: list[Requirement]) -> set[int]:
    found = set()
    for r in reqs:
        m = CUDA_SUFFIX.match(r.name)
        if m:
            found.add(int(m.group(1) or m.group(2)))
    return found


def test_every_gpu_extra_holds_one_cuda_major_the_one_of_its_sglang():
    table = extras()
    gpu = [name for name, reqs in table.items() if any(r.name == "sglang" for r in expand(name, table))]
    assert "gpu" in gpu
    for name in gpu:
        reqs = expand(name, table)
        (sglang,) = [r for r in reqs if r.name == "sglang"]
        assert sglang.specifier.contains("0.5.23") and not sglang.specifier.contains("0.5.0"), (name, sglang)
        assert not sglang.specifier.contains("0.6.0"), f"{name}: an unreviewed sglang line may change its CUDA"
        assert cuda_majors(reqs) == {13}, f"{name}: CUDA majors {cuda_majors(reqs)}; sglang 0.5.2x is CUDA 13"
        assert {"cupy-cuda13x", "nvidia-nccl-cu13"} <= {r.name for r in reqs}
        assert "flash-attn" not in {r.name for r in reqs}, f"{name}: flash-attn is an sdist that compiles"
    assert [r.name for r in table["flash-attn"]] == ["flash-attn"]


@pytest.mark.parametrize(
    ("cuda", "wheels"),
    [
        ("13.0", ("cupy-cuda13x", "nvidia-nccl-cu13")),
        ("12.8", ("cupy-cuda12x", "nvidia-nccl-cu12")),
        (None, ("cupy-cuda13x", "nvidia-nccl-cu13")),
    ],
)
def test_require_nccl_names_the_wheel_of_the_torch_cuda_major(monkeypatch, cuda, wheels):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a box without CuPy
    with pytest.raises(TransportUnavailable) as e:
        nccl.require_nccl()
    assert f"cupy (pip install {wheels[0]};" in str(e.value)
    assert nccl.cuda_wheels(cuda) == wheels
