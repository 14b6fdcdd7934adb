"""The test tiers (tests/README.md) hold: every test file sits in a tier (unit tests in the folder of a room of
``areal_async``), helpers hold no tests, base names are unique (pytest imports test files by base name), and CI
(``.ci/run``) runs every tier but gpu and names only must-run files that exist. A test file added to tests/ itself
would be run by the README's command but by no CI tier: this test fails first, naming it."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests"
FLAT_TIERS = {"contract", "e2e", "bench", "gpu"}


def rooms(package: Path) -> set[str]:
    """The rooms a unit test may live in: each subpackage of areal_async, and ``house`` for the package's
    whole-tree rules (import floors, docs, these tiers)."""
    return {p.name for p in package.iterdir() if (p / "__init__.py").exists()} | {"house"}


def misplaced(tests: Path, room_names: set[str]) -> list[str]:
    """Test files outside tests/unit/<room>/ and the flat tiers (a file in support/ or tests/ itself included)."""
    out = []
    for path in sorted(tests.rglob("test_*.py")):
        parts = path.relative_to(tests).parts
        unit_ok = len(parts) == 3 and parts[0] == "unit" and parts[1] in room_names
        if not (unit_ok or (len(parts) == 2 and parts[0] in FLAT_TIERS)):
            out.append(str(path.relative_to(tests.parent)))
    return out


def ci_tiers(script: str) -> list[str]:
    return re.search(r"^TIERS=\(([^)]*)\)", script, re.M).group(1).split()


def test_every_test_file_is_in_a_tier():
    assert misplaced(TESTS, rooms(ROOT / "areal_async")) == []


def test_test_file_base_names_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def ci_runs(script: str) -> list[list[str]]:
    """``.ci/run``'s RUNS: its pytest sessions, each a quoted list of tiers."""
    return [r.split() for r in re.findall(r'"([^"]*)"', re.search(r"^RUNS=\(([^)]*)\)", script, re.M).group(1))]


def test_ci_runs_every_tier_but_gpu_and_its_must_run_files_exist():
    script = (ROOT / ".ci" / "run").read_text()
    assert sorted(ci_tiers(script)) == sorted(f"tests/{t}" for t in ({"unit"} | FLAT_TIERS) - {"gpu"})
    runs = ci_runs(script)  # the sessions run every tier once, tests/unit first and alone (fail-fast)
    assert sorted(t for r in runs for t in r) == sorted(ci_tiers(script)) and runs[0] == ["tests/unit"]
    must = re.search(r"^MUST_RUN=\(([^)]*)\)", script, re.M).group(1).split()
    assert len(must) >= 3 and [m for m in must if not (ROOT / m).is_file()] == []
    # every file that importorskips at module level is a must-run one (its extra is installed here)
    whole = [str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py") if _skips_as_a_whole(p.read_text())]
    assert [w for w in whole if w not in must and not w.startswith("tests/gpu/")] == []


def _skips_as_a_whole(source: str) -> bool:
    """A module-level ``pytest.importorskip(...)`` or ``pytest.skip(..., allow_module_level=True)`` call (a
    statement of the module itself, read with ``ast``): the file skips at collection."""
    for node in ast.parse(source).body:
        call = node.value if isinstance(node, (ast.Expr, ast.Assign)) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            allow = any(k.arg == "allow_module_level" for k in call.keywords)
            if call.func.attr == "importorskip" or (call.func.attr == "skip" and allow):
                return True
    return False


def test_the_checks_catch_a_stray_file(tmp_path):
    """A hand-made tree: each misplaced file is named, the well-placed ones are not."""
    for rel in [
        "test_root.py",
        "support/test_helper.py",
        "unit/test_roomless.py",
        "unit/nowhere/test_x.py",
        "unit/trainer/deeper/test_y.py",
        "unit/trainer/test_ok.py",
        "e2e/test_ok2.py",
        "e2e/sub/test_z.py",
    ]:
        (tmp_path / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / rel).touch()
    assert misplaced(tmp_path / "tests", {"trainer", "house"}) == [
        "tests/e2e/sub/test_z.py",
        "tests/support/test_helper.py",
        "tests/test_root.py",
        "tests/unit/nowhere/test_x.py",
        "tests/unit/test_roomless.py",
        "tests/unit/trainer/deeper/test_y.py",
    ]
    assert ci_tiers("x=1\nTIERS=(tests/unit tests/e2e)\n") == ["tests/unit", "tests/e2e"]


def keyed(script: str, name: str) -> dict[str, str]:
    """A bash associative array of ``.ci/run`` (``declare -A NAME=([key]=value ["a key"]="a value")``)."""
    body = re.search(name + r"=\((.*?)\)$", script, re.M | re.S).group(1)
    return dict(re.findall(r'\["?([^]"]+)"?\]=("[^"]*"|\d+)', body))


def test_every_run_has_a_limit_and_together_they_fit_cis_hard_limit():
    """A hang fails CI in minutes, not at CI's 5400 s: each run of tiers (``RUNS``) has its own limit
    (``RUN_LIMIT_S``) and its xdist arguments, a test pytest-timeout's (pyproject.toml), which is shorter than any
    run's; the runs' limits with 20 minutes of set-up (vLLM's and TRL's environments made uncached) fit in CI's
    hard limit."""
    script = (ROOT / ".ci" / "run").read_text()
    limits = keyed(script, "RUN_LIMIT_S")
    runs = [" ".join(r) for r in ci_runs(script)]
    assert sorted(limits) == sorted(runs) and sorted(keyed(script, "XDIST_ARGS")) == sorted(runs)
    per_test = int(re.search(r"^timeout = (\d+)$", (ROOT / "pyproject.toml").read_text(), re.M).group(1))
    assert 0 < per_test < min(int(v) for v in limits.values())
    assert sum(int(v) for v in limits.values()) + 20 * 60 < 5400


HANGS_ONCE = """
import pathlib, time
def test_hangs_the_first_time():
    mark = pathlib.Path(__file__).with_name("ran")
    if not mark.exists():
        mark.write_text("")
        time.sleep(60)
def test_fails():
    assert 1 == 2
"""


def test_cis_rerun_takes_a_timed_out_test_once_more_and_no_other_failure(tmp_path):
    """The rerun flags of .ci/run against the installed pytest-timeout and pytest-rerunfailures, on a test that
    hangs once and one that fails: the hang (1 s limit here) is rerun and passes, the failure is not rerun."""
    import subprocess
    import sys

    script = (ROOT / ".ci" / "run").read_text()
    (pattern,) = re.findall(r'--only-rerun "([^"]+)"', script)
    assert re.search(r"--reruns 1\b", script)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_probe.py").write_text(HANGS_ONCE)
    args = ["-p", "no:cacheprovider", "-q", "-rR", "--timeout", "1", "--reruns", "1", "--only-rerun", pattern]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "test_probe.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    said = done.stdout[-2000:] + done.stderr[-2000:]  # stderr: an option no installed plugin knows is refused there
    assert (done.stdout.strip().splitlines() or [""])[-1].startswith("1 failed, 1 passed, 1 rerun"), said
    assert "RERUN test_probe.py::test_hangs_the_first_time" in done.stdout
    ini = (ROOT / "pyproject.toml").read_text()
    stacks_at = int(re.search(r"^faulthandler_timeout = (\d+)$", ini, re.M).group(1))
    assert 0 < stacks_at < int(re.search(r"^timeout = (\d+)$", ini, re.M).group(1))
