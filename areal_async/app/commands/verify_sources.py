"""What ``areal-async verify`` reads (``app/commands/verify.py`` lists the sources): the run directory's books and
the other processes' records, parsed once into ``Sources``. A source that is missing, a line that is not
JSON, or a record that lacks a field the checks compare is a ``source`` problem: nothing missing passes
as agreement."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from areal_async.base.eta import EtaError, EtaMode
from areal_async.base.records import REWARD_DIR, ROLLOUT_DIR, TRAINER_STEPS, read_jsonl

RESUMES = "resumes.json"
STEP_FIELDS = ("ids", "vmin", "vmax", "n_tokens", "n_out", "n_prompt", "scores")  # per sample, in a step line


@dataclass(frozen=True)
class Problem:
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class Made:
    """One production of a sample: its rollout worker's group line."""

    vmin: int
    vmax: int
    n_out: int
    n_prompt: Optional[int]
    n_loss: Optional[int]  # trained tokens where a loss mask leaves some untrained (a workflow's episode)
    worker: str
    digest: Optional[str] = None  # its output ids' token_digest (None: a record written before it was)


@dataclass
class Sources:
    books: list[dict]
    summary: dict
    steps: list[dict]
    duplicates: list[dict]
    rollout: dict[str, list[dict]]  # worker -> its record's lines, in order (start, loaded, group)
    produced: dict[str, list[Made]]
    scored: dict[str, list[tuple[float, str, str]]]  # id -> [(score, status, worker)]
    starts: list[dict]  # resumes.json's starts
    eta: Optional[int]
    metrics: list[dict]  # metrics.jsonl's step rows (not the evaluator's)


NEED = {
    "trajectories.jsonl": "the scheduler's books per sample",
    "metrics.jsonl": "the scheduler's books per step",
    RESUMES: "the scheduler's starts",
    TRAINER_STEPS: "the trainer's record",
}


def load(run_dir: Path, problems: list[Problem], counts: dict, eta: Optional[int]) -> Optional[Sources]:
    """The sources of ``run_dir``, or None (each missing one a problem) when any is missing."""
    missing = [f"{name} ({why})" for name, why in NEED.items() if not (run_dir / name).exists()]
    rollouts = sorted((run_dir / ROLLOUT_DIR).glob("*.jsonl"))
    rewards = sorted((run_dir / REWARD_DIR).glob("*.jsonl"))
    if not rollouts:
        missing.append(f"{ROLLOUT_DIR}/*.jsonl (the rollout workers' records)")
    if not rewards:
        missing.append(f"{REWARD_DIR}/*.jsonl (the reward workers' records)")
    if missing:
        problems += [Problem("source", f"{run_dir} has no {m}") for m in missing]
        return None
    trainer = _read(run_dir / TRAINER_STEPS, problems)
    steps = [r for r in trainer if r.get("kind") == "step"]
    _check_step_fields(steps, problems)
    rollout = {p.stem: _read(p, problems) for p in rollouts}
    counts.update(rollout_workers=len(rollouts), reward_records=len(rewards), eta=_eta(run_dir, eta, problems))
    return Sources(
        books=_read(run_dir / "trajectories.jsonl", problems),
        summary=_summary(run_dir, problems),
        steps=steps,
        duplicates=[r for r in trainer if r.get("kind") == "duplicate"],
        rollout=rollout,
        produced=_produced(rollout),
        scored=_scored(rewards, problems),
        starts=_starts(run_dir, problems),
        eta=counts["eta"],
        metrics=[r for r in _read(run_dir / "metrics.jsonl", problems) if "kind" not in r],
    )


def _read(path: Path, problems: list[Problem]) -> list[dict]:
    rows, bad = read_jsonl(path)
    problems += [Problem("source", b) for b in bad]
    return rows


def _summary(run_dir: Path, problems: list[Problem]) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    if not summary:
        problems.append(Problem("source", f"{run_dir} has no summary.json: the run did not finish"))
    return summary


def _check_step_fields(steps: list[dict], problems: list[Problem]) -> None:
    """Every step line carries each per-sample field, one entry per id (the first that does not: a problem)."""
    for r in steps:
        lacks = [f for f in STEP_FIELDS if not isinstance(r.get(f), list) or len(r[f]) != len(r.get("ids", ()))]
        if lacks:
            problems.append(
                Problem(
                    "source",
                    f"{TRAINER_STEPS}: step {r.get('step')} lacks {', '.join(lacks)} (one per sample id); "
                    "a record written before these were recorded cannot be compared",
                )
            )
            return


def _produced(rollout: dict[str, list[dict]]) -> dict[str, list[Made]]:
    out: dict[str, list[Made]] = defaultdict(list)
    for worker, lines in rollout.items():
        for g in lines:
            if g.get("kind", "group") != "group":
                continue
            n_loss = g.get("n_loss") or [None] * len(g["ids"])
            digests = g.get("tok_digest") or [None] * len(g["ids"])
            for sid, lo, hi, n, nl, d in zip(g["ids"], g["vmin"], g["vmax"], g["n_tokens"], n_loss, digests):
                out[sid].append(Made(lo, hi, n, g.get("n_prompt"), nl, worker, d))
    return dict(out)


def _scored(paths: list[Path], problems: list[Problem]) -> dict[str, list[tuple[float, str, str]]]:
    out: dict[str, list] = defaultdict(list)
    for path in paths:
        for g in _read(path, problems):
            for sid, score, status in zip(g["ids"], g["scores"], g["statuses"]):
                out[sid].append((float(score), status, path.stem))
    return dict(out)


def _starts(run_dir: Path, problems: list[Problem]) -> list[dict]:
    try:
        starts = json.loads((run_dir / RESUMES).read_text())["starts"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        problems.append(
            Problem("source", f"{run_dir}/{RESUMES} records no starts ({type(e).__name__}: {e}): no rollback is known")
        )
        return []
    return list(starts)


def _eta(run_dir: Path, eta: Optional[int], problems: list[Problem]) -> Optional[int]:
    if eta is not None:
        return eta
    try:  # read as every reader reads it (base/eta.py)
        return EtaMode.of_mapping(yaml.safe_load((run_dir / "config.yaml").read_text())).eta
    except (OSError, EtaError, yaml.YAMLError) as e:
        problems.append(Problem("source", f"{run_dir}/config.yaml gives no rollout.max_head_offpolicyness ({e})"))
        return None
