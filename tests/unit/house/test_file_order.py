"""The order CI hands test files to its xdist workers (tests/support/file_order.py): slowest file first by the
table's seconds, a file the table lacks at UNKNOWN_S, each file's tests in their own order; and the table read
from JUnit reports, summed per file."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.file_order import UNKNOWN_S, file_seconds, from_junit, slowest_first


def items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_the_slowest_file_goes_first_and_a_files_tests_keep_their_order():
    got = slowest_first(
        items("tests/a.py::t2", "tests/a.py::t1", "tests/b.py::t", "tests/c.py::t", "tests/d.py::t"),
        {"tests/a.py": 3.0, "tests/b.py": 10.0, "tests/d.py": 3.0},
    )
    assert UNKNOWN_S == 5.0  # c, unknown, sits between b (10 s) and a, d (3 s; a was collected first)
    assert [i.nodeid for i in got] == [
        "tests/b.py::t",
        "tests/c.py::t",
        "tests/a.py::t2",
        "tests/a.py::t1",
        "tests/d.py::t",
    ]


def test_the_table_sums_junit_seconds_per_file(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.e2e.test_x" name="a" time="1.5"/>'
        '<testcase classname="tests.e2e.test_x" name="b[1]" time="2.25"/>'
        '<testcase classname="tests.unit.app.test_y.TestK" name="c" time="0.5"/>'
        "</testsuite></testsuites>"
    )
    assert from_junit([str(report)]) == {"tests/e2e/test_x.py": 3.8, "tests/unit/app/test_y.py": 0.5}


def test_the_committed_table_knows_the_slow_files():
    """The table is a CI run's: its slowest files are the fleets' and servers' ones, in seconds of that run."""
    seconds = file_seconds()
    slowest = sorted(seconds, key=seconds.get, reverse=True)[:3]
    assert all(s.startswith(("tests/e2e/", "tests/contract/")) for s in slowest) and seconds[slowest[0]] > 60
