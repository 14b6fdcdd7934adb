"""rollout.over_provision (scheduler/long_tail.py): admission past the bound, the stragglers cut once the bound
is reached, tail_s and wasted_tokens; hand-counted cases and a simulated fleet checked against the invariants
(bounded staleness, exactly once, nothing accepted past the bound) with completion orders drawn at random."""

import random

import pytest

from areal_async.data.prompts import PromptCursor
from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.scheduler.long_tail import extra_groups
from areal_async.base.staleness import accept_bound, admission_budget
from tests.unit.scheduler.test_scheduler_core import finish_group, reward_msg, traj_msg


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make_core(eta=0, B=2, n=2, steps=50, over=0.5, clock=None, logged=None):
    params = SchedulerParams(
        batch_size=B,
        n_samples=n,
        eta=eta,
        total_steps=steps,
        max_concurrent=100,
        gen=dict(max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=False, stop_token_ids=[]),
        over_provision=over,
        max_reissues=-1,
    )
    core = SchedulerCore(
        params,
        PromptCursor(50, seed=0),
        lambda i: ([1, 2, i], [str(i)]),
        log_sample=(logged.append if logged is not None else lambda r: None),
        clock=clock or Clock(),
    )
    core.add_rollout("r0")
    core.on_trainer_ready(0, 0)
    return core


@pytest.mark.parametrize(
    "accepted,running,version,eta,extra,expected",
    [
        (0, 0, 0, 0, 2, 4),  # bound (0 + 0 + 1) x 2 = 2, plus 2 extra
        (1, 2, 0, 0, 2, 1),  # 2 + 2 - 1 - 2
        (2, 0, 0, 0, 2, 0),  # the bound is reached: nothing could be accepted, nothing starts
        (2, 1, 1, 0, 2, 3),  # version 1: bound 4; 4 + 2 - 2 - 1
        (3, 5, 0, 1, 2, 0),  # bound 4, running 5 > 4 + 2 - 3: none
        (1, 0, 0, 0, 0, 1),  # extra 0: today's rule
    ],
)
def test_admission_budget_with_extra_groups_by_hand(accepted, running, version, eta, extra, expected):
    assert admission_budget(accepted, running, version, eta, 2, extra) == expected


def test_extra_groups_is_the_ceiling_of_f_times_b():
    assert [extra_groups(f, 8) for f in (0, 0.1, 0.25, 0.3, 1.0)] == [0, 1, 2, 3, 8]
    with pytest.raises(ValueError, match="expected >= 0"):
        extra_groups(-0.1, 8)


def test_the_slowest_group_of_a_round_is_cut_and_its_prompt_goes_first():
    core = make_core(eta=0, B=2, over=0.5)  # E = 1: three groups for a batch of two
    reqs = [r for _, r in core.admit()]
    assert len(reqs) == 3 and core.admit() == []
    finish_group(core, reqs[2], 0, 0)
    finish_group(core, reqs[0], 0, 0)
    cut = core.cut_stragglers()
    assert {r.group_id for r in cut} == {reqs[1].group_id} and all(r.status == "aborted" for r in cut)
    assert cut[0].reason.startswith("straggler: 2 groups accepted, the bound (eta + v + 1) B = 2 at version 0")
    assert core.admit() == []  # nothing can be accepted before version 1
    plan, _ = core.plan()
    assert plan.group_ids == [reqs[2].group_id] * 2 + [reqs[0].group_id] * 2  # the first two to finish
    core.on_step_done(0, 1)
    again = [r for _, r in core.admit()]
    assert len(again) == 3 and again[0].prompt_id == reqs[1].prompt_id  # re-issued ahead of new prompts


def test_no_over_provisioning_cuts_nothing():
    core = make_core(eta=0, B=2, over=0.0)
    reqs = [r for _, r in core.admit()]
    assert len(reqs) == 2
    finish_group(core, reqs[0], 0, 0)
    finish_group(core, reqs[1], 0, 0)
    assert core.cut_stragglers() == []


def test_tail_s_is_how_long_the_last_group_kept_the_idle_trainer_waiting():
    clock = Clock()
    core = make_core(eta=0, B=3, over=0.0, clock=clock)
    reqs = [r for _, r in core.admit()]
    clock.t = 101.0
    finish_group(core, reqs[0], 0, 0)
    clock.t = 102.5
    finish_group(core, reqs[1], 0, 0)
    clock.t = 106.0
    finish_group(core, reqs[2], 0, 0)
    plan, _ = core.plan()
    assert core.tail.take_tail(0) == pytest.approx(3.5)  # 106 - max(102.5, trainer free at 100)
    clock.t = 110.0
    core.on_step_done(0, 1)  # the trainer is free at 110
    reqs = [r for _, r in core.admit()]
    clock.t = 111.0
    finish_group(core, reqs[0], 1, 1)
    finish_group(core, reqs[1], 1, 1)  # two at 111, the last at 111.25
    clock.t = 111.25
    finish_group(core, reqs[2], 1, 1)
    core.plan()
    assert core.tail.take_tail(1) == pytest.approx(0.25)


def test_tail_s_is_zero_for_a_batch_planned_ahead_or_ready_before_the_trainer():
    clock = Clock()
    core = make_core(eta=1, B=1, over=0.0, clock=clock)
    reqs = [r for _, r in core.admit()]
    assert len(reqs) == 2
    clock.t = 101.0
    finish_group(core, reqs[0], 0, 0)
    clock.t = 102.0
    finish_group(core, reqs[1], 0, 0)
    core.plan()  # step 0: one group, it alone kept the trainer (free at 100) waiting 1 s
    core.plan(ahead=True)  # step 1: ahead, the trainer busy
    assert core.tail.take_tail(0) == pytest.approx(1.0) and core.tail.take_tail(1) == 0.0


def test_wasted_tokens_count_every_generated_token_that_is_not_trained():
    core = make_core(eta=0, B=2, n=2, over=0.5)
    reqs = [r for _, r in core.admit()]
    finish_group(core, reqs[0], 0, 0)  # traj_msg: 4 tokens a sample
    # the third group's samples were generated (4 + 4 tokens) but are not yet scored when the bound is reached
    assert core.on_trajectory(traj_msg(reqs[2].group_id, reqs[2].sample_ids)) is None
    assert core.tail.wasted == 0
    finish_group(core, reqs[1], 0, 0)  # the bound is reached: the third group is cut at once
    assert core.tail.wasted == 8
    cut = core.cut_stragglers()
    assert [r.group_id for r in cut] == [reqs[2].group_id, reqs[2].group_id] and core.cut_stragglers() == []
    core.on_stopped([5, 0])  # a rollout's engine stopped aborted groups holding 5 tokens
    assert core.tail.wasted == 13
    # a late trajectory of an aborted group (finished before its AbortGroups arrived): 2 x 4 tokens more
    assert "already aborted" in core.on_trajectory(traj_msg(reqs[2].group_id, reqs[2].sample_ids))
    assert core.tail.wasted == 21
    assert core.on_reward(reward_msg(reqs[2].group_id, reqs[2].sample_ids)) is not None  # refused, no tokens
    assert core.tail.wasted == 21


def fleet(core, rng, delay_max, issued, accepted_max):
    """A simulated fleet with over-provisioning: each admitted group takes 0..delay_max rounds; the service's
    order per round: messages, plan, cut stragglers, admit. Records the most groups ever accepted past the
    bound in ``accepted_max``."""
    inflight, trained = [], {}
    while not core.finished:
        for item in list(inflight):
            item[0] -= 1
            if item[0] < 0:
                inflight.remove(item)
                _, req, v0 = item
                if core.ledger.groups[req.group_id].status == "running":
                    finish_group(core, req, v0, core.version, score=rng.random())
            accepted_max[0] = max(accepted_max[0], core.accepted - accept_bound(core.version, core.p.eta, 2))
        plan, _ = core.plan(ahead=True)
        if plan is not None and plan.step == core.next_step:
            trained[plan.step] = core.on_step_done(plan.step, plan.step + 1)
        core.cut_stragglers()
        for _, req in core.admit():
            issued.append(req.group_id)
            inflight.append([rng.randint(0, delay_max), req, core.version])
    core.abort_open("run_end")
    return trained


@pytest.mark.parametrize("eta,over,seed", [(0, 0.5, 1), (0, 1.0, 2), (1, 0.5, 3), (2, 1.0, 4), (1, 0.0, 5)])
def test_a_simulated_fleet_keeps_staleness_exactly_once_and_the_bound(eta, over, seed):
    logged, issued, over_bound = [], [], [0]
    core = make_core(eta=eta, B=2, n=2, steps=25, over=over, logged=logged)
    trained = fleet(core, random.Random(seed), 6, issued, over_bound)
    assert sorted(trained) == list(range(25))
    for step, recs in trained.items():
        assert len(recs) == 4 and all(r.version_min >= step - eta for r in recs), step
    assert over_bound[0] <= 0  # never more accepted than (eta + v + 1) B
    ids = [r.sample_id for r in logged]
    assert len(ids) == len(set(ids)) == 2 * len(issued)  # every issued sample ends exactly once
    cut = [r for r in logged if r.reason.startswith("straggler")]
    stale = [r for r in logged if r.reason.startswith("stale")]
    assert (len(cut) > 0) == (over > 0)
    if eta == 0:
        assert stale == []  # at eta 0 the cut leaves nothing to go stale
