"""The GPU check runner (benchmarks.gpu_check, scripts/gpu_check.sh) on this CPU machine: one JSON line per
registered check, CUDA checks "skipped: no CUDA", the others pass, exit 0; a failing, raising, hanging or
malformed check is reported as failed and makes the exit status non-zero."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path


from benchmarks.gpu_check import registry
from benchmarks.gpu_check.registry import CHECKS, Check, run_all, run_check

ROOT = Path(__file__).resolve().parents[2]


def bare_box(tmp_path: Path) -> dict:
    """The environment of a bare GPU box: pyzmq and msgpack absent in every interpreter started with it (a
    sitecustomize on PYTHONPATH, so the checks' spawned children have neither either), no .whl/ to unpack."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['zmq'] = sys.modules['msgpack'] = None\n")
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": f"{tmp_path}:{ROOT}", "WHL": str(tmp_path / "none")}


def test_gpu_check_sh_on_a_bare_cpu_box_skips_cuda_checks_and_passes_the_rest(tmp_path):
    """Issue 36: no pyzmq, no msgpack, nothing carried: exit 0, one line per check, CUDA checks "skipped: no
    CUDA", the others pass (main: every check failed on an import it does not use)."""
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=bare_box(tmp_path), capture_output=True, text=True, timeout=300
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["name"] for r in rows] == [c.name for c in CHECKS] and len(rows) >= 12
    for row, check in zip(rows, CHECKS):
        assert set(row) == {"name", "status", "detail", "seconds", "data"}
        if check.needs_cuda:
            assert (row["status"], row["detail"]) == ("skipped", "skipped: no CUDA"), row
        else:
            assert row["status"] == "pass", row
    assert rows[0]["data"]["missing"] == ["pyzmq", "msgpack"]
    assert rows[0]["data"]["skip_for_them"] == ["nccl_run_store", "one_gpu_run"]
    assert sum(r["seconds"] for r in rows) < 8 * 60


TWINS = [c.name for c in CHECKS if c.cpu_twin and c.needs_cuda and "zmq" not in c.needs]


def test_the_cpu_twins_pass_on_a_bare_box(tmp_path):
    """Every CUDA check with a CPU twin runs it here, in one process, with pyzmq and msgpack absent: the
    GPU code they drive imports neither. The two that need them say so (the run's store, a fleet)."""
    only = TWINS + ["nccl_run_store", "one_gpu_run"]
    argv = [sys.executable, "-m", "benchmarks.gpu_check", "--cpu-twins", "--in-process", "--only", ",".join(only)]
    proc = subprocess.run(argv, cwd=ROOT, env=bare_box(tmp_path), capture_output=True, text=True, timeout=600)
    rows = {r["name"]: r for r in map(json.loads, (x for x in proc.stdout.splitlines() if x.startswith("{")))}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(TWINS) >= {"nccl_group_loopback", "nccl_weight_publish", "engine_decode_vs_hf", "fsdp2_lora_step"}
    assert [rows[n]["status"] for n in TWINS] == ["pass"] * len(TWINS), {n: rows[n]["detail"] for n in TWINS}
    for n in ("nccl_run_store", "one_gpu_run"):
        assert (rows[n]["status"], rows[n]["detail"]) == ("skipped", "skipped: pyzmq missing")


def test_the_run_store_twin_passes_where_pyzmq_is():
    [check] = [c for c in CHECKS if c.name == "nccl_run_store"]
    row = run_check(check, cuda=False, cpu_twins=True, in_process=True)
    assert row["status"] == "pass" and row["data"]["buckets"] == 4, row


GPU_CODE_CHECKS = sorted({c.target.split(":")[0] for c in CHECKS if not c.needs})


def test_the_gpu_code_checks_import_neither_pyzmq_nor_msgpack():
    """``python3 -X importtime`` of every check module that needs neither: no zmq, no msgpack line."""
    code = "; ".join(f"import benchmarks.gpu_check.{m}" for m in GPU_CODE_CHECKS)
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    names = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "benchmarks.gpu_check.fsdp_checks" in names and "areal_async.transport.nccl" in names
    assert [n for n in names if n.split(".")[0] in ("zmq", "msgpack")] == []


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


def test_a_spent_budget_fails_only_the_checks_that_would_have_run(monkeypatch, capsys):
    """After the budget, a check this box would skip anyway (no CUDA; no vLLM environment) is still "skipped",
    not a failure that sets the exit status of a healthy box (main: every one after the budget failed)."""
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    vllm = Check("needs_vllm", "tests.support.gpu_check_fixtures:fails", False, needs=("vllm",))
    gpu_only = Check("gpu_only", "tests.support.gpu_check_fixtures:fails", True)
    rows = run_all([gpu_only, vllm, _bad("fails")], cuda=False, budget_s=0)
    capsys.readouterr()
    want_vllm = "skipped: no CUDA vLLM environment (set VLLM_PYTHON)"
    if importlib.util.find_spec("vllm") is not None:  # a vLLM in this interpreter counts as the environment
        want_vllm = "not run: the 0 s budget is spent"
    assert [r["detail"] for r in rows] == ["skipped: no CUDA", want_vllm, "not run: the 0 s budget is spent"]
    assert [r["status"] for r in rows] == ["skipped", "fail" if want_vllm.startswith("not") else "skipped", "fail"]


def test_main_exit_status(monkeypatch, capsys):
    monkeypatch.setattr(registry, "CHECKS", [_bad("fails")])
    assert registry.main([]) == 1
    assert registry.main(["--only", "nope"]) == 2
    monkeypatch.setattr(registry, "CHECKS", [Check("gpu_only", "tests.support.gpu_check_fixtures:fails", True)])
    assert registry.main([]) == 0  # skipped is not failed
    capsys.readouterr()


def test_without_pyzmq_and_msgpack_tests_gpu_still_collects():
    """The bare GPU box: the runner imports, and tests/gpu still collects (the gpu_check tests), the rest
    skipping saying why."""
    code = (
        "import sys\n"
        "sys.modules['zmq'] = sys.modules['msgpack'] = None  # import fails, find_spec says None: as if absent\n"
        "from benchmarks.gpu_check import registry\n"
        "row = registry.run_check(registry.CHECKS[0], cuda=False)\n"
        "print('ENV', row['status'], row['data']['missing'])\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '--co', '-m', 'gpu', 'tests/gpu', '-p', 'no:cacheprovider', '-rs']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ENV pass ['pyzmq', 'msgpack']" in out.stdout
    n_cuda = sum(c.needs_cuda for c in CHECKS)
    assert f"{n_cuda} tests collected" in out.stdout and "needs pyzmq" in out.stdout
