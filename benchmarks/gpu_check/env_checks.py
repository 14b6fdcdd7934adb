"""The box itself: versions, devices, CuPy/NCCL, and the packages the other checks import. Imports nothing of
the project (it must report a missing pyzmq/msgpack, which the project's modules import)."""

from __future__ import annotations

import importlib.util

import torch
import transformers

from benchmarks.gpu_check.registry import Result

# what the checks import besides torch/transformers (pip names: the .whl/ folder of scripts/gpu_check.sh)
NEEDED = {"zmq": "pyzmq", "msgpack": "msgpack", "yaml": "pyyaml", "safetensors": "safetensors", "numpy": "numpy"}


def environment() -> Result:
    """Versions and devices; fails when a package the checks import is missing (named with its wheel)."""
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": torch.cuda.device_count(),
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
    info.update(_cupy())
    missing = [pip for mod, pip in NEEDED.items() if importlib.util.find_spec(mod) is None]
    info["missing"] = missing
    if missing:
        return Result(False, f"missing {missing}: put their wheels in .whl/ (see scripts/gpu_check.sh)", info)
    return Result(True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), {info['devices']} GPU(s)", info)


def _cupy() -> dict:
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        return {"cupy": f"not importable: {e}"}
    out = {"cupy": cupy.__version__, "nccl_available": bool(getattr(nccl, "available", False))}
    if out["nccl_available"]:
        out["nccl_version"] = nccl.get_version()
    return out
