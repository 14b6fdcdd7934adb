"""``areal-async verify RUN_DIR``: the scheduler's books checked against the trainer's and the rollouts' own records.

Three sources, written by three kinds of process (formats: ``base/records.py``, ``scheduler/runlog.py``):

    scheduler  trajectories.jsonl      one line per sample as it ended: trained at step k, or aborted
               metrics.jsonl           one row per step: samples_trained
               summary.json            samples_lost
    trainer    trainer_steps.jsonl     per step: the ids it trained, each one's min/max token version
                                       read from the tensors it used, the ids whose optimizer step
                                       was skipped; ids that arrived twice at its buffer
    rollouts   rollout_records/*.jsonl per group produced: ids, min/max token version

Each disagreement is one ``Problem`` (kind, message):

    lost                 produced by a rollout (in the run's last resume epoch) and in no book;
                         or summary.json's samples_lost is not 0
    trained_twice        an id trained (optimizer step applied) in two steps
    trained_not_booked   trained at step k by the trainer's record; the books say otherwise
    booked_not_trained   booked trained at step k; the trainer's record of step k lacks it
    skipped_booked       booked trained at step k, but step k's optimizer step skipped its minibatch
    stale                a trained token's version < k - eta (eta: the run's config), from the tensors
    duplicate_at_buffer  an id arrived twice at the trainer's buffer (the copy was refused)
    not_produced         trained, but no rollout record holds the id
    version_mismatch     the versions the trainer trained differ from what the rollout produced or
                         from what the books say
    booked_twice         an id with two lines in trajectories.jsonl
    step_record          the trainer's record has a step twice, or its version is not step + 1
    step_count           metrics.jsonl's samples_trained of a step (or the step itself) differs from
                         the trainer's record
    source               a source is missing or has a line that is not JSON

A resumed run (in-run recovery or a rerun with recover.mode=auto) rolls the books back to its
checkpoint and issues ids with the prefix ``r<k>-`` (k: the scheduler's starts in the run
directory, ``RUN_DIR/resumes.json``, so no two attempts share an id). A sample of an earlier
epoch than the last one that is in no book was issued after that checkpoint (its prompt
re-issued under a new id): it is counted as ``rolled_back``, not lost. Not checked: that such a
sample really was issued after the checkpoint (the pruned checkpoints' ledgers would say).

``verify_run`` is the Python API (tests, ``benchmarks.faults``, ``benchmarks.soak``); the CLI
exits 0 when the sources agree, 1 naming each disagreement, 2 when RUN_DIR is not a directory.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from areal_async.base.records import ROLLOUT_DIR, TRAINER_STEPS, read_jsonl


@dataclass(frozen=True)
class Problem:
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass
class Report:
    run_dir: str
    problems: list[Problem] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    trained_per_step: dict[int, int] = field(default_factory=dict)  # from the trainer's record

    @property
    def ok(self) -> bool:
        return not self.problems

    def kinds(self) -> Counter:
        return Counter(p.kind for p in self.problems)

    def lines(self, per_kind: int = 0) -> list[str]:
        """One line per problem (at most ``per_kind`` of each kind, then how many more; 0: all)."""
        out, seen = [], Counter()
        for p in self.problems:
            seen[p.kind] += 1
            if not per_kind or seen[p.kind] <= per_kind:
                out.append(str(p))
        out += [f"{k}: ... and {n - per_kind} more" for k, n in seen.items() if per_kind and n > per_kind]
        return out

    def summary(self) -> str:
        c = self.counts
        head = "the three sources agree" if self.ok else f"{len(self.problems)} disagreement(s) {dict(self.kinds())}"
        return (
            f"{self.run_dir}: {head}: {c.get('steps', 0)} trainer steps, {c.get('trained', 0)} samples trained, "
            f"{c.get('booked_trained', 0)} booked trained, {c.get('booked_aborted', 0)} booked aborted, "
            f"{c.get('produced', 0)} produced by {c.get('rollout_workers', 0)} rollout worker(s), "
            f"{c.get('rolled_back', 0)} rolled back by {c.get('resumes', 0)} resume(s), "
            f"{c.get('skipped_steps', 0)} step(s) with a skipped optimizer step, eta {c.get('eta')}"
        )


@dataclass
class _Sources:
    books: list[dict]
    summary: dict
    steps: list[dict]
    duplicates: list[dict]
    produced: dict[str, list[tuple[int, int, int, str]]]  # id -> [(vmin, vmax, n_tokens, worker)]
    eta: Optional[int]
    metrics: list[dict]  # metrics.jsonl's step rows (not the evaluator's)


def verify_run(run_dir: str | Path, eta: Optional[int] = None) -> Report:
    """Check RUN_DIR's three sources against each other. ``eta``: the staleness bound (default:
    the run's ``rollout.max_head_offpolicyness`` from its config.yaml)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; expected a run directory")
    rep = Report(str(run_dir))
    src = _load(run_dir, rep, eta)
    if src is None:
        return rep
    trained, skipped = _trained_by_trainer(src, rep)
    _check_step_counts(src, rep)
    booked = _booked(src, rep)
    _compare_books_and_trainer(trained, skipped, booked, rep)
    _check_staleness(src, trained, rep)
    _check_production(src, trained, booked, rep)
    for d in src.duplicates:
        rep.problems.append(Problem("duplicate_at_buffer", d.get("message") or f"sample id {d.get('id')!r}"))
    lost = src.summary.get("samples_lost")
    if lost:
        rep.problems.append(Problem("lost", f"summary.json: samples_lost = {lost} (issued minus lines written)"))
    return rep


# ---- reading --------------------------------------------------------------------------------


def _load(run_dir: Path, rep: Report, eta: Optional[int]) -> Optional[_Sources]:
    need = {
        "trajectories.jsonl": "the scheduler's books per sample (written with rollout.dump_to_file=true)",
        "metrics.jsonl": "the scheduler's books per step",
        TRAINER_STEPS: "the trainer's record",
    }
    missing = [f"{name} ({why})" for name, why in need.items() if not (run_dir / name).exists()]
    records = sorted((run_dir / ROLLOUT_DIR).glob("*.jsonl"))
    if not records:
        missing.append(f"{ROLLOUT_DIR}/*.jsonl (the rollout workers' records)")
    if missing:
        rep.problems += [Problem("source", f"{run_dir} has no {m}") for m in missing]
        return None
    books = _read(run_dir / "trajectories.jsonl", rep)
    metrics = [r for r in _read(run_dir / "metrics.jsonl", rep) if "kind" not in r]
    trainer = _read(run_dir / TRAINER_STEPS, rep)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    if not summary:
        rep.problems.append(Problem("source", f"{run_dir} has no summary.json: the run did not finish"))
    produced: dict[str, list] = defaultdict(list)
    for path in records:
        for g in _read(path, rep):
            for sid, lo, hi, n in zip(g["ids"], g["vmin"], g["vmax"], g["n_tokens"]):
                produced[sid].append((lo, hi, n, path.stem))
    rep.counts.update(rollout_workers=len(records), eta=_eta(run_dir, eta, rep))
    return _Sources(
        books=books,
        summary=summary,
        steps=[r for r in trainer if r.get("kind") == "step"],
        duplicates=[r for r in trainer if r.get("kind") == "duplicate"],
        produced=dict(produced),
        eta=rep.counts["eta"],
        metrics=metrics,
    )


def _read(path: Path, rep: Report) -> list[dict]:
    rows, bad = read_jsonl(path)
    rep.problems += [Problem("source", b) for b in bad]
    return rows


def _eta(run_dir: Path, eta: Optional[int], rep: Report) -> Optional[int]:
    if eta is not None:
        return eta
    try:
        return int(yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["max_head_offpolicyness"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as e:
        rep.problems.append(Problem("source", f"{run_dir}/config.yaml gives no rollout.max_head_offpolicyness ({e})"))
        return None


# ---- the trainer's record against the books --------------------------------------------------


def _trained_by_trainer(src: _Sources, rep: Report) -> tuple[dict[str, list[tuple[int, int, int]]], set]:
    """(id -> [(step, vmin, vmax)] of every step that trained it with its optimizer step applied,
    {(id, step)} of those a skipped optimizer step left untrained)."""
    out: dict[str, list] = defaultdict(list)
    skipped_at = set()
    seen = Counter(int(r["step"]) for r in src.steps)
    rep.problems += [
        Problem("step_record", f"{TRAINER_STEPS} holds step {s} {n} times; expected once")
        for s, n in seen.items()
        if n > 1
    ]
    for r in src.steps:
        step, skipped = int(r["step"]), set(r.get("skipped_ids", ()))
        if int(r.get("version", step + 1)) != step + 1:
            rep.problems.append(
                Problem("step_record", f"step {step} produced version {r['version']}; expected {step + 1}")
            )
        skipped_at.update((sid, step) for sid in skipped)
        for sid, lo, hi in zip(r["ids"], r["vmin"], r["vmax"]):
            if sid not in skipped:
                out[sid].append((step, lo, hi))
        rep.trained_per_step[step] = rep.trained_per_step.get(step, 0) + len(r["ids"]) - len(skipped)
    for sid, hits in out.items():
        if len(hits) > 1:
            steps = ", ".join(str(h[0]) for h in hits)
            rep.problems.append(Problem("trained_twice", f"sample {sid!r} trained in steps {steps}"))
    rep.counts.update(
        steps=len(seen),
        trained=sum(len(h) for h in out.values()),
        skipped_steps=sum(1 for r in src.steps if not r.get("applied", True)),
    )
    return dict(out), skipped_at


def _check_step_counts(src: _Sources, rep: Report) -> None:
    """metrics.jsonl's samples trained per step against the trainer's record (``trained_per_step``)."""
    booked = Counter()
    for row in src.metrics:
        k = int(row["step"])
        if k in booked:
            rep.problems.append(Problem("step_count", f"step {k}: metrics.jsonl has more than one row"))
        booked[k] = int(row.get("samples_trained", 0))
    trained = rep.trained_per_step
    for k in sorted(set(booked) | set(trained)):
        a = f"books {booked[k]} samples trained" if k in booked else "has no row"
        b = f"trained {trained[k]}" if k in trained else f"has no step {k}"
        if booked.get(k) != trained.get(k):
            rep.problems.append(Problem("step_count", f"step {k}: metrics.jsonl {a}; the trainer's record {b}"))


def _booked(src: _Sources, rep: Report) -> dict[str, dict]:
    """id -> its line in trajectories.jsonl (the first, if it has several: each repeat is a problem)."""
    out: dict[str, dict] = {}
    for line in src.books:
        sid = line.get("id")
        if sid in out:
            rep.problems.append(Problem("booked_twice", f"sample {sid!r} has more than one line in trajectories.jsonl"))
            continue
        out[sid] = line
    status = Counter(line.get("status") for line in out.values())
    rep.counts.update(booked_trained=status["trained"], booked_aborted=status["aborted"], booked=len(out))
    return out


def _compare_books_and_trainer(trained: dict, skipped: set, booked: dict, rep: Report) -> None:
    """Every line booked trained at step k is in the trainer's step k, and the other way round."""
    for sid, line in booked.items():
        if line.get("status") == "trained":
            _booked_trained(sid, line.get("train_step"), [h[0] for h in trained.get(sid, ())], skipped, rep)
    for sid, hits in trained.items():
        line = booked.get(sid)
        for step, _, _ in hits:
            if line is None:
                why = "trajectories.jsonl has no line for it"
            elif line.get("status") != "trained":
                why = f"the books say {line.get('status')} ({line.get('reason')})"
            elif line.get("train_step") != step:
                why = f"the books say trained at step {line.get('train_step')}"
            else:
                continue
            rep.problems.append(Problem("trained_not_booked", f"sample {sid!r} trained at step {step}; {why}"))


def _booked_trained(sid: str, k, steps: list[int], skipped: set, rep: Report) -> None:
    """A sample booked trained at step ``k``; ``steps``: those the trainer trained it in."""
    if k in steps:
        return
    if (sid, k) in skipped:
        kind, why = "skipped_booked", f"booked trained at step {k}, whose optimizer step skipped it"
    elif steps:
        kind, why = "booked_not_trained", f"booked trained at step {k}; the trainer trained it at {steps}"
    else:
        kind, why = "booked_not_trained", f"booked trained at step {k}; the trainer never trained it"
    rep.problems.append(Problem(kind, f"sample {sid!r} {why}"))


def _check_staleness(src: _Sources, trained: dict, rep: Report) -> None:
    if src.eta is None:
        return
    for sid, hits in trained.items():
        for step, lo, _ in hits:
            if lo < step - src.eta:
                rep.problems.append(
                    Problem(
                        "stale",
                        f"sample {sid!r} trained at step {step} with a token of version {lo} < step - eta = "
                        f"{step - src.eta} (eta {src.eta}, from the tensors the trainer used)",
                    )
                )


def _check_production(src: _Sources, trained: dict, booked: dict, rep: Report) -> None:
    """Every trained id was produced, with the versions trained; every product is in the books."""
    for sid, hits in trained.items():
        made = src.produced.get(sid)
        if not made:
            rep.problems.append(
                Problem("not_produced", f"sample {sid!r} trained at step {hits[0][0]}; no rollout record holds it")
            )
            continue
        for step, lo, hi in hits:
            _check_versions(sid, step, (lo, hi), made, booked.get(sid), rep)
    _check_lost(src, trained, booked, rep)


def _check_versions(sid: str, step: int, used: tuple, made: list, line: Optional[dict], rep: Report) -> None:
    """The versions the trainer ``used`` against each production of the id and its line in the books."""
    what = f"sample {sid!r} trained at step {step} with versions [{used[0]}, {used[1]}]"
    if not any((m[0], m[1]) == used for m in made):
        got = ", ".join(f"[{m[0]}, {m[1]}] by {m[3]}" for m in made)
        rep.problems.append(Problem("version_mismatch", f"{what}; produced {got}"))
    if line is not None and (line.get("version_min"), line.get("version_max")) != used:
        says = f"[{line.get('version_min')}, {line.get('version_max')}]"
        rep.problems.append(Problem("version_mismatch", f"{what}; the books say {says}"))


def _check_lost(src: _Sources, trained: dict, booked: dict, rep: Report) -> None:
    """A produced id in no book is lost, unless an epoch before the last produced it (rolled back)."""
    final_epoch = max(map(_epoch, [*src.produced, *booked, *trained]), default=0)
    rolled_back = 0
    for sid, made in src.produced.items():
        if sid in booked:
            continue
        if _epoch(sid) < final_epoch:
            rolled_back += 1
            continue
        rep.problems.append(
            Problem("lost", f"sample {sid!r} produced by {made[0][3]}; trajectories.jsonl has no line for it")
        )
    rep.counts.update(produced=len(src.produced), rolled_back=rolled_back, resumes=final_epoch)


_RESUMED = re.compile(r"r(\d+)-")


def _epoch(sample_id: str) -> int:
    """The resume epoch an id was issued in: k for ``r<k>-...``, 0 for an id of the first run."""
    m = _RESUMED.match(sample_id)
    return int(m.group(1)) if m else 0
