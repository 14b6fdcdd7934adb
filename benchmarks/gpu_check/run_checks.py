"""Whole runs on the GPU: a one-GPU ``areal-async run`` with exact books, and vLLM's weight paths.

``one_gpu_run``: the one-GPU layout (the embedded torch engine and one trainer rank on GPU 0, weights over CUDA
IPC, trajectories over shm) trains 20 steps of the real-model preset (``configs/smollm2_*.yaml``, when one is
shipped and its model directory is on this machine) or of ``configs/tiny_arith.yaml``; the run must exit 0 and
``areal-async verify`` must find the books exact (every issued sample trained once or aborted with a reason,
the trainer's and the rollouts' own records agreeing with them, nothing stale, 20 steps). It starts a fleet:
pyzmq and msgpack needed (from ``.whl/``), else skipped. CPU twin (``--cpu-twins``): the same run on the host
with the preset's channels, which the e2e tier already runs (tests/e2e).

``vllm_weight_transfer``: ``tests/gpu/vllm_weight_transfer_check.py`` (vLLM's disk reload, and its NCCL weight
transfer where two GPUs exist) with the interpreter of a CUDA vLLM environment (``VLLM_PYTHON``, else this one
when it imports vllm); skipped without one. Neither has run on a GPU yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from areal_async.app.commands.verify import verify_run
from benchmarks.gpu_check.registry import Result

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
ONE_GPU = [
    "cluster.device=cuda",
    "cluster.n_gpus_per_node=1",
    "cluster.n_trainer_ranks=1",
    "tensor_channel.weights=cuda_ipc",
    "tensor_channel.trajectories=shm",
]


def preset() -> Path:
    """The real-model preset when one is shipped and its model is here, else the tiny one."""
    import yaml

    for p in sorted((ROOT / "configs").glob("smollm2_*.yaml")):
        path = ((yaml.safe_load(p.read_text()) or {}).get("model") or {}).get("path")
        if path and Path(os.path.expanduser(str(path))).is_dir():
            return p
    return ROOT / "configs" / "tiny_arith.yaml"


def one_gpu_run(dev: str) -> Result:
    cfg = preset()
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-check-run-")) / "run"
    over = [f"total_train_steps={STEPS}", *(ONE_GPU if dev == "cuda" else [])]
    cmd = [sys.executable, "-m", "areal_async.cli", "run", str(cfg), "--run-dir", str(run_dir), "--no-progress", *over]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    data = {"preset": cfg.name, "overrides": over, "exit": proc.returncode, "run_dir": str(run_dir)}
    if proc.returncode != 0:
        return Result(False, f"areal-async run exited {proc.returncode}: {proc.stderr.strip()[-600:]}", data)
    rep = verify_run(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    data |= {"counts": rep.counts, "samples_lost": summary.get("samples_lost"), "problems": rep.lines(5)}
    ok = rep.ok and rep.counts.get("steps") == STEPS and summary.get("samples_lost") == 0
    detail = (
        f"{cfg.name}: {STEPS} steps, books {'exact' if rep.ok else 'NOT exact'}, {rep.counts.get('trained')} trained"
    )
    return Result(ok, detail, data)


def vllm_python() -> str | None:
    """A CUDA vLLM environment's interpreter: VLLM_PYTHON, else this one when it imports vllm."""
    py = os.environ.get("VLLM_PYTHON")
    if py:
        return py if os.access(py, os.X_OK) else None
    import importlib.util

    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_weight_transfer() -> Result:
    py = vllm_python()
    if py is None:  # the registry skips this check first; a race with the environment lands here
        return Result(False, "no CUDA vLLM environment (set VLLM_PYTHON)", {})
    script = ROOT / "tests" / "gpu" / "vllm_weight_transfer_check.py"
    proc = subprocess.run([py, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r["check"] for r in rows if r.get("ok") is False]
    data = {"python": py, "rows": rows, "exit": proc.returncode}
    if proc.returncode != 0 or failed:
        return Result(False, f"failed: {failed or proc.stderr.strip()[-400:]}", data)
    return Result(True, f"{len(rows)} vLLM weight-path rows passed", data)
