"""Under CI (``.ci/run`` sets ``AREAL_MUST_RUN``), a skip in a must-run test file is a failure that says
why it skipped, whether one test skips or the whole file at collection; elsewhere it stays a skip. And a tier
whose skips differ in number from ``EXPECTED_SKIPS`` (``AREAL_EXPECT_SKIPS`` names the tier) fails, listing
them. Checked on real pytest runs of small files."""

from __future__ import annotations

import pytest

from tests import conftest
from tests.conftest import MUST_RUN_ENV, SKIPS_ENV, must_run

pytest_plugins = ["pytester"]

SKIPPING = """
import pytest

def test_needs_a_tool():
    pytest.skip("no such tool here")

def test_runs():
    assert 1 + 1 == 2
"""


WHOLE_FILE = """
import pytest

pytest.importorskip("a_module_nobody_installed")

def test_never_collected():
    assert False
"""


def _pytest(pytester, monkeypatch, must: str, source: str = SKIPPING, tier: str = "", args: tuple = ()):
    """pytest on ``test_tool.py`` (``source``); ``tier``: AREAL_EXPECT_SKIPS; ``args``: the paths run (a tier's
    run names its folder: here ``tests/unit`` holds the file, as CI's tier holds its tests)."""
    path = pytester.mkpydir("tests") / "unit" / "test_tool.py" if args else None
    if path is not None:
        path.parent.mkdir()
        path.write_text(source)
    else:
        pytester.makepyfile(test_tool=source)
    monkeypatch.setenv(MUST_RUN_ENV, must)
    monkeypatch.setenv(SKIPS_ENV, tier)
    plugins = ["-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:asyncio"]
    return pytester.runpytest_inprocess("-q", "-rs", *plugins, *args)


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


def test_a_must_run_file_that_skips_at_collection_is_an_error_naming_its_reason(pytester, monkeypatch):
    free = _pytest(pytester, monkeypatch, "", WHOLE_FILE)
    free.assert_outcomes(skipped=1)
    ci = _pytest(pytester, monkeypatch, "test_tool.py", WHOLE_FILE)
    ci.assert_outcomes(errors=1)
    ci.stdout.fnmatch_lines([f"*test_tool.py skipped as a whole, but {MUST_RUN_ENV} says it must run here*"])
    ci.stdout.fnmatch_lines(["*could not import 'a_module_nobody_installed'*"])
    assert ci.ret != 0


@pytest.mark.parametrize("pinned, ok", [(1, True), (0, False), (2, False)])
def test_a_tier_fails_when_its_skips_differ_from_the_pinned_count_and_lists_them(pytester, monkeypatch, pinned, ok):
    monkeypatch.setitem(conftest.EXPECTED_SKIPS, "tests/unit", pinned)
    run = _pytest(pytester, monkeypatch, "", tier="tests/unit", args=("tests/unit",))
    run.assert_outcomes(passed=1, skipped=1)  # the tests' own outcomes are as they were
    assert (run.ret == 0) == ok
    if ok:
        run.stdout.fnmatch_lines([f"{SKIPS_ENV}: tests/unit: 1 skip(s), as EXPECTED_SKIPS (tests/conftest.py) pins"])
    else:
        run.stdout.fnmatch_lines(
            [
                f"{SKIPS_ENV}: tests/unit: 1 skip(s), EXPECTED_SKIPS (tests/conftest.py) pins {pinned}",
                "  skipped: tests/unit/test_tool.py::test_needs_a_tool: *no such tool here*",
            ]
        )


def test_tiers_run_together_are_each_held_to_their_own_count(pytester, monkeypatch):
    """``.ci/run`` runs bench, contract and e2e in one session: AREAL_EXPECT_SKIPS names the three, and each
    tier's skips (those under its folder) are held to its own pin. Here tests/unit holds the one skip and
    tests/bench a passing test: unit pinned 1 and bench 0 pass; bench pinned 1 fails, naming bench alone."""
    (pytester.mkpydir("tests") / "bench").mkdir()
    (pytester.path / "tests" / "bench" / "test_fine.py").write_text("def test_fine():\n    pass\n")
    for unit, bench, ok in ((1, 0, True), (1, 1, False)):
        monkeypatch.setitem(conftest.EXPECTED_SKIPS, "tests/unit", unit)
        monkeypatch.setitem(conftest.EXPECTED_SKIPS, "tests/bench", bench)
        path = pytester.path / "tests" / "unit" / "test_tool.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(SKIPPING)
        monkeypatch.setenv(MUST_RUN_ENV, "")
        monkeypatch.setenv(SKIPS_ENV, "tests/unit tests/bench")
        plugins = ["-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:asyncio"]
        run = pytester.runpytest_inprocess("-q", "-rs", *plugins, "tests/unit", "tests/bench")
        run.assert_outcomes(passed=2, skipped=1)
        assert (run.ret == 0) == ok
        run.stdout.fnmatch_lines([f"{SKIPS_ENV}: tests/unit: 1 skip(s), as EXPECTED_SKIPS (tests/conftest.py) pins"])
        if ok:
            run.stdout.fnmatch_lines(
                [f"{SKIPS_ENV}: tests/bench: 0 skip(s), as EXPECTED_SKIPS (tests/conftest.py) pins"]
            )
        else:
            run.stdout.fnmatch_lines(
                [f"{SKIPS_ENV}: tests/bench: 0 skip(s), EXPECTED_SKIPS (tests/conftest.py) pins 1"]
            )


def test_a_whole_files_skip_counts(pytester, monkeypatch):
    monkeypatch.setitem(conftest.EXPECTED_SKIPS, "tests/unit", 0)
    whole = _pytest(pytester, monkeypatch, "", WHOLE_FILE, tier="tests/unit", args=("tests/unit",))
    assert whole.ret != 0
    whole.stdout.fnmatch_lines(["  skipped: tests/unit/test_tool.py (whole file): *a_module_nobody_installed*"])


def test_a_pytest_of_other_paths_is_not_checked(pytester, monkeypatch):
    """A pytest started inside a tier's test (it inherits the environment) runs other paths: no check."""
    monkeypatch.setitem(conftest.EXPECTED_SKIPS, "tests/bench", 0)
    other = _pytest(pytester, monkeypatch, "", tier="tests/bench")
    other.assert_outcomes(passed=1, skipped=1)
    assert other.ret == 0 and SKIPS_ENV not in other.stdout.str()


def test_the_pinned_counts_name_the_ci_tiers():
    from tests.unit.house.test_tiers import ROOT, ci_tiers

    assert sorted(conftest.EXPECTED_SKIPS) == sorted(ci_tiers((ROOT / ".ci" / "run").read_text()))
