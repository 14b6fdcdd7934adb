"""Test helpers for the SGLang backend: CPU servers in real processes, the pinned sglang wheel.

``start_cpu_server(config)`` runs ``python -m areal_async.rollout.servers.sglang_server`` on a free port
and returns (process, "http://127.0.0.1:PORT"); ``stop(proc)`` kills it by pid.
``pinned_sglang_file(path)`` returns the text of one file of the pinned sglang release: the copy
vendored in ``tests/support/data/sglang-<pin>/`` (checked against its ``SHA256SUMS``; see ``SOURCE.md`` there),
so the schema tests never need the network; a file not vendored is read out of the release's wheel
(``pip download --no-deps`` once into ``$AREAL_CACHE`` or ``~/.cache/areal-async``), and the test
skips, saying why, when the package index cannot be reached (under CI, ``AREAL_MUST_RUN``, it fails).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from protocols.sockets import free_tcp_port

SGLANG_PIN = "0.5.23"  # the release whose HTTP contract the client is built against
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_arith.yaml"
# schema files of the pinned release, with SHA256SUMS
VENDORED = REPO / "tests" / "support" / "data" / f"sglang-{SGLANG_PIN}"


def start_cpu_server(config: Path = TINY, port: int | None = None, extra: list[str] = ()):
    port = port or free_tcp_port("127.0.0.1")
    cmd = [
        sys.executable,
        "-m",
        "areal_async.rollout.servers.sglang_server",
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


def vendored_sglang_file(inner: str) -> str | None:
    """The vendored copy of ``inner`` (a path inside the wheel), its sha256 checked; None if not vendored."""
    sums = {}
    for line in (VENDORED / "SHA256SUMS").read_text().splitlines():
        digest, _, name = line.partition("  ")
        sums[name] = digest
    if inner not in sums:
        return None
    path = VENDORED / f"{inner}.txt"
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != sums[inner]:
        raise AssertionError(f"{path}: sha256 {got}, but SHA256SUMS says {sums[inner]}: the vendored copy changed")
    return path.read_text()


def pinned_sglang_file(inner: str) -> str:
    text = vendored_sglang_file(inner)
    if text is not None:
        return text
    with zipfile.ZipFile(pinned_wheel()) as z:
        return z.read(inner).decode()
