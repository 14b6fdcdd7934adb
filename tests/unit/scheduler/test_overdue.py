"""Whose work is overdue (scheduler/overdue.py): the holder of the oldest unfinished work is named,
never the worker that idles longest. Hand-built status documents, one per way a run gets stuck, and
``open_work`` read off a real SchedulerCore on a fake clock."""

from areal_async.data.prompts import PromptCursor
from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.scheduler.overdue import open_work, overdue

from tests.unit.scheduler.test_scheduler_core import reward_msg, traj_msg


def worker(role, silent=0.2, waiting="", **stats):
    return {"role": role, "silent_s": silent, "waiting_for": waiting, "stats": stats}


def status(work, **workers):
    return {"trainer_ready": True, "waiting_for": "0/4 groups ready for step 3", "work": work, "workers": workers}


IDLE_REWARD = worker("reward", silent=0.9, waiting="reward requests", scoring_oldest_s=0.0)
IDLE_TRAINER = worker("trainer", silent=0.4, waiting="a BatchPlan for step 3")


def test_a_hung_workflow_names_the_rollout_and_its_workflow_not_the_idle_reward_worker():
    """The issue's case: the rollouts' episodes never return; the reward worker idles (it was named)."""
    st = status(
        {"generate": {"group": "g4", "worker": "rollout-1", "age_s": 55.0}, "score": None, "train": None},
        **{
            "trainer": IDLE_TRAINER,
            "reward-0": IDLE_REWARD,
            "rollout-0": worker("rollout", engine_step_s=0.0, episodes=8, episode_oldest_s=50.0, workflow="m:Hang"),
            "rollout-1": worker("rollout", engine_step_s=0.0, episodes=8, episode_oldest_s=55.0, workflow="m:Hang"),
        },
    )
    assert overdue(st) == (
        "rollout (rollout-1 holds group g4, issued 55s ago and not generated; rollout-1 last heartbeat 0.2s ago; "
        "stuck in its workflow m:Hang: 8 episode(s) running, the oldest for 55s (engine step now 0s))"
    )


def test_a_hung_engine_names_the_rollouts_engine():
    st = status(
        {"generate": {"group": "g9", "worker": "rollout-0", "age_s": 40.0}, "score": None, "train": None},
        **{"trainer": IDLE_TRAINER, "reward-0": IDLE_REWARD, "rollout-0": worker("rollout", engine_step_s=38.0)},
    )
    assert overdue(st).startswith("rollout (rollout-0 holds group g9, issued 40s ago and not generated;")
    assert overdue(st).endswith("stuck in its engine: one step running for 38s)")
    # a workflow waiting on that engine: still the engine (its step is as old as the work)
    st["workers"]["rollout-0"]["stats"].update(episodes=4, episode_oldest_s=40.0, workflow="m:W")
    assert "stuck in its engine: one step running for 38s" in overdue(st)
    # a short step while the work is old: the engine steps on; the waiting line is named
    st["workers"]["rollout-0"]["stats"].update(engine_step_s=0.3, episodes=0)
    st["workers"]["rollout-0"]["waiting_for"] = "generating 1 group(s), 0 queued"
    assert "stuck in generating 1 group(s), 0 queued)" in overdue(st)


def test_a_hung_reward_check_names_the_reward_worker_with_the_oldest_check():
    st = status(
        {
            "generate": {"group": "g12", "worker": "rollout-0", "age_s": 3.0},
            "score": {"group": "g8", "worker": "rollout-0", "age_s": 31.0},
            "train": None,
        },
        **{
            "trainer": IDLE_TRAINER,
            "reward-0": worker("reward", waiting="scoring 1 group(s)", scoring_oldest_s=2.0),
            "reward-1": worker("reward", silent=0.5, waiting="scoring 1 group(s)", scoring_oldest_s=30.5),
            "rollout-0": worker("rollout", engine_step_s=0.1),
        },
    )
    assert overdue(st) == (
        "reward (group g8 generated 31s ago and not scored; reward-1 last heartbeat 0.5s ago, stuck in a check "
        "running for 30.5s)"
    )
    st["workers"]["rollout-0"]["stats"]["workflow"] = "m:W"  # a workflow scores its own episodes
    assert overdue(st).startswith("rollout (group g8 generated 31s ago and not scored: rollout-0's workflow")


def test_a_stopped_trainer_is_named_even_while_rollouts_idle_longer():
    """SIGSTOP: the trainer's heartbeat stops; the rollouts idle at the staleness budget."""
    st = status(
        {"generate": None, "score": None, "train": {"step": 3, "age_s": 62.0}},
        **{
            "trainer": worker("trainer", silent=61.0, waiting="its own train_step (step 3)"),
            "reward-0": worker("reward", silent=0.3, waiting="reward requests"),
            "rollout-0": worker("rollout", silent=0.1, waiting="generating 0 group(s), 0 queued"),
        },
    )
    assert overdue(st, heartbeat_s=0.5) == (
        "trainer (step 3 planned 62s ago, not finished; trainer silent for 61s, waiting for its own train_step "
        "(step 3))"
    )


def test_the_oldest_work_wins_and_a_lost_holder_is_said():
    work = {
        "generate": {"group": "g2", "worker": "rollout-3", "age_s": 20.0},
        "score": None,
        "train": {"step": 5, "age_s": 19.0},
    }
    assert overdue(status(work, trainer=IDLE_TRAINER)).endswith("; rollout-3 is not registered: lost)")
    work["train"]["age_s"] = 21.0
    assert overdue(status(work)) == "trainer (step 5 planned 21s ago, not finished; no trainer registered: lost)"
    assert overdue({"trainer_ready": False, "waiting_for": "the trainer to register", "work": {}}).startswith(
        "trainer (not ready"
    )
    assert overdue(status({})).startswith("scheduler (no work in flight")


def test_open_work_reads_the_cores_books():
    t = [1000.0]
    params = SchedulerParams(
        batch_size=2, n_samples=2, eta=1, total_steps=9, max_concurrent=1, gen=dict(max_new_tokens=4)
    )
    core = SchedulerCore(params, PromptCursor(5, seed=0), lambda i: ([1, i], ["x"]), clock=lambda: t[0])
    core.add_rollout("r0")
    core.on_trainer_ready(0, 0)
    a = core.admit()[0][1]
    t[0] += 1.0
    core.p.max_concurrent = 2  # the second group one second later
    b = core.admit()[0][1]
    t[0] += 3.0
    assert open_work(core, t[0], None) == {
        "generate": {"group": a.group_id, "worker": "r0", "age_s": 4.0},
        "score": None,
        "train": None,
    }
    core.on_trajectory(traj_msg(a.group_id, a.sample_ids))
    t[0] += 2.5
    work = open_work(core, t[0], plan_t=990.0)
    assert work["generate"] == {"group": b.group_id, "worker": "r0", "age_s": 5.5}
    assert work["score"] == {"group": a.group_id, "worker": "r0", "age_s": 2.5}
    assert work["train"] is None  # no step planned: plan_t is ignored
    core.on_reward(reward_msg(a.group_id, a.sample_ids))
    core.on_trajectory(traj_msg(b.group_id, b.sample_ids))
    core.on_reward(reward_msg(b.group_id, b.sample_ids))
    plan, _ = core.plan()
    assert plan is not None and core.trainer_busy
    assert open_work(core, t[0], plan_t=t[0] - 7.0) == {
        "generate": None,
        "score": None,
        "train": {"step": 0, "age_s": 7.0},
    }
