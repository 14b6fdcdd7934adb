"""``areal-async verify RUN_DIR``: the scheduler's books checked against the records other processes wrote.

The sources, written by four kinds of process (formats: ``base/records.py``, ``scheduler/runlog.py``,
``scheduler/start.py``); every run writes them:

    scheduler  trajectories.jsonl      one line per sample as it ended: trained at step k, or aborted; its reward
               metrics.jsonl           one row per step: samples_trained
               summary.json            samples_lost
               resumes.json            per start: what its books continued from (the checkpoint's
                                       id prefix, groups issued, next step, groups in flight)
    trainer    trainer_steps.jsonl     per step: the ids it trained, each one's min/max token version,
                                       token counts and output-id digest read from the tensors it used,
                                       the score it trained with, the ids whose optimizer step was
                                       skipped; ids that arrived twice at its buffer
    rollouts   rollout_records/*.jsonl per group produced: ids, min/max token version, token counts,
                                       output-id digests; per weight version the engine acknowledged
                                       loading, a line
    rewards    reward_records/*.jsonl  per group scored: ids, scores (written before the result left)

Each disagreement is one ``Problem`` (kind, message):

    lost                 produced by a rollout and in no book, and no resume's checkpoint rolled it
                         back (resumes.json); or summary.json's samples_lost is not 0
    trained_twice        an id trained (optimizer step applied) twice, in two steps or one
    trained_not_booked   trained at step k by the trainer's record; the books say otherwise
    booked_not_trained   booked trained at step k; the trainer's record of step k lacks it
    skipped_booked       booked trained at step k, but step k's optimizer step skipped its minibatch
    stale                a trained token's version < k - eta (eta: the run's config), from the tensors
    duplicate_at_buffer  an id arrived twice at the trainer's buffer (the copy was refused)
    not_produced         trained, but no rollout record holds the id
    version_mismatch     the versions the trainer trained differ from what the rollout produced or
                         from what the books say
    version_unloaded     a sample's version stamp (min or max) is not a version its rollout worker's
                         engine had acknowledged loading (in that process, before the group's line)
    token_count          the output, prompt or trained token count of a sample in the tensors the
                         trainer used differs from what its rollout produced
    token_ids            the output token ids the trainer trained differ from those its rollout generated
                         (a digest of each side's ids, ``base/records.token_digest``): e.g. a
                         decode and re-encode between them
    score_mismatch       the reward the books hold, or the score the trainer trained with, differs from
                         every score a reward record holds for the id
    not_scored           a sample with a reward (or trained) that no reward record holds
    booked_twice         an id with two lines in trajectories.jsonl
    step_record          the trainer's record has a step twice, or its version is not step + 1
    step_count           metrics.jsonl's samples_trained of a step (or the step itself) differs from
                         the trainer's record
    source               a source is missing, has a line that is not JSON, or lacks what is compared

A resumed run (in-run recovery or a rerun with recover.mode=auto) rolls the books back to its
checkpoint and issues ids with the prefix ``r<k>-`` (k: the scheduler's starts in the run directory).
A produced sample in no book is excused as rolled back only when a start recorded in ``resumes.json``
cut the books back to before it: to nothing, to a checkpoint of an earlier epoch than the sample's,
or to a checkpoint of its epoch that had issued fewer groups than its group number. Each excused
sample is counted against the start that excused it (``Report.rollbacks``).

``verify_run`` is the Python API (tests, ``benchmarks.faults``, ``benchmarks.soak``); the CLI
exits 0 when the sources agree, 1 naming each disagreement, 2 when RUN_DIR is not a directory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_async.app.commands import verify_checks as checks
from areal_async.app.commands.verify_sources import Problem, Sources, load


@dataclass
class Report:
    run_dir: str
    problems: list[Problem] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    trained_per_step: dict[int, int] = field(default_factory=dict)  # from the trainer's record
    rollbacks: list[dict] = field(default_factory=list)  # per start that cut the books: what it excused

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

    def rollback_lines(self) -> list[str]:
        """One line per start that cut the books (resumes.json): what it rolled back to and how many
        produced samples in no book it excused."""
        return [_rollback_line(r) for r in self.rollbacks]

    def summary(self) -> str:
        c = self.counts
        head = "the sources agree" if self.ok else f"{len(self.problems)} disagreement(s) {dict(self.kinds())}"
        return (
            f"{self.run_dir}: {head}: {c.get('steps', 0)} trainer steps, {c.get('trained', 0)} samples trained, "
            f"{c.get('booked_trained', 0)} booked trained, {c.get('booked_aborted', 0)} booked aborted, "
            f"{c.get('produced', 0)} produced by {c.get('rollout_workers', 0)} rollout worker(s), "
            f"{c.get('rolled_back', 0)} rolled back by {c.get('resumes', 0)} resume(s) (resumes.json), "
            f"{c.get('skipped_steps', 0)} step(s) with a skipped optimizer step, eta {c.get('eta')}; compared: "
            f"token counts and ids of {c.get('tokens_compared', 0)}, scores of {c.get('scores_compared', 0)} "
            f"against {c.get('reward_records', 0)} reward record(s), version stamps of {c.get('stamps_checked', 0)} "
            f"against {c.get('loads_acknowledged', 0)} acknowledged load(s)"
        )


def _rollback_line(r: dict) -> str:
    if r["checkpoint"] is None:
        to = "to nothing (no checkpoint): every earlier id"
    else:
        prefix = r.get("id_prefix") or "(none)"
        to = (
            f"to {r['checkpoint']} (next step {r.get('next_step')}): ids of prefix {prefix} from group "
            f"{r.get('groups_issued')} on, and of every earlier prefix"
        )
    return f"start {r['attempt']}: books cut back {to}; {r['excused']} produced sample(s) in no book excused"


def verify_run(run_dir: str | Path, eta: Optional[int] = None) -> Report:
    """Check RUN_DIR's sources against each other. ``eta``: the staleness bound (default: the run's
    ``rollout.max_head_offpolicyness`` from its config.yaml)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; expected a run directory")
    rep = Report(str(run_dir))
    src = load(run_dir, rep.problems, rep.counts, eta)
    if src is None:
        return rep
    _check(src, rep)
    return rep


def _check(src: Sources, rep: Report) -> None:
    p = rep.problems
    trained, skipped = checks.trained_by_trainer(src, p, rep.counts, rep.trained_per_step)
    checks.step_counts(src, p, rep.trained_per_step)
    booked = checks.booked(src, p, rep.counts)
    checks.books_against_trainer(trained, skipped, booked, p)
    checks.staleness(src, trained, p)
    checks.production(src, trained, booked, p)
    rep.counts["tokens_compared"] = checks.token_counts(src, trained, p)
    rep.counts["scores_compared"] = checks.scores(src, trained, booked, p)
    rep.counts["stamps_checked"], rep.counts["loads_acknowledged"] = checks.version_stamps(src, p)
    for d in src.duplicates:
        p.append(Problem("duplicate_at_buffer", d.get("message") or f"sample id {d.get('id')!r}"))
    rep.rollbacks = checks.lost(src, booked, p, rep.counts)
    lost = src.summary.get("samples_lost")
    if lost:
        p.append(Problem("lost", f"summary.json: samples_lost = {lost} (issued minus lines written)"))
