"""``areal-async ARGS`` run in the test's own process (``areal_async.cli.main``): the same exit code, stdout and
stderr as the console script, without a fresh interpreter and its imports (~1.7 s of CPU each). For tests of what
a command decides and prints; the entry point as a real process is tests/unit/house/test_import_floors.py's
(``--help``, ``knobs``, ``--dry-run`` in a fresh interpreter) and every e2e test's."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from areal_async.cli import main

ROOT = Path(__file__).resolve().parents[2]


def exit_code(e: SystemExit) -> int:
    """What the interpreter would exit with for ``raise SystemExit(e.code)``."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    return 1  # a message: printed to stderr, exit 1


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*args)`` -> a CompletedProcess (returncode, stdout, stderr), run from the repository root."""
    monkeypatch.chdir(ROOT)

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()  # what the test printed before is not the command's
        muted = logging.root.manager.disable  # a command may mute logging for its process (check-plugin does)
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's refusals (exit 2) and any sys.exit inside a command
            code = exit_code(e)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        finally:
            logging.disable(muted)  # its process ends here: later tests log as before
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["areal-async", *args], code, out, err)

    return run
