"""The checks of ``areal-async verify`` (``app/commands/verify.py`` lists the problem kinds): each takes the parsed
``Sources`` and appends a ``Problem`` per disagreement; the counts say how much was compared."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import NamedTuple, Optional

from areal_async.app.commands.verify_sources import Made, Problem, Sources
from areal_async.base.records import TRAINER_STEPS


class Hit(NamedTuple):
    """A sample trained at a step, as the trainer's record says (read from the tensors it used)."""

    step: int
    vmin: int
    vmax: int
    n_loss: Optional[int]  # trained tokens
    n_out: Optional[int]
    n_prompt: Optional[int]
    score: Optional[float]
    digest: Optional[str]  # token_digest of the output ids it trained


# ---- the trainer's record against the books --------------------------------------------------


def trained_by_trainer(src: Sources, p: list[Problem], counts: dict, per_step: dict) -> tuple[dict, set]:
    """(id -> [Hit] of every step that trained it with its optimizer step applied, {(id, step)} of
    those a skipped optimizer step left untrained); ``per_step``: step -> samples trained, filled."""
    out: dict[str, list[Hit]] = defaultdict(list)
    skipped_at = set()
    seen = Counter(int(r["step"]) for r in src.steps)
    p += [
        Problem("step_record", f"{TRAINER_STEPS} holds step {s} {n} times; expected once")
        for s, n in seen.items()
        if n > 1
    ]
    for r in src.steps:
        step, skipped = int(r["step"]), set(r.get("skipped_ids", ()))
        if int(r.get("version", step + 1)) != step + 1:
            p.append(Problem("step_record", f"step {step} produced version {r['version']}; expected {step + 1}"))
        skipped_at.update((sid, step) for sid in skipped)
        for i, sid in enumerate(r["ids"]):
            if sid not in skipped:
                out[sid].append(Hit(step, r["vmin"][i], r["vmax"][i], *(_at(r, f, i) for f in _HIT_FIELDS)))
        per_step[step] = per_step.get(step, 0) + len(r["ids"]) - len(skipped)
    for sid, hits in out.items():
        if len(hits) > 1:
            p.append(
                Problem("trained_twice", f"sample {sid!r} trained in steps {', '.join(str(h.step) for h in hits)}")
            )
    counts.update(
        steps=len(seen),
        trained=sum(len(h) for h in out.values()),
        skipped_steps=sum(1 for r in src.steps if not r.get("applied", True)),
    )
    return dict(out), skipped_at


_HIT_FIELDS = ("n_tokens", "n_out", "n_prompt", "scores", "tok_digest")


def _at(row: dict, name: str, i: int):
    values = row.get(name)
    return values[i] if isinstance(values, list) and i < len(values) else None


def step_counts(src: Sources, p: list[Problem], trained: dict) -> None:
    """metrics.jsonl's samples trained per step against the trainer's record (``trained``)."""
    booked = Counter()
    for row in src.metrics:
        k = int(row["step"])
        if k in booked:
            p.append(Problem("step_count", f"step {k}: metrics.jsonl has more than one row"))
        booked[k] = int(row.get("samples_trained", 0))
    for k in sorted(set(booked) | set(trained)):
        a = f"books {booked[k]} samples trained" if k in booked else "has no row"
        b = f"trained {trained[k]}" if k in trained else f"has no step {k}"
        if booked.get(k) != trained.get(k):
            p.append(Problem("step_count", f"step {k}: metrics.jsonl {a}; the trainer's record {b}"))


def booked(src: Sources, p: list[Problem], counts: dict) -> dict[str, dict]:
    """id -> its line in trajectories.jsonl (the first, if it has several: each repeat is a problem)."""
    out: dict[str, dict] = {}
    for line in src.books:
        sid = line.get("id")
        if sid in out:
            p.append(Problem("booked_twice", f"sample {sid!r} has more than one line in trajectories.jsonl"))
            continue
        out[sid] = line
    status = Counter(line.get("status") for line in out.values())
    counts.update(booked_trained=status["trained"], booked_aborted=status["aborted"], booked=len(out))
    return out


def books_against_trainer(trained: dict, skipped: set, books: dict, p: list[Problem]) -> None:
    """Every line booked trained at step k is in the trainer's step k, and the other way round."""
    for sid, line in books.items():
        if line.get("status") == "trained":
            _booked_trained(sid, line.get("train_step"), [h.step for h in trained.get(sid, ())], skipped, p)
    for sid, hits in trained.items():
        line = books.get(sid)
        for h in hits:
            if line is None:
                why = "trajectories.jsonl has no line for it"
            elif line.get("status") != "trained":
                why = f"the books say {line.get('status')} ({line.get('reason')})"
            elif line.get("train_step") != h.step:
                why = f"the books say trained at step {line.get('train_step')}"
            else:
                continue
            p.append(Problem("trained_not_booked", f"sample {sid!r} trained at step {h.step}; {why}"))


def _booked_trained(sid: str, k, steps: list[int], skipped: set, p: list[Problem]) -> None:
    """A sample booked trained at step ``k``; ``steps``: those the trainer trained it in."""
    if k in steps:
        return
    if (sid, k) in skipped:
        kind, why = "skipped_booked", f"booked trained at step {k}, whose optimizer step skipped it"
    elif steps:
        kind, why = "booked_not_trained", f"booked trained at step {k}; the trainer trained it at {steps}"
    else:
        kind, why = "booked_not_trained", f"booked trained at step {k}; the trainer never trained it"
    p.append(Problem(kind, f"sample {sid!r} {why}"))


def staleness(src: Sources, trained: dict, p: list[Problem]) -> None:
    if src.eta is None:
        return
    for sid, hits in trained.items():
        for h in hits:
            if h.vmin < h.step - src.eta:
                p.append(
                    Problem(
                        "stale",
                        f"sample {sid!r} trained at step {h.step} with a token of version {h.vmin} < step - eta = "
                        f"{h.step - src.eta} (eta {src.eta}, from the tensors the trainer used)",
                    )
                )


# ---- the trainer's record against the rollouts' -------------------------------------------


def production(src: Sources, trained: dict, books: dict, p: list[Problem]) -> None:
    """Every trained id was produced, with the versions trained and as the books say."""
    for sid, hits in trained.items():
        made = src.produced.get(sid)
        if not made:
            p.append(
                Problem("not_produced", f"sample {sid!r} trained at step {hits[0].step}; no rollout record holds it")
            )
            continue
        for h in hits:
            _versions(sid, h, made, books.get(sid), p)


def _versions(sid: str, h: Hit, made: list[Made], line: Optional[dict], p: list[Problem]) -> None:
    """The versions the trainer used against each production of the id and its line in the books."""
    what = f"sample {sid!r} trained at step {h.step} with versions [{h.vmin}, {h.vmax}]"
    if not any((m.vmin, m.vmax) == (h.vmin, h.vmax) for m in made):
        got = ", ".join(f"[{m.vmin}, {m.vmax}] by {m.worker}" for m in made)
        p.append(Problem("version_mismatch", f"{what}; produced {got}"))
    if line is not None and (line.get("version_min"), line.get("version_max")) != (h.vmin, h.vmax):
        says = f"[{line.get('version_min')}, {line.get('version_max')}]"
        p.append(Problem("version_mismatch", f"{what}; the books say {says}"))


def token_counts(src: Sources, trained: dict, p: list[Problem]) -> int:
    """Each trained sample's output, prompt and trained token counts (from the tensors the trainer used)
    against its production; returns how many (sample, step) pairs were compared."""
    n = 0
    for sid, hits in trained.items():
        made = src.produced.get(sid) or []
        for h in hits:
            same = [m for m in made if (m.vmin, m.vmax) == (h.vmin, h.vmax)] or made
            if not same:
                continue
            n += 1
            diffs = [_token_diffs(h, m) for m in same]
            if all(diffs):
                p.append(Problem("token_count", f"sample {sid!r} trained at step {h.step} with {diffs[0]}"))
            elif h.digest is not None and all(m.digest not in (None, h.digest) for m in same):
                p.append(
                    Problem(
                        "token_ids",
                        f"sample {sid!r} trained at step {h.step} with output ids of digest {h.digest} (the trainer's "
                        f"tensors); {same[0].worker} generated ids of digest {same[0].digest}",
                    )
                )
    return n


def _token_diffs(h: Hit, m: Made) -> str:
    """What differs between the trainer's counts and one production's ('' when nothing does)."""
    pairs = (
        ("output tokens", h.n_out, m.n_out),
        ("prompt tokens", h.n_prompt, m.n_prompt),
        ("trained tokens", h.n_loss, m.n_loss if m.n_loss is not None else m.n_out),
    )
    out = [
        f"{name} {a} (the trainer's tensors); {m.worker} produced {b}"
        for name, a, b in pairs
        if a is not None and b is not None and a != b
    ]
    return "; ".join(out)


# ---- scores: the books and the trainer against the reward records ---------------------------


def scores(src: Sources, trained: dict, books: dict, p: list[Problem]) -> int:
    """The reward the books hold and the score each step trained with, against the reward records;
    returns how many scores were compared."""
    n = 0
    for sid, line in books.items():
        reward = line.get("reward")
        if reward is None:
            if line.get("status") == "trained":
                p.append(Problem("not_scored", f"sample {sid!r} booked trained with no reward"))
            continue
        n += 1
        _score(sid, reward, "the books say reward", src.scored.get(sid), p)
    for sid, hits in trained.items():
        for h in hits:
            if h.score is not None:
                n += 1
                _score(sid, h.score, f"trained at step {h.step} with score", src.scored.get(sid), p)
    return n


def _score(sid: str, value, what: str, records: Optional[list], p: list[Problem]) -> None:
    if not records:
        p.append(Problem("not_scored", f"sample {sid!r}: {what} {value}; no reward record holds it"))
    elif all(float(value) != s for s, _, _ in records):
        got = ", ".join(f"{s} ({status}) by {w}" for s, status, w in records)
        p.append(Problem("score_mismatch", f"sample {sid!r}: {what} {value}; scored {got}"))


# ---- version stamps against the loads each engine acknowledged -------------------------------


def version_stamps(src: Sources, p: list[Problem]) -> tuple[int, int]:
    """Walk each rollout record in order: a sample's min and max version must be versions its worker's
    engine acknowledged loading in the same process (after its ``start`` line) before the group's line.
    Returns (samples checked, loads acknowledged)."""
    n = 0
    for worker, lines in src.rollout.items():
        acked: Optional[set] = None
        for i, g in enumerate(lines, 1):
            kind = g.get("kind", "group")
            if kind == "start":
                acked = set()
            elif kind == "loaded":
                if acked is not None:
                    acked.add(int(g["version"]))
            elif acked is None:
                p.append(Problem("source", f"rollout_records/{worker}.jsonl:{i}: a group before any start line"))
                break
            else:
                n += _stamps(worker, g, acked, p)
    return n, sum(1 for lines in src.rollout.values() for g in lines if g.get("kind") == "loaded")


def _stamps(worker: str, g: dict, acked: set, p: list[Problem]) -> int:
    for sid, lo, hi, nt in zip(g["ids"], g["vmin"], g["vmax"], g["n_tokens"]):
        if nt > 0 and not {lo, hi} <= acked:
            loads = ", ".join(map(str, sorted(acked))) or "none"
            p.append(
                Problem(
                    "version_unloaded",
                    f"sample {sid!r} stamped versions [{lo}, {hi}] by {worker}, whose engine had acknowledged "
                    f"loading {loads} (this process, before the group)",
                )
            )
    return len(g["ids"])


# ---- lost, or rolled back by a start that cut the books (resumes.json) -----------------------

_ID = re.compile(r"(?:r(\d+)-)?g(\d+)\.")


def lost(src: Sources, books: dict, p: list[Problem], counts: dict) -> list[dict]:
    """A produced id in no book is lost unless a start in resumes.json cut the books back to before it
    was issued (``_excused_by``). Returns, per start that cut the books, its entry and how many it excused."""
    cuts = [dict(s, excused=0) for s in src.starts if s.get("books") == "cut"]
    rolled_back = 0
    for sid, made in src.produced.items():
        if sid in books:
            continue
        start = _excused_by(sid, cuts)
        if start is not None:
            start["excused"] += 1
            rolled_back += 1
            continue
        why = "trajectories.jsonl has no line for it, and no start in resumes.json rolled it back"
        p.append(Problem("lost", f"sample {sid!r} produced by {made[0].worker}; {why}"))
    counts.update(
        produced=len(src.produced), rolled_back=rolled_back, resumes=sum(1 for s in src.starts if s.get("attempt"))
    )
    return cuts


def _excused_by(sid: str, cuts: list[dict]) -> Optional[dict]:
    """The first start after the id's epoch whose cut removed it: to nothing, to a checkpoint of an
    earlier epoch, or to one of its epoch that had issued at most its group number of groups."""
    m = _ID.match(sid)
    if m is None:
        return None
    epoch, group = int(m.group(1) or 0), int(m.group(2))
    for s in cuts:
        if int(s["attempt"]) <= epoch:
            continue
        if s.get("checkpoint") is None:
            return s
        ckpt = _ID.match(f"{s.get('id_prefix', '')}g0.")
        ckpt_epoch = int(ckpt.group(1) or 0) if ckpt else -1
        if ckpt_epoch < epoch or (ckpt_epoch == epoch and group >= int(s["groups_issued"])):
            return s
    return None
