"""The per-prompt pass-rate memory (rollout.skip_solved_after) in SchedulerCore, driven by a simulated fleet.

Pinned: a prompt is skipped exactly when a brute-force replay of every scored group says its last k groups
were uniform with one shared reward (recomputed from the whole history, not from streaks); skipping never
changes how many groups are admitted or when (a run with the memory admits, plans and trains exactly as
one without it, event for event, when outcomes do not depend on the prompt); η holds; every skip is
counted and every settled prompt named; the memory survives a checkpoint; a run whose prompts are all
settled stops with a reason instead of spinning.
"""

import json
import random

import pytest

from areal_async.config import ConfigError, RolloutConfig, from_dict
from areal_async.data.prompts import PromptCursor
from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.scheduler.group_filter import build_group_filter
from areal_async.scheduler.ledger import SampleState
from tests.support.scheduler_fixtures import finish_group
from areal_async.scheduler.prompt_memory import PromptMemory
from areal_async.scheduler.step_rows import StepRows, run_summary

GEN = dict(max_new_tokens=16, temperature=1.0, top_p=1.0, greedy=False, stop_token_ids=[])
N_PROMPTS = 12


class LoggedCursor(PromptCursor):
    """A PromptCursor that writes each draw into the simulation's event list."""

    events: list

    def next(self):
        idx, pid = super().next()
        self.events.append(("draw", idx, pid))
        return idx, pid


def make_core(k, eta=1, B=2, n=4, steps=30, filt=None, events=None):
    params = SchedulerParams(
        batch_size=B,
        n_samples=n,
        eta=eta,
        total_steps=steps,
        max_concurrent=6,
        gen=GEN,
        group_filter=filt,
        skip_solved_after=k,
    )
    cursor = LoggedCursor(N_PROMPTS, seed=3)
    cursor.events = events if events is not None else []
    core = SchedulerCore(params, cursor, lambda i: ([1, 2, i], [str(i)]), log_sample=lambda r: None)
    for w in ("r0", "r1"):
        core.add_rollout(w)
    core.on_trainer_ready(0, 0)
    return core


def pass_rate(idx):
    """Prompts 0-3 always solved, 4-6 always failed, the rest solved by half of the samples."""
    return 1.0 if idx < 4 else 0.0 if idx < 7 else 0.5


def by_prompt(req, rng):
    """Rewards by pass_rate, except prompts 7 and 8: one coin per group for all its samples (uniform groups
    that flip between solved and failed: a streak must be of one shared reward)."""
    idx = int(req.prompt_ids[-1])
    if idx in (7, 8):
        return [float(rng.random() < 0.5)] * len(req.sample_ids)
    return [float(rng.random() < pass_rate(idx)) for _ in req.sample_ids]


def simulate(core, scores_of, seed=0, rounds=5000, trace=None):
    """Admit, finish in-flight groups after 1-3 rounds (scores from ``scores_of(req, rng)``), plan, train.
    ``trace`` gets, per round, what admission and planning did (counts, never prompt identities)."""
    rng, inflight, events = random.Random(seed), [], core.cursor.events
    for _ in range(rounds):  # a way out: a run that neither finishes nor stops fails below
        if core.finished or core.filter_starved():
            break
        admitted = core.admit()
        for _, req in admitted:
            assert core.accepted + core.running <= (core.p.eta + core.version + 1) * core.p.batch_size
            inflight.append([rng.randint(0, 2), req, core.version, scores_of(req, rng)])
        for item in list(inflight):
            item[0] -= 1
            if item[0] < 0:
                inflight.remove(item)
                req = item[1]
                if core.ledger.groups[req.group_id].status == "running":
                    events.append(("scored", core.ledger.groups[req.group_id].problem_index, item[3]))
                    finish_group(core, item[1], item[2], [4] * len(item[3]), item[3])
        plan, _ = core.plan()
        if plan is not None:
            trained = core.on_step_done(plan.step, plan.step + 1)
            assert all(r.version_min >= plan.step - core.p.eta for r in trained)
        if trace is not None:
            trace.append((len(admitted), core.accepted, core.running, core.version, plan and plan.step))
    else:
        raise AssertionError(f"the simulated run did not end in {rounds} rounds")


def brute_force_settled(history, k):
    """A prompt is settled iff its last k scored groups each had one reward shared by every sample, the same
    reward each time: read off the whole history, no streaks."""
    last = history[-k:]
    return len(last) == k and len({s for scores in last for s in scores}) == 1


@pytest.mark.parametrize("k,filt", [(1, ""), (2, ""), (3, "nonzero_std")])
def test_a_prompt_is_skipped_exactly_when_a_brute_force_replay_says_it_is_settled(k, filt):
    events = []
    core = make_core(k, filt=build_group_filter(filt), events=events)
    simulate(core, by_prompt, seed=k)
    issued = {g.prompt_id for g in core.ledger.groups.values()}
    history: dict[int, list] = {}
    skipped, settled_ever = 0, set()
    for ev in events:
        if ev[0] == "scored":
            history.setdefault(ev[1], []).append(ev[2])
            continue
        _, idx, pid = ev
        want_skip = brute_force_settled(history.get(idx, []), k)
        assert (pid not in issued) == want_skip, f"draw {pid} of prompt {idx}: history {history.get(idx)}"
        skipped += want_skip
        settled_ever |= {idx} if want_skip else set()
    assert skipped > 0 and core.memory.skipped_draws == skipped
    assert settled_ever & set(range(4)) and settled_ever & set(range(4, 7))  # solved ones and failed ones
    assert core.memory.settled_set == {i for i, h in history.items() if brute_force_settled(h, k)}


def by_order(req, rng):
    """Scores that depend on the group's issue order only (its id), not on its prompt."""
    g = int(req.group_id.lstrip("g"))
    return [1.0] * len(req.sample_ids) if g % 3 == 0 else [float(j % 2) for j in range(len(req.sample_ids))]


@pytest.mark.parametrize("eta,filt", [(0, ""), (1, ""), (2, "nonzero_std")])
def test_skipping_never_changes_admission_counts_or_plans(eta, filt):
    """With outcomes a function of issue order, a run with the memory and one without it see the same
    events: if skipping changed admission (accepted + running, the η bound's count) anywhere, the traces
    of admitted groups, accepted, running, version and planned step would part. The prompts differ."""
    runs = []
    for k in (0, 2):
        core, trace = make_core(k, eta=eta, filt=build_group_filter(filt)), []
        simulate(core, by_order, seed=7, trace=trace)
        runs.append((core, trace))
    (plain, trace0), (skipping, trace1) = runs
    assert skipping.memory.skipped_draws > 0 and plain.memory is None
    assert trace1 == trace0 and skipping.finished and plain.finished
    prompts = [sorted(g.prompt_id for g in c.ledger.groups.values()) for c in (plain, skipping)]
    assert prompts[0] != prompts[1]
    assert skipping.ledger.counts() == plain.ledger.counts()


def test_every_prompt_settled_stops_the_run_with_a_reason_instead_of_spinning():
    core = make_core(2, steps=1000)
    simulate(core, lambda req, rng: [1.0] * len(req.sample_ids))  # every prompt always solved
    why = core.filter_starved()
    assert not core.finished and why is not None
    assert f"rollout.skip_solved_after=2: all {N_PROMPTS} prompts are settled" in why
    assert core.admit() == [] and core.running == 0 and core.memory.all_settled(N_PROMPTS)


def test_the_memory_by_hand():
    m = PromptMemory(2)
    m.record(5, [1.0, 1.0, 1.0])
    assert not m.settled_set and m.streak[5] == (1.0, 1)
    m.record(5, [1.0, 1.0, 1.0])
    assert m.settled_set == {5} and m.take_new() == [5] and m.take_new() == []
    m.record(5, [0.0, 0.0, 0.0])  # a different shared reward starts the count again
    assert not m.settled_set and m.streak[5] == (0.0, 1)
    m.record(5, [0.0, 0.0, 0.0])
    m.record(8, [0.5, 0.5])
    m.record(8, [0.5, 0.5])
    assert m.settled_set == {5, 8}
    m.record(5, [0.0, 1.0, 0.0])  # a group still in flight when 5 settled came back mixed
    assert m.settled_set == {8} and 5 not in m.streak and m.take_new() == [8]
    cursor = PromptCursor(10, seed=0, shuffle=False)
    assert [m.draw(cursor)[0] for _ in range(9)] == [0, 1, 2, 3, 4, 5, 6, 7, 9] and m.skipped_draws == 1
    with pytest.raises(ValueError, match="k >= 1"):
        PromptMemory(0)


def test_the_memory_survives_a_checkpoint_and_the_books_name_it():
    core = make_core(1, steps=6)
    simulate(core, by_prompt, seed=1)
    core.abort_open("run_end")
    rows = StepRows(core, {"generated": 0, "rewarded": 0}, workers=None, weight_updates=None, t0=0.0)
    cols = rows._memory_counts()
    settled = sorted(core.memory.settled_set)
    assert cols["prompts_settled_new"] == settled and cols["prompts_settled"] == len(settled) > 0
    assert cols["prompts_skipped"] == cols["prompts_skipped_total"] == core.memory.skipped_draws
    again = rows._memory_counts()
    assert again["prompts_skipped"] == 0 and "prompts_settled_new" not in again

    state = json.loads(json.dumps(core.state()))  # what extra.json holds
    fresh = make_core(1, steps=12)
    fresh.restore(state)
    assert fresh.memory.streak == core.memory.streak and fresh.memory.settled_set == core.memory.settled_set
    assert fresh.memory.skipped_draws == core.memory.skipped_draws
    stricter = make_core(5, steps=12)  # a larger k re-judges the same streaks: nothing is settled after one group
    stricter.restore(state)
    assert stricter.memory.streak == core.memory.streak and not stricter.memory.settled_set

    class Log:
        n_sample_lines = 0

    class Filtered:
        n_total, n_dropped = N_PROMPTS, 0

    summary = run_summary(core, Log(), Filtered(), 0, 0.0)
    assert summary["prompts_settled"] == settled and summary["prompts_skipped"] == core.memory.skipped_draws


def test_the_key_refuses_bad_values_and_a_curriculum():
    assert RolloutConfig(skip_solved_after=3).skip_solved_after == 3
    with pytest.raises(ConfigError, match="skip_solved_after=-1: expected an integer >= 0"):
        RolloutConfig(skip_solved_after=-1)
    gym = {
        "type": "reasoning_gym",
        "tasks": [{"name": "basic_arithmetic", "weight": 1, "levels": [{"max_terms": 3}]}],
    }
    with pytest.raises(ConfigError, match="rollout.skip_solved_after.*0 with a reasoning_gym curriculum"):
        from_dict({"rollout": {"skip_solved_after": 2}, "train_dataset": gym})


def test_trained_samples_of_a_run_with_the_memory_are_all_booked():
    core = make_core(2, steps=20, filt=build_group_filter("nonzero_std"))
    simulate(core, by_prompt, seed=4)
    core.abort_open("run_end")
    recs = list(core.ledger.samples.values())
    assert all(r.status in (SampleState.TRAINED, SampleState.ABORTED) for r in recs)
    assert sum(r.status == SampleState.TRAINED for r in recs) == 20 * 2 * 4
