"""SchedulerCore and the Ledger driven by simulated fleets (no sockets): invariants 1 and 2."""

import json
import random

import pytest

from protocols.messages import CheckpointRequest, RewardResult, TrajectoryReady, decode, encode

from areal_async.data.prompts import PromptCursor
from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.scheduler.ledger import GroupState, Ledger, LedgerError, SampleState
from areal_async.scheduler.runlog import sample_line
from areal_async.scheduler.start import next_attempt, save_attempt, start_entry
from areal_async.scheduler.status import waiting_for


def make_core(eta=0, B=2, n=3, steps=5, max_conc=100, logged=None):
    params = SchedulerParams(
        batch_size=B,
        n_samples=n,
        eta=eta,
        total_steps=steps,
        max_concurrent=max_conc,
        gen=dict(max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=False, stop_token_ids=[]),
    )
    core = SchedulerCore(
        params,
        PromptCursor(7, seed=0),
        lambda i: ([1, 2, i], [str(i)]),
        log_sample=(logged.append if logged is not None else lambda r: None),
    )
    core.add_rollout("r0")
    core.add_rollout("r1")
    core.on_trainer_ready(0, 0)
    return core


def traj_msg(gid, sids, vmin=0, vmax=0, worker="r0"):
    n = len(sids)
    return TrajectoryReady(
        group_id=gid,
        worker_id=worker,
        n_prompt_tokens=3,
        sample_ids=list(sids),
        n_output_tokens=[4] * n,
        version_min=[vmin] * n,
        version_max=[vmax] * n,
        finish_reasons=["stop"] * n,
    )


def reward_msg(gid, sids, score=1.0):
    n = len(sids)
    return RewardResult(
        group_id=gid, worker_id="w", sample_ids=list(sids), scores=[score] * n, statuses=["ok"] * n, details=[""] * n
    )


def finish_group(core, req, vmin, vmax, score=1.0, reward_first=False):
    traj, rew = traj_msg(req.group_id, req.sample_ids, vmin, vmax), reward_msg(req.group_id, req.sample_ids, score)
    for m in (rew, traj) if reward_first else (traj, rew):
        assert (core.on_reward(m) if isinstance(m, RewardResult) else core.on_trajectory(m)) is None


def generation_round(core, rng, inflight: list, delay_max: int = 6, issued: list | None = None) -> None:
    """One admission round of a simulated fleet: admitted groups finish 0-``delay_max`` rounds later, their
    tokens carrying the version current at start and at finish (groups aborted meanwhile are skipped).
    ``issued``: every sample id the core handed out, appended (the fleet's own count)."""
    for _, req in core.admit():
        inflight.append([rng.randint(0, delay_max), req, core.version])
        if issued is not None:
            issued += req.sample_ids
    for item in list(inflight):
        item[0] -= 1
        if item[0] < 0:
            inflight.remove(item)
            if core.ledger.groups[item[1].group_id].status == "running":
                finish_group(core, item[1], item[2], core.version, score=rng.random())


def simulate(core, rng, delay_max=3):
    """Groups finish after random delays (in admission rounds); tokens carry the versions
    current at start and at finish. Returns the trained records by step."""
    inflight, trained = [], {}
    while not core.finished:
        for _, req in core.admit():
            assert core.running <= (core.p.eta + core.version + 1) * core.p.batch_size
            inflight.append([rng.randint(0, delay_max), req, core.version])
        for item in list(inflight):
            item[0] -= 1
            if item[0] < 0:
                inflight.remove(item)
                _, req, v0 = item
                if core.ledger.groups[req.group_id].status == "running":
                    finish_group(core, req, v0, core.version, score=rng.random())
        plan, _ = core.plan()
        if plan is not None:
            trained[plan.step] = core.on_step_done(plan.step, plan.step + 1)
    core.abort_open("run_end")
    return trained


def test_eta_zero_is_synchronous_on_policy():
    core = make_core(eta=0)
    trained = simulate(core, random.Random(1))
    assert sorted(trained) == list(range(5))
    for step, recs in trained.items():
        assert len(recs) == 2 * 3
        assert all(r.version_min == r.version_max == step for r in recs)


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_bounded_staleness_and_exactly_once(eta):
    logged = []
    core = make_core(eta=eta, steps=12, logged=logged)
    trained = simulate(core, random.Random(eta), delay_max=6)
    for step, recs in trained.items():
        assert all(r.version_min >= step - eta for r in recs), step
    ids = [r.sample_id for r in logged]
    assert len(ids) == len(set(ids)) == core.ledger.n_samples_issued  # every sample ends exactly once
    statuses = {r.status for r in logged}
    assert statuses <= {"trained", "aborted"}
    assert all(r.reason for r in logged if r.status == "aborted")
    assert any(r.version_min < step for step, recs in trained.items() for r in recs)  # asynchrony happened


def test_samples_of_a_skipped_optimizer_step_are_booked_aborted_not_trained():
    """The trainer says step 0's optimizer step skipped two samples' minibatch: the books say
    aborted for them (with the reason), trained for the four others."""
    logged = []
    core = make_core(eta=0, B=2, n=3, steps=3, logged=logged)
    for _, req in core.admit():
        finish_group(core, req, 0, 0)
    plan, _ = core.plan()
    with pytest.raises(ValueError, match=r"skipped \['nope'\], which step 0 did not plan"):
        core.on_step_done(0, 1, ["nope"])
    skipped = [plan.sample_ids[1], plan.sample_ids[4]]
    trained = core.on_step_done(0, 1, skipped)
    assert sorted(r.sample_id for r in trained) == sorted(set(plan.sample_ids) - set(skipped))
    lines = {r.sample_id: sample_line(r) for r in logged}
    assert sorted(lines) == sorted(plan.sample_ids)
    for sid in skipped:
        assert lines[sid]["status"] == "aborted" and lines[sid]["train_step"] is None
        assert (
            lines[sid]["reason"]
            == "optimizer_step_skipped: step 0's optimizer step was not applied to this sample's minibatch"
        )
    assert core.ledger.counts()["trained"] == 4 and core.ledger.counts()["aborted"] == 2


def test_stale_group_is_aborted_and_its_prompt_reissued():
    logged = []
    core = make_core(eta=1, B=1, n=2, steps=10, logged=logged)
    reqs = [r for _, r in core.admit()]
    assert len(reqs) == 2  # (eta + v + 1) * B = 2
    old = reqs[1]
    finish_group(core, reqs[0], 0, 0)
    plan, _ = core.plan()
    core.on_step_done(plan.step, 1)
    finish_group(core, core.admit()[0][1], 1, 1)
    plan, _ = core.plan()
    core.on_step_done(plan.step, 2)  # now at step 2: version 0 is too old for eta=1
    finish_group(core, old, 0, 0)
    plan, stale = core.plan()
    assert [r.sample_id for r in stale] == old.sample_ids
    assert all(r.status == "aborted" and r.reason.startswith("stale") for r in stale)
    reissued = [r for _, r in core.admit() if r.prompt_id == old.prompt_id]
    assert len(reissued) == 1 and reissued[0].group_id != old.group_id


def test_lost_worker_work_is_reissued_not_lost_not_doubled():
    logged = []
    core = make_core(eta=1, logged=logged)
    reqs = core.admit()
    lost = [r for w, r in reqs if w == "r0"]
    aborted = core.lose_worker("r0", "test")
    assert {r.group_id for r in aborted} == {r.group_id for r in lost}
    assert all(r.reason.startswith("worker_lost") for r in aborted)
    again = core.admit()
    assert {w for w, _ in again} == {"r1"}
    assert sorted(r.prompt_id for _, r in again)[: len(lost)] == sorted(r.prompt_id for r in lost)
    # a late result from the dead worker is refused and changes nothing
    why = core.on_trajectory(traj_msg(lost[0].group_id, lost[0].sample_ids[:1]))
    assert "already aborted" in why


def test_reward_before_trajectory_and_admission_respects_concurrency():
    core = make_core(eta=3, B=2, max_conc=3)
    reqs = [r for _, r in core.admit()]
    assert len(reqs) == 3 and core.running == 3
    finish_group(core, reqs[0], 0, 0, reward_first=True)
    assert core.ledger.groups[reqs[0].group_id].status == "ready"
    assert core.running == 2 and len(core.admit()) == 1


def test_group_messages_in_parts_and_bad_entries_are_refused_per_sample():
    """A group may be reported in parts; a message's refused entries (another group's sample, a
    repeat, an unknown id) change nothing while its good entries still count."""
    core = make_core(eta=1, B=1, n=3)
    a, b = [r for _, r in core.admit()][:2]
    assert core.on_trajectory(traj_msg(a.group_id, a.sample_ids[:2])) is None
    why = core.on_trajectory(traj_msg(a.group_id, [a.sample_ids[0], b.sample_ids[0], "nope.0", a.sample_ids[2]]))
    assert "already generated" in why and "belongs to group" in why and "unknown sample 'nope.0'" in why
    assert core.ledger.samples[a.sample_ids[2]].status == "generated"  # the good entry counted
    assert core.ledger.samples[b.sample_ids[0]].status == "issued"  # the misrouted one did not
    assert core.on_reward(reward_msg(a.group_id, a.sample_ids[:1], score=1.0)) is None
    assert "already rewarded" in core.on_reward(reward_msg(a.group_id, a.sample_ids, score=0.0))
    assert core.ledger.samples[a.sample_ids[0]].score == 1.0  # the repeat did not overwrite it
    assert core.ledger.groups[a.group_id].status == "ready"
    assert [core.ledger.samples[s].score for s in a.sample_ids] == [1.0, 0.0, 0.0]


def test_lost_reward_worker_reissues_only_groups_waiting_for_a_score():
    """The requests a dead reward worker held are unknown, so every open group with a generated
    but unscored sample is aborted and re-issued; groups still generating or already ready stay."""
    core = make_core(eta=2, B=3, n=2)
    waiting, generating, ready = [r for _, r in core.admit()][:3]
    core.on_trajectory(traj_msg(waiting.group_id, waiting.sample_ids))
    core.on_reward(reward_msg(waiting.group_id, waiting.sample_ids[:1]))  # one of two scored
    finish_group(core, ready, 0, 0)
    lost = core.lose_reward_worker("reward-0", "restarted")
    assert {r.sample_id for r in lost} == set(waiting.sample_ids)
    assert all(r.reason.startswith("reward_worker_lost: reward-0") for r in lost)
    assert core.ledger.groups[generating.group_id].status == "running"
    assert core.ledger.groups[ready.group_id].status == "ready"
    assert "already aborted" in core.on_reward(reward_msg(waiting.group_id, waiting.sample_ids[1:]))
    assert [p for _, p in core.reissue] == [waiting.prompt_id]


def test_no_admission_before_trainer_ready_or_without_rollouts():
    params = SchedulerParams(2, 2, 0, 3, 10, gen={"max_new_tokens": 4})
    core = SchedulerCore(params, PromptCursor(3, 0), lambda i: ([1], ["1"]))
    assert core.admit() == []
    core.add_rollout("r")
    assert core.admit() == []
    core.on_trainer_ready(0, 0)
    assert len(core.admit()) == 2


def test_step_done_for_unplanned_step_is_refused():
    core = make_core()
    with pytest.raises(ValueError, match="TrainStepDone for step 3"):
        core.on_step_done(3, 4)


def test_ledger_transitions():
    led = Ledger()
    g = led.issue_group("p0", 0, 2, "r0", 0)
    a, b = g.sample_ids
    assert led.mark_generated(a, 0, 0, 3, "stop") is False
    with pytest.raises(LedgerError, match="generated twice"):
        led.mark_generated(a, 0, 0, 3, "stop")
    assert led.mark_rewarded(b, 1.0, "ok") is False  # reward first is fine
    assert led.mark_rewarded(a, 0.0, "ok") is False
    assert led.mark_generated(b, 0, 1, 2, "length") is True  # group ready
    with pytest.raises(LedgerError, match="illegal transition"):
        led.mark_trained([g.group_id])  # not batched yet
    led.mark_batched([g.group_id], 0)
    assert [r.status for r in led.mark_trained([g.group_id])] == ["trained", "trained"]
    with pytest.raises(LedgerError, match="already trained"):
        led.abort_group(g.group_id, "late")
    assert led.refuse(a, g.group_id) == f"sample {a!r} already trained"
    assert "unknown sample" in led.refuse("nope", g.group_id)
    assert led.counts() == {"issued": 2, "trained": 2, "aborted": 0, "in_flight": 0, "lost": 0}
    restored = Ledger.from_state(led.to_state())
    assert restored.to_state() == led.to_state()


def test_cursor_state_round_trip_continues_the_same_order():
    c = PromptCursor(5, seed=3)
    first = [c.next() for _ in range(7)]
    d = PromptCursor.from_state(5, 3, True, c.state())
    assert [d.next() for _ in range(6)] == [c.next() for _ in range(6)]
    assert sorted(i for i, _ in first[:5]) == list(range(5))  # an epoch is a permutation
    assert len({pid for _, pid in first}) == 7  # prompt ids never repeat


# A ledger as written into a checkpoint's extra.json before the states were an enum (hand-written, not produced
# by the code under test): one group trained, one batched, one running with a sample generated and one issued.
OLD_LEDGER_JSON = """{"id_prefix": "", "n_groups_issued": 3, "n_samples_issued": 5, "n_trained": 2, "n_aborted": 0,
 "groups": [
  {"group_id": "g1", "prompt_id": "p1", "problem_index": 1, "sample_ids": ["g1.0"], "worker": "r0",
   "issued_version": 0, "status": "batched"},
  {"group_id": "g2", "prompt_id": "p2", "problem_index": 2, "sample_ids": ["g2.0", "g2.1"], "worker": "r1",
   "issued_version": 1, "status": "running"}],
 "samples": [
  {"sample_id": "g1.0", "group_id": "g1", "prompt_id": "p1", "problem_index": 1, "status": "batched", "worker": "r0",
   "version_min": 0, "version_max": 0, "n_output_tokens": 4, "finish_reason": "stop", "score": 1.0,
   "reward_status": "ok", "train_step": 1, "reason": ""},
  {"sample_id": "g2.0", "group_id": "g2", "prompt_id": "p2", "problem_index": 2, "status": "generated",
   "worker": "r1", "version_min": 1, "version_max": 1, "n_output_tokens": 3, "finish_reason": "length",
   "score": null, "reward_status": "", "train_step": -1, "reason": ""},
  {"sample_id": "g2.1", "group_id": "g2", "prompt_id": "p2", "problem_index": 2, "status": "issued", "worker": "r1",
   "version_min": -1, "version_max": -1, "n_output_tokens": 0, "finish_reason": "", "score": null,
   "reward_status": "", "train_step": -1, "reason": ""}]}"""


def test_ledger_loads_a_checkpoint_written_before_the_state_enum_and_writes_the_same_strings():
    old = json.loads(OLD_LEDGER_JSON)
    led = Ledger.from_state(old)
    assert led.groups["g2"].status is GroupState.RUNNING and led.samples["g2.0"].status is SampleState.GENERATED
    assert json.loads(json.dumps(led.to_state())) == old  # extra.json of a new checkpoint: the same strings
    wire = decode(encode(CheckpointRequest(step=2, state=led.to_state())))  # the state travels to the trainer
    assert wire.state == old and type(wire.state["samples"][0]["status"]) is str
    led.mark_rewarded("g2.1", 0.0, "ok")  # the restored books keep moving
    assert led.mark_generated("g2.1", 2, 2, 5, "stop") is False  # g2.0 still has no reward
    assert led.mark_rewarded("g2.0", 1.0, "ok") is True
    assert [r.status for r in led.mark_trained(["g1"])] == ["trained"]
    assert led.counts() == {"issued": 5, "trained": 3, "aborted": 0, "in_flight": 2, "lost": 0}
    line = json.dumps(sample_line(led.samples["g1.0"]))
    assert '"status": "trained"' in line and '"train_step": 1' in line  # trajectories.jsonl unchanged


def _generated(led, gid, m):
    return led.record_generated(
        gid, m.sample_ids, m.n_output_tokens, m.version_min, m.version_max, m.finish_reasons, m.turns
    )


def _rewarded(led, gid, m):
    return led.record_rewarded(gid, m.sample_ids, m.scores, m.statuses)


def test_group_messages_in_issue_order_in_another_order_and_after_a_restore_book_the_same():
    """A message naming its group's samples exactly in issue order walks the group's own records;
    another order looks each sample up. Both book each value on its own sample, and so does a
    ledger restored from a checkpoint; forgetting a final group forgets its records."""
    led = Ledger()
    a, b = led.issue_group("pa", 0, 3, "r0", 0), led.issue_group("pb", 1, 3, "r0", 0)
    m = traj_msg(a.group_id, a.sample_ids)
    m.n_output_tokens = [5, 6, 7]
    assert _generated(led, a.group_id, m) == ([], True)
    m = traj_msg(b.group_id, list(reversed(b.sample_ids)))
    m.n_output_tokens = [7, 6, 5]
    assert _generated(led, b.group_id, m) == ([], True)
    assert [led.samples[s].n_output_tokens for s in a.sample_ids + b.sample_ids] == [5, 6, 7, 5, 6, 7]
    assert led.all_generated(a.group_id) and led.all_generated(b.group_id)
    r = reward_msg(b.group_id, [b.sample_ids[2], b.sample_ids[0], b.sample_ids[1]])
    r.scores = [0.25, 0.5, 0.75]
    assert _rewarded(led, b.group_id, r) == ([], True) and led.check_ready(b.group_id)
    assert [led.samples[s].score for s in b.sample_ids] == [0.5, 0.75, 0.25]

    old = Ledger.from_state(json.loads(OLD_LEDGER_JSON))  # g2: g2.0 generated, g2.1 issued
    whys, took = _generated(old, "g2", traj_msg("g2", ["g2.0", "g2.1"], vmin=2, vmax=3))
    assert whys == ["sample 'g2.0' already generated"] and took
    assert (old.samples["g2.0"].version_min, old.samples["g2.1"].version_min) == (1, 2)
    assert _rewarded(old, "g2", reward_msg("g2", ["g2.0", "g2.1"])) == ([], True)
    assert old.check_ready("g2") and old.groups["g2"].status is GroupState.READY
    old.mark_trained(["g1"])
    old.forget_final()
    assert set(old.groups) == set(old.members) == {"g2"} and set(old.samples) == {"g2.0", "g2.1"}


def test_ledger_refuses_a_checkpoint_with_an_unknown_state_naming_it():
    old = json.loads(OLD_LEDGER_JSON)
    old["samples"][1]["status"] = "scored"
    with pytest.raises(ValueError, match="sample 'g2.0': status 'scored' is not one of"):
        Ledger.from_state(old)
    old = json.loads(OLD_LEDGER_JSON)
    old["groups"][0]["status"] = "done"
    with pytest.raises(ValueError, match="group 'g1': status 'done' is not one of"):
        Ledger.from_state(old)


# ---- plan ahead (η >= 1): BatchPlan(n+1) while step n trains ------------------------------------
def test_plan_ahead_at_eta_one_is_depth_one_and_steps_end_in_order():
    core = make_core(eta=1, B=1, n=2, steps=5)
    g0, g1 = (r for _, r in core.admit())  # (η + v + 1) * B = 2 groups
    finish_group(core, g0, 0, 0)
    finish_group(core, g1, 0, 0)
    p0, _ = core.plan(ahead=True)
    assert (p0.step, p0.sample_ids) == (0, g0.sample_ids)  # idle trainer: the current step first
    p1, _ = core.plan(ahead=True)  # g1's oldest token (0) >= 1 - 1: fresh enough for step 1
    assert (p1.step, p1.sample_ids) == (1, g1.sample_ids)
    assert core.plan(ahead=True)[0] is None  # depth 1
    with pytest.raises(ValueError, match="TrainStepDone for step 1, but the trainer was planned step 0"):
        core.on_step_done(1, 2)
    with pytest.raises(ValueError, match="between steps"):
        core.state()  # a checkpoint never carries a planned batch
    assert [r.sample_id for r in core.on_step_done(0, 1)] == g0.sample_ids
    assert core.trainer_busy and core.next_step == 1  # step 1 was planned already
    recs = core.on_step_done(1, 2)
    assert [(r.sample_id, r.train_step, r.status) for r in recs] == [(s, 1, "trained") for s in g1.sample_ids]
    assert not core.trainer_busy and core.next_step == 2


def test_no_plan_ahead_at_eta_zero_or_without_leave():
    core = make_core(eta=0, B=1, n=2, steps=5)
    (_, g0), (g1, *_) = core.admit()[0], core._issue(core.rollouts["r1"])  # η = 0 admits one: g1 hand-built (its group)
    finish_group(core, g0, 0, 0)
    finish_group(core, g1, 1, 1)  # fresh enough for step 1 even at η = 0 (1 >= 1 - 0)
    assert core.plan(ahead=True)[0].step == 0
    assert core.plan(ahead=True)[0] is None  # η = 0: never ahead
    core2 = make_core(eta=1, B=1, n=2, steps=5)
    h0, h1 = (r for _, r in core2.admit())
    finish_group(core2, h0, 0, 0)
    finish_group(core2, h1, 0, 0)
    assert core2.plan()[0].step == 0
    assert core2.plan()[0] is None  # the service did not allow it (checkpoint due, stopping)
    assert core2.plan(ahead=True)[0].step == 1


def test_group_too_stale_for_the_next_step_is_not_planned_ahead():
    core = make_core(eta=1, B=1, n=2, steps=5)
    g0, g1 = (r for _, r in core.admit())
    finish_group(core, g0, 0, 0)
    assert core.plan(ahead=True)[0].step == 0
    core.on_step_done(0, 1)
    (_, g2) = core.admit()[0]
    finish_group(core, g2, 1, 1)
    assert core.plan(ahead=True)[0].sample_ids == g2.sample_ids  # step 1
    finish_group(core, g1, 0, 1)  # oldest token 0: fresh for step 1 (planned), not for step 2 (0 < 2 - 1)
    assert core.plan(ahead=True)[0] is None
    g3, *_ = core._issue(core.rollouts["r0"])  # hand-built: a group begun at version 1
    finish_group(core, g3, 1, 1)
    p2, _ = core.plan(ahead=True)
    assert (p2.step, p2.sample_ids) == (2, g3.sample_ids)  # g1, first in the ready queue, is passed over
    core.on_step_done(1, 2)
    _, stale = core.plan(ahead=True)  # now at step 2: g1 is aborted as stale, never trained
    assert [(r.sample_id, r.status) for r in stale] == [(s, "aborted") for s in g1.sample_ids]
    assert [r.train_step for r in core.on_step_done(2, 3)] == [2, 2]


@pytest.mark.parametrize("eta", [1, 2])
def test_plan_ahead_keeps_bounded_staleness_and_exactly_once(eta):
    """A simulated fleet whose trainer takes 0-3 rounds a step and always has the next plan queued
    when one is offered: every trained sample's oldest version >= its step - η, each sample once."""
    rng, logged, inflight, trained, queue, ahead = random.Random(eta), [], [], {}, [], 0
    core = make_core(eta=eta, steps=12, logged=logged)
    while not core.finished:
        generation_round(core, rng, inflight)
        plan, _ = core.plan(ahead=True)
        if plan is not None:
            ahead += bool(queue)  # planned while the previous step still trains
            queue.append([rng.randint(0, 3), plan.step])
        if queue:
            queue[0][0] -= 1
            if queue[0][0] < 0:
                step = queue.pop(0)[1]
                trained[step] = core.on_step_done(step, step + 1)
    core.abort_open("run_end")
    assert sorted(trained) == list(range(12))
    for step, recs in trained.items():
        assert recs and all(r.version_min >= step - eta and r.train_step == step for r in recs), step
    ids = [r.sample_id for r in logged]
    assert len(ids) == len(set(ids)) == core.ledger.n_samples_issued
    assert {r.status for r in logged} <= {"trained", "aborted"}
    assert ahead > 0  # plan ahead happened


def test_two_attempts_resumed_from_one_checkpoint_issue_different_ids(tmp_path):
    """A recovery that fails again before a newer checkpoint resumes from the same one: its ids
    must not repeat the failed attempt's (the trainer's buffer and areal-async verify key on them)."""
    core = make_core(eta=1)
    first = [r.sample_ids[0] for _, r in core.admit()]
    state = json.loads(json.dumps(core.state()))
    ids = []
    save_attempt(tmp_path, 0)  # the first start
    for attempt in (1, 2):  # the scheduler's start count in the run directory
        assert next_attempt(tmp_path) == attempt
        again = make_core(eta=1)
        again.restore(state, at_least=attempt)
        save_attempt(tmp_path, again.resumes)
        ids.append([r.sample_ids[0] for _, r in again.admit()])
    assert ids[0] and ids[1] and [i.split("-", 1)[1] for i in ids[0]] == [i.split("-", 1)[1] for i in ids[1]]
    assert not set(ids[0]) & set(ids[1]) and not set(first) & set(ids[0])
    assert all(i.startswith("r1-") for i in ids[0]) and all(i.startswith("r2-") for i in ids[1])


def test_resumes_json_keeps_what_each_start_continued_from(tmp_path):
    """resumes.json's starts, as areal-async verify reads them: a first start, a resume cut to a checkpoint
    (its ledger's prefix, groups issued, next step and the groups then open), a restart cut to nothing."""
    ckpt = {
        "next_step": 4,
        "ledger": {
            "id_prefix": "r1-",
            "n_groups_issued": 17,
            "groups": [{"group_id": "r1-g15", "status": "running"}, {"group_id": "r1-g16", "status": "ready"}],
        },
    }
    save_attempt(tmp_path, 0, start_entry(0, 0, False, None, None))
    save_attempt(tmp_path, 2, start_entry(2, 2, True, "run/checkpoints/step_4", ckpt))
    save_attempt(tmp_path, 3, start_entry(3, 3, True, None, None))
    assert json.loads((tmp_path / "resumes.json").read_text()) == {
        "resumes": 3,
        "starts": [
            {"attempt": 0, "books": "new", "checkpoint": None},
            {
                "attempt": 2,
                "books": "cut",
                "checkpoint": "run/checkpoints/step_4",
                "id_prefix": "r1-",
                "groups_issued": 17,
                "next_step": 4,
                "in_flight": ["r1-g15", "r1-g16"],
            },
            {"attempt": 3, "books": "cut", "checkpoint": None},
        ],
    }
    assert next_attempt(tmp_path) == 4
    assert start_entry(1, 1, False, None, None)["books"] == "kept"  # a rerun without recovery keeps its books


def test_a_restart_without_a_checkpoint_gets_fresh_ids(tmp_path):
    assert next_attempt(tmp_path) == 0
    save_attempt(tmp_path, 0)  # the first start
    assert next_attempt(tmp_path) == 1
    core = make_core(eta=1)
    core.restart_ids(next_attempt(tmp_path))
    assert {r.sample_ids[0] for _, r in core.admit()} >= {"r1-g0.0"}


def test_planned_groups_whose_tensors_never_came_are_aborted_and_their_plans_revised():
    """η = 1, B = 2: step 0 planned with a group of r0 and one of r1, step 1 planned ahead with two
    more. r0 dies; the trainer says r0's two planned groups never came (HeldReply). Both are aborted
    with the reason and their prompts re-issued; each plan is revised only once a fresh group can
    fill it to B again (step 0 first), keeping the group it still had; step 0 then books exactly
    its revision trained."""
    logged = []
    core = make_core(eta=1, B=2, n=2, steps=5, logged=logged)
    reqs = core.admit()  # (η + v + 1) B = 4 groups, alternating r0, r1
    assert [w for w, _ in reqs] == ["r0", "r1", "r0", "r1"]
    for _, req in reqs:
        finish_group(core, req, 0, 0)
    p0, _ = core.plan(ahead=True)
    p1, _ = core.plan(ahead=True)
    (_, a0), (_, b0), (_, a1), (_, b1) = reqs
    assert (p0.step, set(p0.group_ids), p1.step, set(p1.group_ids)) == (
        0,
        {a0.group_id, b0.group_id},
        1,
        {a1.group_id, b1.group_id},
    )
    core.lose_worker("r0", "test")  # nothing running: no abort yet
    assert core.unconfirmed("r0") == a0.sample_ids + a1.sample_ids
    aborted = core.on_missing(core.unconfirmed("r0"), "trajectories_lost: test")
    assert [r.sample_id for r in aborted] == a0.sample_ids + a1.sample_ids
    assert all(r.status == "aborted" and r.reason == "trajectories_lost: test" for r in aborted)
    assert [p for _, p in core.reissue] == [a0.prompt_id, a1.prompt_id]
    assert core.plan(ahead=True)[0] is None  # nothing ready to fill step 0 with
    fresh = [r for _, r in core.admit()]  # the two re-issued prompts, on r1
    assert [r.prompt_id for r in fresh] == [a0.prompt_id, a1.prompt_id]
    finish_group(core, fresh[0], 0, 0)
    r0, _ = core.plan(ahead=True)
    assert (r0.step, r0.revision, r0.group_ids) == (0, 1, [b0.group_id] * 2 + [fresh[0].group_id] * 2)
    assert set(a0.sample_ids) <= set(r0.aborted_ids)  # the trainer may drop them
    assert core.plan(ahead=True)[0] is None  # step 1 still short
    finish_group(core, fresh[1], 0, 1)
    r1, _ = core.plan(ahead=True)
    assert (r1.step, r1.revision, r1.group_ids) == (1, 1, [b1.group_id] * 2 + [fresh[1].group_id] * 2)
    trained = core.on_step_done(0, 1)
    assert [r.sample_id for r in trained] == r0.sample_ids
    assert [r.sample_id for r in core.on_step_done(1, 2)] == r1.sample_ids
    assert {r.sample_id for r in logged if r.status == "trained"}.isdisjoint(a0.sample_ids + a1.sample_ids)


def test_a_step_whose_every_group_was_lost_waits_for_a_full_revision_and_stays_busy():
    """B = 1: step 0's only group never came. The trainer still holds step 0's plan, so the core stays
    busy (no checkpoint state, no new step-0 plan): the revision is the next plan, revision 1."""
    core = make_core(eta=0, B=1, n=2, steps=3)
    ((_, g0),) = core.admit()
    finish_group(core, g0, 0, 0)
    p0, _ = core.plan()
    core.on_missing(p0.sample_ids, "trajectories_lost: test")
    assert core.trainer_busy and core.batch_groups == []
    assert waiting_for(core, True, None, False) == (
        "a revision of step 0's plan: 1 of its 1 groups never reached the trainer (their worker died); "
        "0 ready, refilling"
    )
    with pytest.raises(ValueError, match="between steps"):
        core.state()
    ((_, again),) = core.admit()
    assert again.prompt_id == g0.prompt_id
    finish_group(core, again, 0, 0)
    rev, _ = core.plan()
    assert (rev.step, rev.revision, rev.sample_ids) == (0, 1, again.sample_ids)
    assert [r.sample_id for r in core.on_step_done(0, 1)] == again.sample_ids
    assert not core.trainer_busy and core.revisions == {}


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_random_lost_tensors_keep_full_batches_bounded_staleness_and_exactly_once(eta):
    """A simulated fleet (as in the plan-ahead test) whose trainer trains the latest plan of each
    step and never one naming a sample it gave up on; now and then a worker "dies" and a random part
    of its generated groups' samples never reached the trainer. Brute-force invariants: every step
    trained sample's oldest version >= step - η; every sample the simulated fleet was handed (its own
    list, not the core's counter) ends exactly once, and nothing else ends."""
    rng, logged, inflight, trained, issued = random.Random(10 + eta), [], [], {}, []
    core = make_core(eta=eta, B=2, n=2, steps=10, logged=logged)
    plans, order, given_up, losses, revised = {}, [], set(), 0, 0
    for _ in range(5000):  # a step that never gets a revision it can train would spin here
        if core.finished:
            break
        generation_round(core, rng, inflight, issued=issued)
        if rng.random() < 0.25:
            held = core.unconfirmed(rng.choice(["r0", "r1"]))
            missing = [s for s in held if rng.random() < 0.5]
            if missing:
                losses += 1
                given_up.update(missing)
                core.on_missing(missing, "trajectories_lost: simulated")
        while True:
            plan, _ = core.plan(ahead=True)
            if plan is None:
                break
            assert (plan.revision > 0) == (plan.step in plans)
            revised += plan.revision > 0
            if plan.step not in plans:
                order.append([rng.randint(0, 3), plan.step])
            plans[plan.step] = plan
        if order:
            step = order[0][1]
            order[0][0] -= 1
            if order[0][0] < 0 and not given_up.intersection(plans[step].sample_ids):
                order.pop(0)
                recs = core.on_step_done(step, step + 1)
                assert sorted(r.sample_id for r in recs) == sorted(plans[step].sample_ids)
                trained[step] = recs
    core.abort_open("run_end")
    assert core.finished, f"stuck at step {core.next_step}"
    assert sorted(trained) == list(range(10)) and losses >= 3 and revised >= 2
    for step, recs in trained.items():
        assert len({r.group_id for r in recs}) == 2 and len(recs) == 4, step
        assert all(r.version_min >= step - eta and r.train_step == step for r in recs), step
        assert given_up.isdisjoint(r.sample_id for r in recs)
    ids = [r.sample_id for r in logged]
    assert len(issued) == len(set(issued)) and sorted(ids) == sorted(issued)  # each handed-out id ended once
    assert {r.status for r in logged} <= {"trained", "aborted"}
    assert any(r.reason.startswith("trajectories_lost") for r in logged)


def test_a_stopping_run_admits_only_what_a_short_step_lacks():
    """The run is stopping (no new work) while step 0 waits for its revision: B = 2, one of its two
    groups never came. The stop waits for the step, so the core admits exactly the one group the
    revision lacks (the budget would allow (η + v + 1) B - 1 = 3), and nothing once the step is full."""
    core = make_core(eta=1, B=2, n=2, steps=5)
    reqs = core.admit()
    for _, req in reqs[:2]:
        finish_group(core, req, 0, 0)
    p0, _ = core.plan()
    core.on_missing([p0.sample_ids[0]], "trajectories_lost: test")
    assert core.short_need() == 1 and core.running == 2  # reqs[2:] still generating
    assert core.admit(only_short=True) == []  # the two running groups can fill it already
    for _, req in reqs[2:]:
        finish_group(core, req, 0, 0)
    rev, _ = core.plan()
    assert (rev.step, rev.revision) == (0, 1) and core.short_need() == 0
    assert core.admit(only_short=True) == [] and len(core.admit()) > 0


def test_a_stopping_run_with_nothing_in_flight_admits_exactly_the_lacking_groups():
    core = make_core(eta=1, B=2, n=2, steps=5, max_conc=2)
    reqs = core.admit()  # max_concurrent 2: both groups of step 0, nothing else
    for _, req in reqs:
        finish_group(core, req, 0, 0)
    p0, _ = core.plan()
    core.on_missing(p0.sample_ids, "trajectories_lost: test")  # both groups lost
    assert core.short_need() == 2 and core.running == 0
    got = core.admit(only_short=True)
    assert [r.prompt_id for _, r in got] == [r.prompt_id for _, r in reqs]  # the re-issued prompts, no more
    assert core.admit(only_short=True) == []
