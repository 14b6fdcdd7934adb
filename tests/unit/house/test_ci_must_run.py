"""Under CI (``.ci/run`` sets ``AREAL_MUST_RUN``), a skip in a must-run test file is a failure that says
why it skipped; elsewhere it stays a skip. Checked on a real pytest run of a file with one skipping test."""

from __future__ import annotations

from tests.conftest import MUST_RUN_ENV, must_run

pytest_plugins = ["pytester"]

SKIPPING = """
import pytest

def test_needs_a_tool():
    pytest.skip("no such tool here")

def test_runs():
    assert 1 + 1 == 2
"""


def _pytest(pytester, monkeypatch, must: str):
    pytester.makepyfile(test_tool=SKIPPING)
    monkeypatch.setenv(MUST_RUN_ENV, must)
    plugins = ["-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:asyncio"]
    return pytester.runpytest_inprocess("-q", "-rs", *plugins)


def test_a_skip_in_a_must_run_file_fails_naming_its_reason(pytester, monkeypatch):
    free = _pytest(pytester, monkeypatch, "")
    free.assert_outcomes(passed=1, skipped=1)
    ci = _pytest(pytester, monkeypatch, "tests/test_other.py, test_tool.py")
    ci.assert_outcomes(passed=1, failed=1)
    ci.stdout.fnmatch_lines([f"*test_tool.py::test_needs_a_tool skipped, but {MUST_RUN_ENV} says it must run here*"])
    ci.stdout.fnmatch_lines(["*no such tool here*"])


def test_must_run_matches_whole_files_only():
    env = "tests/e2e/test_slurm.py,tests/contract/test_sglang_contract.py"
    assert must_run("tests/e2e/test_slurm.py::test_tiny_fleet_runs_as_srun_steps_of_a_real_slurm_job", env)
    assert must_run("tests/contract/test_sglang_contract.py::test_schema_refuses_what_sglang_would_refuse", env)
    assert not must_run("tests/test_slurm_extra.py::test_x", env)
    assert not must_run("tests/e2e/test_e2e.py::test_x", env) and not must_run("tests/e2e/test_slurm.py::t", "")
