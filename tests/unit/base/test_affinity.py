"""CPU-list parsing and pinning (cluster.cpu_affinity)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_async.base.affinity import check_available, parse_cpu_list


@pytest.mark.parametrize(
    "spec, cpus", [("0", {0}), ("3", {3}), ("0-3", {0, 1, 2, 3}), ("0,2,5-6", {0, 2, 5, 6}), (" 1 , 4-4 ", {1, 4})]
)
def test_parse_cpu_list(spec, cpus):
    assert parse_cpu_list(spec) == cpus


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "'' is not N or N-M"),
        ("a", "'a' is not N or N-M"),
        ("1,,2", "'' is not N or N-M"),
        ("-1", "'-1' is not N or N-M"),
        ("3-1", "range '3-1' runs backwards"),
        ("1-", "'1-' is not N or N-M"),
    ],
)
def test_bad_cpu_lists_name_the_bad_part(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_cpu_list(spec)


def test_cpus_this_process_may_not_use_are_refused():
    allowed = sorted(os.sched_getaffinity(0))
    assert check_available(str(allowed[0])) == {allowed[0]}
    with pytest.raises(ValueError, match=r"CPU\(s\) \[100000\] are not available here"):
        check_available(f"{allowed[0]},100000")


def test_worker_entry_pins_itself_before_starting(tmp_path):
    """`python -m workers.X --cpus N` pins the process; a bad list fails before the worker runs.
    Run in tmp_path: the entry sets up the run directory's stack capture (``x/stacks/``)."""
    root = str(Path(__file__).resolve().parents[3])
    run = dict(capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": root})
    cpu = max(os.sched_getaffinity(0))
    code = (
        "import os, sys, workers.trainer; from workers._main import worker_args; "
        f"worker_args('trainer', ['--run-dir', 'x', '--cpus', '{cpu}']); "
        "print(sorted(os.sched_getaffinity(0))); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], **run)
    # pinned, and nothing heavy imported yet: the entry module imports its builder only after pinning
    assert out.returncode == 0 and out.stdout.split() == [f"[{cpu}]", "False"], out.stderr
    bad = subprocess.run([sys.executable, "-m", "workers.trainer", "--run-dir", "x", "--cpus", "0-"], **run)
    assert bad.returncode != 0 and "'0-' is not N or N-M" in bad.stderr
