"""Whose work is overdue: the oldest unfinished work of the run and the role that holds it.

The scheduler writes, in ``status.json`` (and answers ``status`` with), its open work (``open_work``):
the oldest group not yet generated (held by a rollout worker), the oldest generated group not yet
scored (held by the reward workers, or by the rollout worker whose workflow scores its own episodes),
and the step the trainer was planned (held by the trainer), each with its age; plus every worker's
heartbeat stats (``engine_step_s``: the engine step running now; a workflow's ``episodes`` and
``episode_oldest_s``; a reward worker's ``scoring_oldest_s``). ``overdue`` names the holder of the
oldest of them and what it is stuck in: a worker that waits idle for others is never the one named.
"""

from __future__ import annotations

from typing import Optional

SILENT_HEARTBEATS = 3  # a worker whose last heartbeat is older than this many periods is called silent


def open_work(core, now: float, plan_t: Optional[float]) -> dict:
    """The oldest unfinished work of each kind, from the scheduler core's books (``now``: its clock);
    ``plan_t``: when the step in training was planned (None: the trainer is idle)."""
    times = core.deadlines
    gen = [(t, g) for g, t in times.issued_at.items() if g not in times.generated_at]
    work: dict = {"generate": None, "score": None, "train": None}
    if gen:
        t, gid = min(gen)
        work["generate"] = {"group": gid, "worker": core.ledger.groups[gid].worker, "age_s": round(now - t, 1)}
    if times.generated_at:
        gid, t = min(times.generated_at.items(), key=lambda kv: kv[1])
        work["score"] = {"group": gid, "worker": core.ledger.groups[gid].worker, "age_s": round(now - t, 1)}
    if core.trainer_busy and plan_t is not None:
        work["train"] = {"step": core.next_step, "age_s": round(now - plan_t, 1)}
    return work


def overdue(status: dict, heartbeat_s: float = 1.0) -> str:
    """The role whose work is oldest, and what it is stuck in (see the module docstring)."""
    work = {k: v for k, v in (status.get("work") or {}).items() if v}
    if not work:
        if not status.get("trainer_ready"):
            return f"trainer (not ready: the scheduler waits for {status.get('waiting_for') or '?'})"
        return f"scheduler (no work in flight; it waits for {status.get('waiting_for') or '?'})"
    kind = max(work, key=lambda k: work[k].get("age_s", 0.0))
    return _DESCRIBE[kind](work[kind], status.get("workers") or {}, heartbeat_s)


def _train(item: dict, workers: dict, hb: float) -> str:
    wid, w = next(((k, v) for k, v in workers.items() if v.get("role") == "trainer"), ("trainer", None))
    head = f"trainer (step {item['step']} planned {item['age_s']:g}s ago, not finished"
    if w is None:
        return head + "; no trainer registered: lost)"
    return head + f"; {wid} {_heard(w, hb)}, waiting for {w.get('waiting_for') or '?'})"


def _generate(item: dict, workers: dict, hb: float) -> str:
    wid = item["worker"]
    head = f"rollout ({wid} holds group {item['group']}, issued {item['age_s']:g}s ago and not generated"
    w = workers.get(wid)
    if w is None:
        return head + f"; {wid} is not registered: lost)"
    st = w.get("stats") or {}
    step_s, age = float(st.get("engine_step_s", 0.0)), float(item["age_s"])
    if step_s > 0 and 2 * step_s >= age:
        what = f"its engine: one step running for {step_s:g}s"
    elif st.get("episodes"):
        what = (
            f"its workflow {st.get('workflow', '?')}: {st['episodes']} episode(s) running, the oldest for "
            f"{st.get('episode_oldest_s', 0):g}s (engine step now {step_s:g}s)"
        )
    else:
        what = w.get("waiting_for") or "nothing it reported yet"
    return head + f"; {wid} {_heard(w, hb)}; stuck in {what})"


def _score(item: dict, workers: dict, hb: float) -> str:
    holder = workers.get(item["worker"]) or {}
    head = f"group {item['group']} generated {item['age_s']:g}s ago and not scored"
    if (holder.get("stats") or {}).get("workflow"):  # a workflow scores its own episodes
        return f"rollout ({head}: {item['worker']}'s workflow scores it; {item['worker']} {_heard(holder, hb)})"
    rewards = {k: v for k, v in workers.items() if v.get("role") == "reward"}
    if not rewards:
        return f"reward ({head}; no reward worker registered: lost)"
    wid, w = max(rewards.items(), key=lambda kv: float((kv[1].get("stats") or {}).get("scoring_oldest_s", 0.0)))
    oldest = float((w.get("stats") or {}).get("scoring_oldest_s", 0.0))
    what = f"a check running for {oldest:g}s" if oldest else (w.get("waiting_for") or "?")
    return f"reward ({head}; {wid} {_heard(w, hb)}, stuck in {what})"


def _heard(w: dict, hb: float) -> str:
    silent = float(w.get("silent_s", 0.0))
    return f"silent for {silent:g}s" if silent > SILENT_HEARTBEATS * hb else f"last heartbeat {silent:g}s ago"


_DESCRIBE = {"train": _train, "generate": _generate, "score": _score}
