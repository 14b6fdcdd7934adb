"""The GPU check runner (benchmarks.gpu_check, scripts/gpu_check.sh) on this CPU machine: one JSON line per
registered check, CUDA checks "skipped: no CUDA", the others pass, exit 0; a failing, raising, hanging or
malformed check is reported as failed and makes the exit status non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from benchmarks.gpu_check import registry
from benchmarks.gpu_check.registry import CHECKS, Check, run_all, run_check

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_sh_on_cpu_skips_cuda_checks_and_passes_the_rest():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["name"] for r in rows] == [c.name for c in CHECKS]
    assert len(rows) >= 8
    for row, check in zip(rows, CHECKS):
        assert set(row) == {"name", "status", "detail", "seconds", "data"}
        if check.needs_cuda:
            assert (row["status"], row["detail"]) == ("skipped", "skipped: no CUDA"), row
        else:
            assert row["status"] == "pass", row
    assert sum(r["seconds"] for r in rows) < 8 * 60


def test_every_registered_check_resolves_to_a_function():
    assert len({c.name for c in CHECKS}) == len(CHECKS)
    for c in CHECKS:
        assert callable(registry.resolve(c)), c


def _bad(name: str, isolate: bool = False, timeout_s: float = 30) -> Check:
    return Check(name, f"tests.support.gpu_check_fixtures:{name}", False, timeout_s, isolate=isolate)


def test_failures_are_reported_and_set_the_exit_status(capsys):
    rows = run_all([_bad("fails"), _bad("raises"), _bad("wrong_type")], cuda=False)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == rows and [r["status"] for r in rows] == ["fail"] * 3
    assert rows[0]["detail"] == "2 + 2 was 5" and rows[0]["data"] == {"got": 5}
    assert rows[1]["detail"] == "RuntimeError: the device fell off"
    assert rows[2]["detail"].startswith("TypeError: check wrong_type returned bool")
    skipped = run_check(Check("gpu_only", "tests.support.gpu_check_fixtures:fails", True), cuda=False)
    assert (skipped["status"], skipped["detail"]) == ("skipped", "skipped: no CUDA")


def test_a_hanging_check_is_stopped_at_its_timeout():
    row = run_check(_bad("hangs", isolate=True, timeout_s=3), cuda=False)
    assert row["status"] == "fail" and row["detail"].startswith("no answer in 3 s") and row["seconds"] < 30


def test_main_exit_status(monkeypatch, capsys):
    monkeypatch.setattr(registry, "CHECKS", [_bad("fails")])
    assert registry.main([]) == 1
    assert registry.main(["--only", "nope"]) == 2
    monkeypatch.setattr(registry, "CHECKS", [Check("gpu_only", "tests.support.gpu_check_fixtures:fails", True)])
    assert registry.main([]) == 0  # skipped is not failed
    capsys.readouterr()


def test_without_pyzmq_and_msgpack_the_runner_names_them_and_tests_gpu_collect():
    """The bare GPU box has neither: the environment check fails naming the wheels to carry, the runner
    itself imports, and tests/gpu still collects (the gpu_check tests), the rest skipping saying why."""
    code = (
        "import sys\n"
        "sys.modules['zmq'] = sys.modules['msgpack'] = None  # import fails, find_spec says None: as if absent\n"
        "from benchmarks.gpu_check import registry\n"
        "row = registry.run_check(registry.CHECKS[0], cuda=False)\n"
        "print('ENV', row['status'], row['detail'])\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '--co', '-m', 'gpu', 'tests/gpu', '-p', 'no:cacheprovider', '-rs']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ENV fail missing ['pyzmq', 'msgpack']: put their wheels in .whl/" in out.stdout
    n_cuda = sum(c.needs_cuda for c in CHECKS)
    assert f"{n_cuda} tests collected" in out.stdout and "needs pyzmq" in out.stdout
