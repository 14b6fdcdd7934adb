"""The box itself: versions, devices, CuPy/NCCL, and which optional packages are here. Imports nothing of the
project. pyzmq and msgpack are optional: only the checks that start a fleet or use the run's store need them
(they are skipped without them, saying so), so a box without them passes this check and names them."""

from __future__ import annotations

import importlib.util

import torch
import transformers

from benchmarks.gpu_check.registry import CHECKS, PIP_NAMES, Result


def environment() -> Result:
    """Versions and devices; the optional packages missing here and the checks that skip for them."""
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": torch.cuda.device_count(),
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
    info.update(_cupy())
    absent = [mod for mod in PIP_NAMES if importlib.util.find_spec(mod) is None]
    info["missing"] = [PIP_NAMES[m] for m in absent]
    info["skip_for_them"] = [c.name for c in CHECKS if set(c.needs) & set(absent)]
    more = f"; without {info['missing']}: {info['skip_for_them']} skip (wheels in .whl/ run them)" if absent else ""
    return Result(True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), {info['devices']} GPU(s){more}", info)


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
