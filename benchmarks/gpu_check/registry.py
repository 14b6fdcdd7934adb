"""The GPU checks' registry and runner: one JSON line per check, exit status 1 when any failed.

A check is a function ``() -> Result`` (or ``(dev) -> Result`` when it has a CPU twin) named in
``CHECKS``. The runner imports nothing of the project itself: a check's module is imported when the
check runs, in a spawned child (its own process group and CUDA context; killed at its timeout) unless
``isolate=False``. Checks that need CUDA are skipped without it ("skipped: no CUDA"); ``--cpu-twins``
runs those that have a CPU twin with ``dev="cpu"`` (gloo or a host communicator for NCCL) instead.
A check that needs what a bare GPU box lacks (``needs``: pyzmq and msgpack for what starts a fleet or
uses the run's store, a CUDA vLLM environment) is skipped saying so ("skipped: pyzmq missing"); the
others import neither pyzmq nor msgpack (tests/bench/test_gpu_check.py holds them to it).
The whole run stays inside ``BUDGET_S`` (8 minutes on the check box, less the start-up).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import multiprocessing as mp
import queue
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Optional

BUDGET_S = 450.0
PACKAGE = "benchmarks.gpu_check"


@dataclass(frozen=True)
class Check:
    name: str
    target: str  # "module:function"; a module name without a dot is one of this package's
    needs_cuda: bool
    timeout_s: float = 120.0
    isolate: bool = True  # run in a spawned child
    cpu_twin: bool = False  # the function takes ``dev``; on CPU it can run with dev="cpu" (--cpu-twins)
    needs: tuple[str, ...] = ()  # modules a bare GPU box lacks (PIP_NAMES), or "vllm": a CUDA vLLM environment


@dataclass
class Result:
    ok: bool
    detail: str
    data: dict = field(default_factory=dict)


FLEET = ("zmq", "msgpack")  # what the control plane and the run's store import
PIP_NAMES = {"zmq": "pyzmq", "msgpack": "msgpack"}

CHECKS: list[Check] = [
    Check("environment", "env_checks:environment", False, 60, isolate=False),
    Check("flash_attn_choice", "attention_checks:flash_attn_choice", False, 60, isolate=False),
    Check("trainer_group_backend", "trainer_checks:trainer_group_backend", False, 120, isolate=False, cpu_twin=True),
    Check("placement_refusals", "placement_checks:placement_refusals", False, 60, isolate=False),
    Check("nccl_group_loopback", "transport_checks:nccl_group_loopback", True, 90, cpu_twin=True),
    Check("nccl_weight_publish", "transport_checks:nccl_weight_publish", True, 90, cpu_twin=True),
    Check("nccl_run_store", "transport_checks:nccl_run_store", True, 90, cpu_twin=True, needs=FLEET),
    Check("cuda_ipc_two_processes", "transport_checks:cuda_ipc_two_processes", True, 120),
    Check("trajectories_to_host", "transport_checks:trajectories_to_host", True, 60),
    Check("engine_decode_vs_hf", "engine_checks:engine_decode_vs_hf", True, 90, cpu_twin=True),
    Check("fsdp2_step_vs_plain", "fsdp_checks:fsdp2_step_vs_plain", True, 150, cpu_twin=True),
    Check("fsdp2_chunked_checkpointing", "fsdp_checks:fsdp2_chunked_checkpointing", True, 150, cpu_twin=True),
    Check("fsdp2_lora_step", "fsdp_checks:fsdp2_lora_step", True, 150, cpu_twin=True),
    Check("dcp_roundtrip_hf_export", "fsdp_checks:dcp_roundtrip_hf_export", True, 120, cpu_twin=True),
    Check("one_gpu_run", "run_checks:one_gpu_run", True, 430, cpu_twin=True, needs=FLEET),
    Check("vllm_weight_transfer", "run_checks:vllm_weight_transfer", True, 600, needs=("vllm",)),
]


def resolve(check: Check):
    """The check's function; a module name without a dot is one of this package's."""
    module, fn = check.target.split(":")
    return getattr(importlib.import_module(module if "." in module else f"{PACKAGE}.{module}"), fn)


def call(check: Check, dev: Optional[str]) -> Result:
    fn = resolve(check)
    res = fn(dev) if check.cpu_twin else fn()
    if not isinstance(res, Result):
        raise TypeError(f"check {check.name} returned {type(res).__name__}; expected a Result")
    return res


def _failure(e: BaseException) -> Result:
    return Result(False, f"{type(e).__name__}: {e}", {"trace": traceback.format_exc()[-1500:]})


def _child(check: Check, dev: Optional[str], q) -> None:
    try:
        res = call(check, dev)
    except BaseException as e:  # reported as the check's failure
        res = _failure(e)
    q.put(asdict(res))


def _in_child(check: Check, dev: Optional[str], timeout_s: float) -> Result:
    ctx = mp.get_context("spawn")  # CUDA cannot be used after fork
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(check, dev, q))  # not a daemon: a check may spawn ranks
    proc.start()
    try:
        res, grace = Result(**q.get(timeout=timeout_s)), 10.0  # answered: let it tear down (process groups)
    except queue.Empty:
        res, grace = Result(False, f"no answer in {timeout_s:.0f} s (child exit code {proc.exitcode})"), 0.0
    proc.join(timeout=grace)
    if proc.is_alive():
        proc.kill()  # the ranks a killed check spawned die with their parent's pipes (their own timeouts)
        proc.join(timeout=5)
    return res


def missing(check: Check) -> Optional[str]:
    """Why a check cannot run on this box for lack of a package or environment, or None."""
    for need in check.needs:
        if need == "vllm":
            py = os.environ.get("VLLM_PYTHON")
            if not (py and os.access(py, os.X_OK)) and importlib.util.find_spec("vllm") is None:
                return "skipped: no CUDA vLLM environment (set VLLM_PYTHON)"
        elif importlib.util.find_spec(need) is None:
            return f"skipped: {PIP_NAMES.get(need, need)} missing"
    return None


def skip_reason(check: Check, cuda: bool, cpu_twins: bool = False) -> Optional[str]:
    """Why the check cannot run here (no CUDA and no twin asked for, a package or environment missing), or None."""
    if check.needs_cuda and not cuda and not (cpu_twins and check.cpu_twin):
        return "skipped: no CUDA"
    return missing(check)


def run_check(
    check: Check, cuda: bool, cpu_twins: bool = False, timeout_s: Optional[float] = None, in_process: bool = False
) -> dict:
    """One check's JSON row: skipped when it needs CUDA and there is none (unless it runs as a CPU twin), or
    a package or environment this box lacks."""
    t0 = time.monotonic()
    dev = "cuda" if cuda else "cpu"
    if (why := skip_reason(check, cuda, cpu_twins)) is not None:
        return _row(check, "skipped", why, {}, t0)
    limit = check.timeout_s if timeout_s is None else min(timeout_s, check.timeout_s)
    if check.isolate and not in_process:
        res = _in_child(check, dev, limit)
    else:
        try:
            res = call(check, dev)
        except Exception as e:  # reported as the check's failure
            res = _failure(e)
    return _row(check, "pass" if res.ok else "fail", res.detail, res.data, t0)


def _row(check: Check, status: str, detail: str, data: dict, t0: float) -> dict:
    return {
        "name": check.name,
        "status": status,
        "detail": detail,
        "seconds": round(time.monotonic() - t0, 2),
        "data": data,
    }


def run_all(
    checks: list[Check], cuda: bool, cpu_twins: bool = False, budget_s: float = BUDGET_S, in_process: bool = False
) -> list[dict]:
    rows, t0 = [], time.monotonic()
    for check in checks:
        left = budget_s - (time.monotonic() - t0)
        if left < 5 and skip_reason(check, cuda, cpu_twins) is None:  # one it would skip is still skipped
            row = _row(check, "fail", f"not run: the {budget_s:.0f} s budget is spent", {}, time.monotonic())
        else:
            row = run_check(check, cuda, cpu_twins, timeout_s=left, in_process=in_process)
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the check names and exit")
    ap.add_argument("--cpu-twins", action="store_true", help="without CUDA, run the checks' CPU twins (gloo)")
    ap.add_argument(
        "--in-process", action="store_true", help="run every check in this process (no timeouts; CPU twins in CI)"
    )
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(f"{c.name}\t{'cuda' if c.needs_cuda else 'any'}\t{c.target}" for c in CHECKS))
        return 0
    names = [n for n in a.only.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in CHECKS})
    if unknown:
        print(f"unknown check(s) {unknown}; expected names from --list", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError as e:  # nothing can run: said as the environment check's line
        print(json.dumps(_row(CHECKS[0], "fail", f"torch is not importable ({e})", {}, time.monotonic())))
        return 1
    chosen = [c for c in CHECKS if not names or c.name in names]
    rows = run_all(chosen, torch.cuda.is_available(), a.cpu_twins, in_process=a.in_process)
    return 1 if any(r["status"] == "fail" for r in rows) else 0
