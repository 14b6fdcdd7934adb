"""The order pytest-xdist hands test files to its workers (``--dist loadfile --no-loadscope-reorder``): the
slowest first, by the seconds each file took in a CI run (``data/file_seconds.json``), so that the two
workers finish together instead of one running the last long file alone. A file the table does not know
counts as ``UNKNOWN_S`` (it runs among the short ones). Within a file the order is the file's own.

Refresh the table from a CI run's JUnit reports (``pytest --junitxml``): ``python -m tests.support.file_order
REPORT.xml ...`` (each test's setup, call and teardown seconds, summed per file). Today's: a cold fresh-clone
``.ci/run`` on this 2-core machine, tier by tier (2026-12-07, at cd9d75f)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).parent / "data" / "file_seconds.json"
UNKNOWN_S = 5.0


def file_seconds() -> dict[str, float]:
    return json.loads(TABLE.read_text())["seconds"]


def slowest_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` (pytest items, each with a ``nodeid``) regrouped by file, the slowest file first; ties and
    unknown files keep their collection order, and so do the tests of one file."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)
    key = lambda item: (  # noqa: E731
        -seconds.get(item.nodeid.split("::", 1)[0], UNKNOWN_S),
        first[item.nodeid.split("::", 1)[0]],
    )
    return sorted(items, key=key)


def from_junit(paths: list[str]) -> dict[str, float]:
    """Seconds per test file (``tests/e2e/test_x.py``) summed from pytest's JUnit XML reports."""
    out: dict[str, float] = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")  # tests.e2e.test_x[.TestClass]
            at = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
            name = "/".join(parts[: at + 1]) + ".py" if at is not None else ""
            if name.startswith("tests/"):
                out[name] = out.get(name, 0.0) + float(case.get("time", 0))
    return dict(sorted((k, round(v, 1)) for k, v in out.items()))


if __name__ == "__main__":
    reports = [Path(p).name for p in sys.argv[1:]]
    TABLE.write_text(json.dumps({"from": reports, "seconds": from_junit(sys.argv[1:])}, indent=1) + "\n")
    print(f"{TABLE}: {len(file_seconds())} files")
