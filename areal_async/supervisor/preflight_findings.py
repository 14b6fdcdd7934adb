"""What a preflight check reports: a ``Finding`` (ok / warn / error, one line) and the context checks share.

A finding's line is ``<key>=<value>: <what is wrong or found>; <what to do>``; the CLI prints an
error as ``areal-async: <line>`` and exits 2. ``detail`` keeps the full text (a traceback) for
``--debug``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from areal_async.config import ExperimentConfig

LEVELS = ("ok", "warn", "error")


@dataclass(frozen=True)
class Finding:
    level: str  # ok | warn | error
    key: str  # the dotted config key (or --run-dir) it is about
    line: str  # "<key>=<value>: <what>[; <what to do>]"
    detail: str = ""  # a traceback, for --debug


def finding(level: str, key: str, value: Any, what: str, todo: str = "", detail: str = "") -> Finding:
    """A finding about ``key=value``; ``todo`` says what to do (errors and warnings)."""
    line = f"{key}={shown(value)}: {what}" + (f"; {todo}" if todo else "")
    return Finding(level, key, line, detail)


def ok(key: str, value: Any, what: str) -> Finding:
    return finding("ok", key, value, what)


def error(key: str, value: Any, what: str, todo: str, exc: Optional[BaseException] = None) -> Finding:
    return finding("error", key, value, what, todo, _trace(exc))


def warn(key: str, value: Any, what: str, todo: str) -> Finding:
    return finding("warn", key, value, what, todo)


def shown(value: Any) -> str:
    """A value as the config errors show it (``repr``), long ones cut."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: message`` of an exception, on one line; the hub's repo-id wording never reaches the user
    (the preflight looks at local directories only)."""
    msg = " ".join(str(exc).split())
    if "Repo id must be" in msg or "repo_name" in msg:
        msg = "not a loadable local directory"
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def size_text(n: float) -> str:
    """Bytes in B / KiB / MiB / GiB / TiB, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _trace(exc: Optional[BaseException]) -> str:
    return "".join(traceback.format_exception(exc)) if exc is not None else ""


@dataclass
class Context:
    """What the checks read and what they hand to later checks."""

    cfg: ExperimentConfig
    cmd: str = "run"  # run | sft
    run_dir: Path = Path("runs/preflight")
    from_file: frozenset = frozenset()  # dotted leaf keys the YAML preset sets
    from_overrides: frozenset = frozenset()  # dotted leaf keys the command line sets
    gpus_here: Optional[int] = None  # GPUs of this machine; None = count them (/dev/nvidia*)
    tokenizer: Any = None  # set by the model check
    first_prompt: Optional[str] = None  # set by the dataset check
    texts: dict = field(default_factory=dict)  # reasoning_gym: task -> prompts and answers the tokenizer must say
    placement: dict = field(default_factory=dict)  # worker id -> Slot, set by the placement check
    loads: dict = field(default_factory=dict)  # role -> what it will load
