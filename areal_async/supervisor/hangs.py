"""Capture the Python stacks of every worker before the step watchdog acts (``base/stacks.py``).

``capture_stacks(run_dir, pids, why)``: for each worker (a pid on this machine) that registered the
faulthandler (its ``SigCgt`` mask in ``/proc/<pid>/status`` has STACK_SIGNAL: a process that has not,
e.g. one still starting, would die of the signal, so it is left alone and reported as such), note
its process state and the size of its stacks file, send STACK_SIGNAL, and wait (at most
``wait_s``) until every signalled file grew and stopped growing. A process stopped by a signal
(state T: SIGSTOP, SIGTSTP) cannot run its handler: it is continued for the dump and stopped again,
so the dump shows where it stood. With ``py-spy`` on PATH each worker is also dumped by it (reads
the process from outside: native frames, no handler needed) into ``stacks/<worker>.py-spy.txt``.
One line per capture goes to ``RUN_DIR/hangs.jsonl``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from areal_async.base.stacks import HANGS_FILE, STACK_SIGNAL, stacks_path

PY_SPY_TIMEOUT_S = 10.0


def proc_state(pid: int) -> str:
    """The one-letter state of /proc/<pid>/stat (R, S, D, T, t, Z, ...), '?' when unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat[stat.rfind(")") + 2 :].split(" ", 1)[0]


def catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (bit sig-1 of SigCgt)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def file_size(path: Path) -> int:
    """Bytes in ``path``, 0 when it is missing."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _signal_one(run_dir: Path, wid: str, pid: int) -> dict:
    """Signal one worker for its dump; its hangs.jsonl entry."""
    state = proc_state(pid)
    entry = {"pid": pid, "state": state, "offset": file_size(stacks_path(run_dir, wid))}
    if state in ("?", "Z", "X"):
        return entry | {"dumped": False, "note": "not running"}
    if not catches(pid, STACK_SIGNAL):
        return entry | {"dumped": False, "note": "no stack handler registered (still starting?)"}
    try:
        os.kill(pid, STACK_SIGNAL)
        if state == "T":
            os.kill(pid, signal.SIGCONT)  # the pending dump runs now; stopped again once it is written
    except ProcessLookupError:
        return entry | {"dumped": False, "note": "gone"}
    return entry | {"dumped": True}


def _wait_for_dumps(run_dir: Path, entries: dict[str, dict], wait_s: float) -> None:
    """Until every signalled stacks file grew and then stayed the same size for 0.2 s (or wait_s)."""
    deadline, last, stable_since = time.monotonic() + wait_s, None, time.monotonic()
    while any(e["dumped"] for e in entries.values()) and time.monotonic() < deadline:
        sizes = {w: file_size(stacks_path(run_dir, w)) for w, e in entries.items() if e["dumped"]}
        grown = all(sizes[w] > entries[w]["offset"] for w in sizes)
        if sizes != last:
            last, stable_since = sizes, time.monotonic()
        elif grown and time.monotonic() - stable_since >= 0.2:
            return
        time.sleep(0.05)


def _stop_again(pid: int, wait_s: float = 1.0) -> None:
    """SIGSTOP a process continued for its dump, and wait (at most ``wait_s``) until it shows stopped."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while proc_state(pid) not in ("T", "?", "Z") and time.monotonic() < deadline:
        time.sleep(0.01)


def _py_spy(run_dir: Path, wid: str, pid: int) -> Optional[str]:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    out = run_dir / "stacks" / f"{wid}.py-spy.txt"
    try:
        res = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"py-spy failed: {e}"
    out.parent.mkdir(parents=True, exist_ok=True)  # a worker that never wrote its own stacks file has no folder yet
    out.write_text(res.stdout + res.stderr)
    return out.name if res.returncode == 0 else f"py-spy exited {res.returncode}: {res.stderr.strip()[:200]}"


def capture_stacks(run_dir: str | Path, pids: dict[str, int], why: str, wait_s: float = 10.0) -> dict:
    """Dump every worker's stacks into the run directory; the capture (also appended to hangs.jsonl)."""
    run_dir = Path(run_dir)
    entries = {wid: _signal_one(run_dir, wid, pid) for wid, pid in pids.items()}
    _wait_for_dumps(run_dir, entries, wait_s)
    for wid, e in entries.items():
        if e["state"] == "T" and e["dumped"]:
            _stop_again(e["pid"])
        e["bytes"] = file_size(stacks_path(run_dir, wid)) - e["offset"]
        if (spy := _py_spy(run_dir, wid, e["pid"])) is not None:
            e["py_spy"] = spy
    cap = {"t": time.time(), "why": why, "workers": entries}
    with open(run_dir / HANGS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(cap) + "\n")
    return cap
