"""Which checkpoints a root holds, which one a run resumes from, and pruning (torch-free).

The layout is ``checkpoint``'s: ``root/step_<k>/`` with a ``COMPLETE`` marker written last, temp
directories ``.tmp-step_<k>-<pid>`` / ``.trash-step_<k>-<pid>`` while saving. Only the file
system is read here, so the supervisor can decide what to resume without importing torch.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """``step_<k>`` directories holding ``COMPLETE``, oldest (smallest k) first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and p.is_dir() and (p / COMPLETE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_complete_checkpoint(root: str | Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def checkpoint_to_resume(root: str | Path, mode: str) -> Optional[Path]:
    """The checkpoint a run resumes from per ``recover.mode``: None for 'disabled'; the newest
    complete one for 'auto' (None if there is none) and 'resume' (ValueError if there is none)."""
    if mode == "disabled":
        return None
    latest = latest_complete_checkpoint(root)
    if latest is None and mode == "resume":
        raise ValueError(f"recover.mode=resume but {root} holds no complete checkpoint")
    return latest


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, plus leftovers: incomplete
    ``step_<k>`` older than the newest complete one and temp dirs of other (crashed) processes.
    Returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: expected an integer >= 1")
    root = Path(root)
    complete = complete_checkpoints(root)
    doomed = complete[:-keep_last]
    newest = int(STEP_DIR.match(complete[-1].name).group(1)) if complete else None
    for p in root.iterdir() if root.is_dir() else []:
        m = STEP_DIR.match(p.name)
        if m and newest is not None and p not in complete and int(m.group(1)) < newest:
            doomed.append(p)  # a crashed save: superseded by a newer complete checkpoint
        elif p.name.startswith((".tmp-", ".trash-")) and not p.name.endswith(f"-{os.getpid()}"):
            doomed.append(p)  # single writer per root: another pid's temp dir is a crash's leftover
    for p in doomed:
        shutil.rmtree(p)
    return doomed
