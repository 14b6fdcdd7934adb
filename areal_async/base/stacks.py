"""Python stacks of a hung fleet, captured into the run directory (hang capture).

Worker side: ``register_stack_dump(run_dir, worker_id)`` (every worker entry point calls it first)
registers ``faulthandler`` on ``STACK_SIGNAL`` (SIGUSR2): on that signal the interpreter writes the
stack of every thread to ``RUN_DIR/stacks/<worker>.txt`` (appended), from the signal handler
itself, so a worker blocked in C code or holding the GIL still answers.

Supervisor side (``supervisor/hangs.py``): before the step watchdog acts it signals each worker that
registered the handler and appends one line to ``RUN_DIR/hangs.jsonl``: why, when, and per worker
its pid, its process state and where its dump starts in its stacks file. ``read_hangs`` gives the
captures back with each worker's dump text (what ``areal-async doctor`` shows).
"""

from __future__ import annotations

import faulthandler
import json
import signal
from pathlib import Path
from typing import Optional

STACK_SIGNAL = signal.SIGUSR2
STACKS_DIR = "stacks"
HANGS_FILE = "hangs.jsonl"
_open_files: list = []  # faulthandler writes to these until the process ends: keep them open


def stacks_path(run_dir: str | Path, worker_id: str) -> Path:
    return Path(run_dir) / STACKS_DIR / f"{worker_id}.txt"


def register_stack_dump(run_dir: str | Path, worker_id: str) -> Optional[Path]:
    """On STACK_SIGNAL, every thread's stack goes to ``stacks/<worker_id>.txt``; None (nothing
    registered, the signal keeps its default) when the file cannot be opened."""
    path = stacks_path(run_dir, worker_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a", encoding="utf-8")
    except OSError:
        return None
    _open_files.append(f)
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
    return path


def read_hangs(run_dir: str | Path) -> list[dict]:
    """The captures of ``hangs.jsonl``, each worker's entry with ``stacks``: the text its handler
    wrote for that capture (from its offset to the next capture's, or the end of the file)."""
    run_dir = Path(run_dir)
    try:
        lines = (run_dir / HANGS_FILE).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    caps = []
    for line in lines:
        try:
            caps.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a capture cut short by a crash: the others still count
    for i, cap in enumerate(caps):
        for wid, w in cap.get("workers", {}).items():
            later = [c["workers"][wid].get("offset") for c in caps[i + 1 :] if wid in c.get("workers", {})]
            w["stacks"] = _slice(stacks_path(run_dir, wid), w.get("offset"), next((o for o in later if o), None))
    return caps


def _slice(path: Path, start: Optional[int], end: Optional[int]) -> str:
    if start is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
    except OSError:
        return ""
    return data.decode(errors="replace")
