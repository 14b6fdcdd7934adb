"""``base.process.exit_without_teardown`` in a real process, against what the interpreter's own exit does with
the same program (``sys.exit``): the status, the non-daemon thread joined, the atexit handler run, the buffered
output written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = """
import atexit, sys, threading, time
from pathlib import Path
from areal_async.base.process import exit_without_teardown
out = Path(sys.argv[1])
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("joined"))).start()
atexit.register(lambda: (out / "atexit").write_text("ran"))
sys.stdout.write("buffered, no newline")
print("to stderr", file=sys.stderr, end="")
exit_without_teardown(300) if sys.argv[2] == "fast" else sys.exit(300)
"""


@pytest.mark.parametrize("how", ["interpreter", "fast"])
def test_what_the_interpreters_exit_does_is_done(tmp_path, how):
    out = tmp_path / how
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(out), how], capture_output=True, text=True, timeout=60)
    assert done.returncode == 300 & 0xFF == 44
    assert (done.stdout, done.stderr) == ("buffered, no newline", "to stderr")
    assert (out / "thread").read_text() == "joined" and (out / "atexit").read_text() == "ran"
    assert sorted(p.name for p in Path(out).iterdir()) == ["atexit", "thread"]
