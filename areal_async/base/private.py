"""Directories only this user may enter: run directories and checkpoints.

A checkpoint is code on resume: DCP's ``.metadata`` is a pickle (``torch.distributed.checkpoint``
unpickles it in ``dcp.load``), so whoever can write a run's checkpoint directory can run code as the
user who resumes it. ``private_dir`` creates (or re-modes) a directory 0700; ``check_private`` refuses
to load from a path that another user owns or that group or others may write.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory with mode 0700 (created with its parents; an existing one re-moded)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def check_private(path: str | Path, what: str) -> None:
    """Refuse (``PermissionError``) a ``path`` another user owns or group/others may write."""
    st = Path(path).stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{what} {str(path)!r} is owned by uid {st.st_uid}, not this user ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{what} {str(path)!r} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): refused "
            f"(checkpoint metadata is unpickled on load); make it private (chmod go-w) if you trust its contents"
        )
