"""Liveness pieces on their own: failing loops end the process's wait, group deadlines, bounded
re-issue, the trainer's bounded drop list, the supervisor's lost-worker kill and step watchdog."""

import asyncio
import json
import os
import signal
import sys
import time

import pytest
from protocols.trajectories import TrajectoryBatch

from areal_async.config import from_dict
from areal_async.data.prompts import PromptCursor
from areal_async.scheduler.core import SchedulerCore, SchedulerParams
from areal_async.supervisor import fleet
from areal_async.supervisor.fleet import Child, Supervisor
from areal_async.supervisor.watchdog import silence_report
from areal_async.trainer.buffer import TrajectoryBuffer
from areal_async.base.aio import RoleLoopError, TaskSet

from tests.unit.scheduler.test_scheduler_core import reward_msg, traj_msg

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
GRACE = fleet.GRACE_S + 3.0  # a SIGTERMed sleep exits at once; the SIGKILL after GRACE_S is not needed


# ---- TaskSet -----------------------------------------------------------------------------


async def _forever():
    await asyncio.sleep(3600)


async def _boom(after: float):
    await asyncio.sleep(after)
    raise KeyError("not a refusal: a bug")


def test_a_failing_task_ends_the_wait_with_its_name_and_cause():
    async def main():
        ts, stop = TaskSet(), asyncio.Event()
        calm = ts.spawn(_forever(), "calm", forever=True)
        ts.spawn(_boom(0.05), "serve", forever=True)
        with pytest.raises(RoleLoopError, match="task 'serve' failed: KeyError") as e:
            await asyncio.wait_for(ts.wait(stop), timeout=5)  # without TaskSet this waited for ever
        assert isinstance(e.value.__cause__, KeyError)
        await asyncio.sleep(0)
        assert calm.cancelled()

    asyncio.run(main())


def test_a_loop_that_returns_is_a_failure_and_stop_is_not():
    async def main():
        ts, stop = TaskSet(), asyncio.Event()
        ts.spawn(asyncio.sleep(0.01), "loop", forever=True)
        with pytest.raises(RoleLoopError, match="task 'loop' ended"):
            await asyncio.wait_for(ts.wait(stop), timeout=5)
        ts2, stop2 = TaskSet(), asyncio.Event()
        ts2.spawn(asyncio.sleep(0.01), "one-shot")  # not forever: returning is fine
        ts2.spawn(_forever(), "calm", forever=True)
        asyncio.get_running_loop().call_later(0.1, stop2.set)
        await asyncio.wait_for(ts2.wait(stop2), timeout=5)
        ts2.cancel()

    asyncio.run(main())


# ---- deadlines and bounded re-issue (fake clock) -------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def deadline_core(logged, clock, gen=30.0, reward=10.0, max_reissues=-1, n=2):
    params = SchedulerParams(
        batch_size=1,
        n_samples=n,
        eta=1,
        total_steps=50,
        max_concurrent=1,
        gen=dict(max_new_tokens=4),
        gen_deadline_s=gen,
        reward_deadline_s=reward,
        max_reissues=max_reissues,
    )
    core = SchedulerCore(
        params, PromptCursor(7, seed=0), lambda i: ([1, 2, i], [str(i)]), log_sample=logged.append, clock=clock
    )
    core.add_rollout("r0")
    core.on_trainer_ready(0, 0)
    return core


def test_reward_worker_lost_while_trajectory_ready_was_queued_group_ends_by_deadline():
    """The hang of the issue: the reward worker dies holding the request while the group's
    TrajectoryReady is still queued at the scheduler (its samples are 'issued', so the loss
    aborts nothing); then TrajectoryReady arrives and no score ever will. Before deadlines the
    group stayed 'running' for ever and its admission slot was lost."""
    logged, clock = [], Clock()
    core = deadline_core(logged, clock)
    [(_, req)] = core.admit()
    assert core.lose_reward_worker("reward-0", "restarted") == []  # nothing was 'generated' yet
    assert core.on_trajectory(traj_msg(req.group_id, req.sample_ids)) is None
    assert core.admit() == []  # the budget (max_concurrent=1) is held by the stuck group
    clock.t += 10.0
    assert core.expire() == []  # not past 10 s yet
    clock.t += 0.5
    aborted = core.expire()
    assert [r.sample_id for r in aborted] == list(req.sample_ids)
    assert all(
        r.status == "aborted" and r.reason.startswith("deadline: no score 10.5s after generation") for r in aborted
    )
    assert core.ledger.groups[req.group_id].status == "aborted"
    [(_, again)] = core.admit()  # the slot is free again and the prompt comes back first
    assert again.prompt_id == req.prompt_id and again.group_id != req.group_id
    # a late score for the aborted group changes nothing
    assert "already aborted" in core.on_reward(reward_msg(req.group_id, req.sample_ids))
    assert core.n_reissued == {"prompts": 1, "samples": 2, "dropped": 0}


def test_a_group_never_generated_ends_by_the_generation_deadline():
    logged, clock = [], Clock()
    core = deadline_core(logged, clock, gen=30.0, reward=0.0)
    [(_, req)] = core.admit()
    clock.t += 29.0
    assert core.expire() == []
    clock.t += 2.0
    aborted = core.expire()
    assert len(aborted) == 2 and "not generated 31.0s after issue to r0" in aborted[0].reason
    assert core.running == 0 and list(core.reissue) == [(core.ledger.groups[req.group_id].problem_index, req.prompt_id)]


def test_a_scored_group_is_not_expired_and_deadlines_can_be_off():
    logged, clock = [], Clock()
    core = deadline_core(logged, clock)
    [(_, req)] = core.admit()
    core.on_trajectory(traj_msg(req.group_id, req.sample_ids))
    core.on_reward(reward_msg(req.group_id, req.sample_ids))
    clock.t += 1e6
    assert core.expire() == [] and core.deadlines.issued_at == {} and core.deadlines.generated_at == {}
    off = deadline_core([], clock, gen=0.0, reward=0.0)
    off.admit()
    clock.t += 1e6
    assert off.expire() == []


def test_a_prompt_re_issued_max_times_is_dropped_with_the_reason_in_the_books():
    logged, clock = [], Clock()
    core = deadline_core(logged, clock, gen=5.0, max_reissues=2)
    prompt = None
    for _ in range(3):  # aborted 3 times: re-issued twice, then dropped
        [(_, req)] = core.admit()
        prompt = prompt or req.prompt_id
        assert req.prompt_id == prompt
        clock.t += 6.0
        core.expire()
    last = logged[-1]
    assert last.prompt_id == prompt and last.status == "aborted"
    assert f"prompt {prompt} dropped after 2 re-issues (rollout.max_reissues=2)" in last.reason
    assert all("dropped" not in r.reason for r in logged[:-2])
    assert core.n_reissued == {"prompts": 2, "samples": 4, "dropped": 1}
    assert prompt not in core.reissues and not core.reissue
    [(_, nxt)] = core.admit()
    assert nxt.prompt_id != prompt  # the cursor moves on


def test_re_issue_counts_survive_a_checkpoint():
    logged, clock = [], Clock()
    core = deadline_core(logged, clock, gen=5.0)
    core.admit()
    clock.t += 6.0
    core.expire()
    state = json.loads(json.dumps(core.state()))
    again = deadline_core([], clock, gen=5.0)
    again.restore(state)
    assert again.reissues == core.reissues and again.n_reissued == core.n_reissued


# ---- the trainer's buffer stays bounded -----------------------------------------------------


class Channel:
    def __init__(self):
        self.frames = []

    def recv(self, timeout_s):
        if not self.frames:
            time.sleep(0.01)
            raise TimeoutError
        return self.frames.pop(0)


def group(gid: str, *sids: str) -> tuple:
    """One rollout group message as the channel returns it (key, meta, tensors): one output token a sample."""
    n = len(sids)
    key, tensors, meta = TrajectoryBatch.group(gid, sids, [1], [1] * n, [1] * n, [0.0] * n, [0] * n).encode()
    return key, meta, tensors


def test_trajectory_buffer_drop_list_is_bounded_and_late_tensors_are_refused_once():
    ch = Channel()
    buf = TrajectoryBuffer(ch, max_dropped=3)
    buf.thread.start()
    try:
        ch.frames.append(group("ga", "a"))
        deadline = time.monotonic() + 5
        while "a" not in buf.items:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        buf.drop(["a"])  # already here: freed, nothing to remember
        assert buf.items == {} and list(buf.dropped) == []
        buf.drop(["b", "c", "d", "e"])  # never arrived: remembered, oldest forgotten past 3
        assert list(buf.dropped) == ["c", "d", "e"]
        ch.frames += [group("gd", "d"), group("gf", "f")]
        while "f" not in buf.items:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "d" not in buf.items and list(buf.dropped) == ["c", "e"]  # refused once, then forgotten
    finally:
        buf.stopping.set()
        buf.thread.join(timeout=5)


# ---- supervisor: lost workers are killed; the step watchdog names the silent role -------------


def supervisor(tmp_path, *overrides):
    sup = Supervisor(from_dict({}, list(overrides)), tmp_path, progress=False)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return sup


def child(sup, name, cmd):
    log = sup.run_dir / "logs" / f"{name}.log"
    c = Child(name, sup._spawn(cmd, log, None), log, cmd)
    sup.children.append(c)
    return c


def test_a_lost_trainer_that_does_not_exit_is_killed_and_fails_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fleet, "LOST_KILL_GRACE_S", 0.3)
    sup = supervisor(tmp_path)
    child(sup, "scheduler", SLEEP)
    trainer = child(sup, "trainer", SLEEP)
    stale = {"worker": "trainer", "role": "trainer", "pid": trainer.proc.pid + 99999, "why": "old incarnation"}
    line = {"worker": "trainer", "role": "trainer", "pid": trainer.proc.pid, "why": "no heartbeat for 4s"}
    (tmp_path / "lost.jsonl").write_text(json.dumps(stale) + "\n" + json.dumps(line) + "\n")
    t0 = time.monotonic()
    try:
        assert sup.watch(poll_s=0.05) == 1
    finally:
        sup.stop_all()
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert "worker trainer" in err and "killed by signal 9" in err
    assert "declared lost by the scheduler: no heartbeat for 4s" in err


def test_step_watchdog_fails_the_run_and_names_the_silent_trainer(tmp_path, capsys):
    sup = supervisor(tmp_path, "cluster.step_timeout_s=1.5", "cluster.heartbeat_s=0.2")
    sched = child(sup, "scheduler", [sys.executable, "-c", "import time; time.sleep(60)"])
    child(sup, "trainer", SLEEP)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')

    def status():  # a live scheduler: rewritten often; the trainer is busy and silent
        (tmp_path / "status.json").write_text(
            json.dumps(
                {
                    "next_step": 1,
                    "trainer_ready": True,
                    "trainer_busy": True,
                    "waiting_for": "the trainer to finish step 1 (planned 2s ago)",
                    "work": {"generate": None, "score": None, "train": {"step": 1, "age_s": 2.0}},
                    "workers": {
                        "trainer": {"role": "trainer", "silent_s": 2.0, "waiting_for": "its own train_step (step 1)"},
                        "rollout-0": {"role": "rollout", "silent_s": 0.1, "waiting_for": "generating 0 group(s)"},
                    },
                }
            )
        )

    orig = sup.watchdog.check
    sup.watchdog.check = lambda: (status(), orig())[1]
    t0 = time.monotonic()
    assert sup.watch(poll_s=0.05) == 1
    assert 1.4 <= time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert (
        "(cluster.step_timeout_s=1.5): overdue: trainer (step 1 planned 2s ago, not finished; trainer silent for "
        "2s, waiting for its own train_step (step 1))"
    ) in err
    assert "The scheduler waits for the trainer to finish step 1" in err and "the run failed" in err
    assert sched.proc.poll() is not None


def test_silence_report_names_the_scheduler_when_its_status_is_stale():
    cfg = from_dict({}, ["cluster.step_timeout_s=30"])
    assert "overdue: scheduler (its status.json is 40s old)" in silence_report({"workers": {}}, 40.0, 31, cfg)
    assert "overdue: scheduler (its status.json is missing)" in silence_report(None, None, 31, cfg)
    st = {
        "trainer_busy": False,
        "trainer_ready": True,
        "waiting_for": "1/4 groups ready for step 3",
        "work": {"generate": None, "score": {"group": "g7", "worker": "rollout-0", "age_s": 25.0}, "train": None},
        "workers": {
            "trainer": {"role": "trainer", "silent_s": 0.5, "waiting_for": "a BatchPlan for step 3"},
            "rollout-0": {"role": "rollout", "silent_s": 0.2, "waiting_for": "generating 0 group(s)"},
            "reward-0": {"role": "reward", "silent_s": 25.0, "waiting_for": "scoring 2 group(s)"},
        },
    }
    report = silence_report(st, 1.0, 31, cfg)
    assert (
        "overdue: reward (group g7 generated 25s ago and not scored; reward-0 silent for 25s, stuck in scoring "
        "2 group(s))"
    ) in report
    assert "The scheduler waits for 1/4 groups ready for step 3" in report


def test_follower_trainer_ranks_die_with_their_leader(tmp_path, capsys):
    """2 ranks: the leader (worker 'trainer') is SIGKILLed; the follower (trainer-1, blocked in its
    collective for ever here) is stopped at once with the rest of the fleet, not left running."""
    sup = supervisor(tmp_path, "cluster.n_trainer_ranks=2")
    child(sup, "scheduler", SLEEP)
    leader, follower = child(sup, "trainer", SLEEP), child(sup, "trainer-1", SLEEP)
    os.kill(leader.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        assert sup.watch(poll_s=0.05) == 1
    finally:
        sup.stop_all()
    assert follower.proc.poll() is not None and time.monotonic() - t0 < GRACE
    assert "worker trainer (pid" in capsys.readouterr().err
