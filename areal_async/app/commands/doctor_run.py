"""What ``areal-async doctor`` reads from a run directory (live or finished), as plain data.

Every file is optional except metrics.jsonl or config.yaml (one of them says it is a run): a check
whose inputs are missing is skipped and says so. Nothing here imports torch, zmq or the config
classes (a run directory of another version still reads): config.yaml is read as a plain mapping.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from areal_async.base.eta import EtaError, EtaMode
from areal_async.base.manifest import ManifestError, RunManifest
from areal_async.base.stacks import read_hangs

RESTART_MARK = re.compile(r"^----- restarted by the supervisor \((\d+)/(\d+)\) -----$")


class DoctorError(ValueError):
    """Not a run directory (the message names what is missing)."""


@dataclass
class Restart:
    worker: str
    count: int
    last_lines: list[str]  # the dead incarnation's last log lines before the restart


@dataclass
class RunData:
    run_dir: Path
    cfg: dict
    rows: list[dict]  # metrics.jsonl's step rows, in order (evaluation rows left out)
    trajectories: list[dict]  # trajectories.jsonl (every run; older runs without rollout.dump_to_file lack it)
    reward_samples: list[dict]  # reward_samples/*.jsonl (reward/samples.py)
    summary: Optional[dict]
    status: Optional[dict]  # the scheduler's status.json (a live or stopped-mid-run fleet)
    status_age_s: Optional[float]
    lost: list[dict]
    hangs: list[dict]  # hangs.jsonl with each worker's stacks (base/stacks.py)
    restarts: list[Restart]
    recoveries: int
    resumed: bool  # metrics.rolled_back.jsonl: the books were cut back to a checkpoint at least once
    notes: list[str] = field(default_factory=list)  # lines that could not be read

    def get(self, dotted: str, default: Any = None) -> Any:
        """A config value by dotted key (``rollout.max_head_offpolicyness``), ``default`` when absent."""
        node: Any = self.cfg
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def eta(self) -> Optional[int]:
        """η as every reader takes it (``EtaMode.of_mapping``, base/eta.py); None when the config gives none."""
        try:
            return EtaMode.of_mapping(self.cfg).eta
        except EtaError:
            return None

    def series(self, key: str, rows: Optional[list[dict]] = None) -> list[float]:
        """``key`` of every row that has it (finite numbers only)."""
        out = []
        for r in self.rows if rows is None else rows:
            v = r.get(key)
            if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
                out.append(float(v))
        return out


def read_jsonl(path: Path, notes: list[str]) -> list[dict]:
    """The objects of a jsonl file ([] when absent); a line that is not an object is noted and skipped
    (a live run's last line may be half written)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            notes.append(f"{path.name}:{n}: not JSON, skipped")
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _read_json(path: Path) -> Optional[dict]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _read_cfg(run_dir: Path, notes: list[str]) -> dict:
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    except OSError:
        return {}
    except yaml.YAMLError as e:
        notes.append(f"config.yaml: not YAML ({e}); config values taken as unknown")
        return {}
    return cfg if isinstance(cfg, dict) else {}


def read_restarts(logs: Path) -> list[Restart]:
    out = []
    for log in sorted(logs.glob("*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for i, line in enumerate(lines):
            m = RESTART_MARK.match(line.strip())
            if m:
                before = [x for x in lines[max(0, i - 6) : i] if x.strip()]
                out.append(Restart(log.stem, int(m.group(1)), before[-4:]))
    return out


def _manifest_recoveries(run_dir: Path, notes: list[str]) -> int:
    """The recoveries before the newest fleet, from its manifest (0 without one; a bad one is a note)."""
    try:
        return RunManifest.load(run_dir).recoveries
    except FileNotFoundError:
        return 0
    except (OSError, ManifestError) as e:
        notes.append(f"endpoints.json: {e}; recoveries taken from summary.json only")
        return 0


def read_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DoctorError(f"{run_dir} is not a directory")
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists():
        raise DoctorError(f"{run_dir} holds neither metrics.jsonl nor config.yaml: not a run directory")
    notes: list[str] = []
    status = _read_json(run_dir / "status.json")
    try:
        age = time.time() - (run_dir / "status.json").stat().st_mtime if status is not None else None
    except OSError:
        age = None
    summary = _read_json(run_dir / "summary.json")
    recoveries = max(int((summary or {}).get("recoveries", 0)), _manifest_recoveries(run_dir, notes))
    return RunData(
        run_dir=run_dir,
        cfg=_read_cfg(run_dir, notes),
        rows=[r for r in read_jsonl(run_dir / "metrics.jsonl", notes) if "kind" not in r and "step" in r],
        trajectories=read_jsonl(run_dir / "trajectories.jsonl", notes),
        reward_samples=[x for p in sorted((run_dir / "reward_samples").glob("*.jsonl")) for x in read_jsonl(p, notes)],
        summary=summary,
        status=status,
        status_age_s=age,
        lost=read_jsonl(run_dir / "lost.jsonl", notes),
        hangs=read_hangs(run_dir),
        restarts=read_restarts(run_dir / "logs"),
        recoveries=recoveries,
        resumed=(run_dir / "metrics.rolled_back.jsonl").exists(),
        notes=notes,
    )
