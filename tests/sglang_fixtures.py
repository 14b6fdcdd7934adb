"""Test helpers for the SGLang backend: CPU servers in real processes, the pinned sglang wheel.

``start_cpu_server(config)`` runs ``python -m areal_async.rollout.sglang_server`` on a free port
and returns (process, "http://127.0.0.1:PORT"); ``stop(proc)`` kills it by pid.
``pinned_sglang_file(path)`` returns the text of one file of the pinned sglang release, read out
of its wheel (``pip download --no-deps`` once into ``$AREAL_CACHE`` or ``~/.cache/areal-async``);
the test skips, saying why, only when the package index cannot be reached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from protocols.sockets import free_tcp_port

SGLANG_PIN = "0.5.23"  # the release whose HTTP contract the client is built against
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_arith.yaml"


def start_cpu_server(config: Path = TINY, port: int | None = None, extra: list[str] = ()):
    port = port or free_tcp_port("127.0.0.1")
    cmd = [
        sys.executable,
        "-m",
        "areal_async.rollout.sglang_server",
        "--config",
        str(config),
        "--port",
        str(port),
        *extra,
    ]
    out = None if os.environ.get("AREAL_SERVER_LOGS") else subprocess.DEVNULL  # AREAL_SERVER_LOGS=1: show them
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _cache() -> Path:
    return Path(os.environ.get("AREAL_CACHE", Path.home() / ".cache" / "areal-async")) / "wheels"


def pinned_wheel() -> Path:
    d = _cache()
    found = sorted(d.glob(f"sglang-{SGLANG_PIN}-*.whl"))
    if found:
        return found[0]
    d.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={SGLANG_PIN}", "-d", str(d)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    found = sorted(d.glob(f"sglang-{SGLANG_PIN}-*.whl"))
    if not found:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        pytest.skip(f"sglang=={SGLANG_PIN} wheel not downloadable (package index unreachable?): {' | '.join(tail)}")
    return found[0]


def pinned_sglang_file(inner: str) -> str:
    with zipfile.ZipFile(pinned_wheel()) as z:
        return z.read(inner).decode()
