"""The real scheduler process logic behind a real ROUTER socket: bad input is refused with a
clear error, nothing in the books changes, and the scheduler keeps serving."""

import asyncio
import contextlib
import logging
import os

import msgpack
import pytest
import zmq
import zmq.asyncio

from protocols import messages as M
from protocols.messages import decode
from protocols.sockets import ipc_endpoint, make_socket, send_message

from areal_async.config import from_dict
from areal_async.base.manifest import RunManifest
from areal_async.scheduler.service import SchedulerService


async def recv(sock, timeout=5.0):
    return decode(await asyncio.wait_for(sock.recv(), timeout))


async def test_scheduler_refuses_bad_frames_and_keeps_serving(tmp_path, caplog):
    cfg = from_dict({}, ["train_dataset.batch_size=2", "gconfig.n_samples=2"])
    ep = RunManifest(ipc_endpoint(tmp_path, "c"), ipc_endpoint(tmp_path, "t"), [], str(tmp_path))
    svc = SchedulerService(cfg, ep, tmp_path / "run", t0=0.0, tokenize=lambda s: [1] + [ord(c) for c in s])
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    w = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="rollout-0")
    stranger = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="nobody")
    try:
        await send_message(w, M.Register(role="rollout", worker_id="rollout-0", pid=os.getpid()))
        assert isinstance(await recv(w), M.RegisterAck)
        await send_message(w, M.TrainerReady(version=0, next_step=0))  # only the trainer may say this
        err = await recv(w)
        assert isinstance(err, M.Error) and err.code == "refused"
        assert "rollout worker may not send 'trainer_ready'" in err.detail
        assert not svc.core.trainer_ready
        with caplog.at_level(logging.ERROR):
            for frame in (
                os.urandom(40),
                msgpack.packb({"v": 99, "t": "ping", "b": {"nonce": 1}}),
                msgpack.packb({"v": M.PROTOCOL_VERSION, "t": "reward_result", "b": {"sample_ids": 3}}),
            ):
                await w.send(frame)
            errors = []
            while len(errors) < 3:
                msg = await recv(w)
                if isinstance(msg, M.Error):
                    errors.append(msg)
        assert all(e.code == "bad_frame" for e in errors)
        assert sum("rejected a frame" in r.getMessage() for r in caplog.records) == 3
        # a peer that never registered is refused by name
        await send_message(stranger, M.Heartbeat(worker_id="nobody", ts=0.0))
        err = await recv(stranger)
        assert isinstance(err, M.Error) and "unregistered peer 'nobody'" in err.detail
        # a result for a sample nobody issued changes nothing
        await send_message(
            w,
            M.TrajectoryReady(
                group_id="g99",
                worker_id="rollout-0",
                n_prompt_tokens=1,
                sample_ids=["g99.0"],
                n_output_tokens=[1],
                version_min=[0],
                version_max=[0],
                finish_reasons=["stop"],
            ),
        )
        await send_message(w, M.Ping(nonce=7))
        assert await recv(w) == M.Pong(nonce=7)
        assert svc.core.ledger.n_trained == 0 and "g99.0" not in svc.core.ledger.samples
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 5)
        ctx.destroy(linger=0)


async def _registered(ctx, ep, role: str, wid: str):
    sock = make_socket(ctx, zmq.DEALER, connect=ep.control, identity=wid)
    await send_message(sock, M.Register(role=role, worker_id=wid, pid=os.getpid()))
    assert isinstance(await recv(sock), M.RegisterAck)
    return sock


async def _next(sock, cls, timeout=10.0):
    while True:
        msg = await recv(sock, timeout)
        if isinstance(msg, cls):
            return msg


@contextlib.asynccontextmanager
async def _fleet(tmp_path, overrides: list[str]):
    """A scheduler service with a registered rollout-0, reward-0 and trainer (TrainerReady at
    version 0 sent); yields (service, rollout, reward, trainer) and stops it all on exit."""
    cfg = from_dict({}, overrides)
    ep = RunManifest(ipc_endpoint(tmp_path, "c"), ipc_endpoint(tmp_path, "t"), [], str(tmp_path))
    svc = SchedulerService(cfg, ep, tmp_path / "run", t0=0.0, tokenize=lambda s: [1] + [ord(c) for c in s])
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    try:
        rollout = await _registered(ctx, ep, "rollout", "rollout-0")
        reward = await _registered(ctx, ep, "reward", "reward-0")
        trainer = await _registered(ctx, ep, "trainer", "trainer")
        await send_message(trainer, M.TrainerReady(version=0, next_step=0))
        yield svc, rollout, reward, trainer
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 5)
        ctx.destroy(linger=0)


async def test_reward_results_book_each_group_once_and_plan_their_scores(tmp_path, caplog):
    """A reward worker's Batch of RewardResult (several groups, one message) books each group as its own
    RewardResult: the BatchPlan carries every sample's own score; the same results sent again
    change nothing; the trainer may not send one (the role check applies to the batch's items)."""
    async with _fleet(
        tmp_path, ["train_dataset.batch_size=2", "gconfig.n_samples=2", "rollout.max_head_offpolicyness=0"]
    ) as (svc, rollout, reward, trainer):
        reqs = (await _next(rollout, M.Batch)).items()  # eta 0: one batch of 2 groups, one message
        assert len(reqs) == 2
        for r in reqs:
            await send_message(
                rollout,
                M.TrajectoryReady(
                    group_id=r.group_id,
                    worker_id="rollout-0",
                    n_prompt_tokens=len(r.prompt_ids),
                    sample_ids=r.sample_ids,
                    n_output_tokens=[1, 1],
                    version_min=[0, 0],
                    version_max=[0, 0],
                    finish_reasons=["stop", "stop"],
                ),
            )
        scores = {r.group_id: [0.25 + k, 0.75 + k] for k, r in enumerate(reqs)}
        results = M.Batch.of(
            [M.RewardResult(r.group_id, "reward-0", r.sample_ids, scores[r.group_id], ["ok", "timeout"], ["", "killed"])
             for r in reqs]
        )  # fmt: skip
        await send_message(trainer, results)  # only reward (and, for their own groups, rollout) workers send these
        err = await _next(trainer, M.Error)
        assert err.code == "refused" and "trainer worker may not send 'reward_result'" in err.detail
        assert svc.counts["rewarded"] == 0
        await send_message(reward, results)
        plan = await _next(trainer, M.BatchPlan)
        assert plan.step == 0 and sorted(plan.group_ids) == sorted(r.group_id for r in reqs for _ in r.sample_ids)
        expected = {sid: s for r in reqs for sid, s in zip(r.sample_ids, scores[r.group_id])}
        assert dict(zip(plan.sample_ids, plan.scores)) == expected
        assert svc.counts["rewarded"] == 4
        with caplog.at_level(logging.WARNING):
            await send_message(reward, results)  # again: every sample is already scored
            await send_message(reward, M.Ping(nonce=3))
            assert await _next(reward, M.Pong) == M.Pong(nonce=3)
        assert svc.counts["rewarded"] == 4
        assert sum("ignored reward from reward-0" in r.getMessage() for r in caplog.records) == 2
        recs = [svc.core.ledger.samples[sid] for sid in expected]
        assert [r.reward_status for r in recs] == ["ok", "timeout", "ok", "timeout"]


async def test_trajectories_ready_books_each_group_once_and_plans_the_batch(tmp_path):
    """One Batch of TrajectoryReady for an engine step's two groups: each sample is booked generated once
    (the same message again changes nothing), and with the scores the batch is planned."""
    async with _fleet(
        tmp_path, ["train_dataset.batch_size=2", "gconfig.n_samples=2", "rollout.max_head_offpolicyness=0"]
    ) as (svc, rollout, reward, trainer):
        reqs = (await _next(rollout, M.Batch)).items()
        assert len(reqs) == 2
        ready = M.Batch.of(
            [M.TrajectoryReady(r.group_id, "rollout-0", len(r.prompt_ids), r.sample_ids, [3, 1], [0, 0], [0, 0],
                               ["stop", "length"]) for r in reqs]
        )  # fmt: skip
        sids = [sid for r in reqs for sid in r.sample_ids]
        for _ in range(2):  # the second copy is refused sample by sample
            await send_message(rollout, ready)
            await send_message(rollout, M.Ping(nonce=1))
            await _next(rollout, M.Pong)
            assert [svc.core.ledger.samples[sid].status for sid in sids] == ["generated"] * 4
            assert svc.counts["generated"] == 4
        await send_message(reward, ready)  # only a rollout worker may report trajectories
        err = await _next(reward, M.Error)
        assert "reward worker may not send 'trajectory_ready'" in err.detail
        for r in reqs:
            result = M.RewardResult(r.group_id, "reward-0", r.sample_ids, [1.0, 0.0], ["ok", "ok"], ["", ""])
            await send_message(reward, result)
        plan = await _next(trainer, M.BatchPlan)
        assert sorted(plan.sample_ids) == sorted(sids) and plan.step == 0
        assert [svc.core.ledger.samples[sid].n_output_tokens for sid in sids] == [3, 1, 3, 1]


async def test_a_rollout_workers_own_scores_in_a_batch_stop_at_the_first_group_it_does_not_hold(tmp_path):
    """A workflow's own rewards (a rollout worker's Batch of RewardResult): the groups before the first one it
    does not hold are booked and counted, that one is refused by name, the ones after it are not booked."""
    async with _fleet(
        tmp_path, ["train_dataset.batch_size=2", "gconfig.n_samples=2", "rollout.max_head_offpolicyness=0"]
    ) as (svc, rollout, reward, trainer):
        a, b = (await _next(rollout, M.Batch)).items()
        scored = [M.RewardResult(g, "rollout-0", s, [1.0, 0.5], ["ok", "ok"], ["", ""]) for g, s in (
            (a.group_id, a.sample_ids), ("g77", ["g77.0", "g77.1"]), (b.group_id, b.sample_ids))]  # fmt: skip
        await send_message(rollout, M.Batch.of(scored))
        err = await _next(rollout, M.Error)
        assert err.code == "refused" and "sent rewards for group 'g77', which it does not hold" in err.detail
        assert [svc.core.ledger.samples[s].score for s in a.sample_ids + b.sample_ids] == [1.0, 0.5, None, None]
        assert svc.counts["rewarded"] == 2 and svc.workers["rollout-0"].samples == 2


async def _complete(rollout, reward, reqs, version: int) -> None:
    """Each group's two samples generated with tokens of `version` and scored."""
    for r in reqs:
        await send_message(
            rollout,
            M.TrajectoryReady(r.group_id, "rollout-0", len(r.prompt_ids), r.sample_ids, [2, 2], [version] * 2,
                              [version] * 2, ["stop", "stop"]),
        )  # fmt: skip
        await send_message(
            reward, M.RewardResult(r.group_id, "reward-0", r.sample_ids, [1.0, 0.0], ["ok"] * 2, [""] * 2)
        )


def _requests(msg) -> list:
    return M.unbatch(msg)


async def test_plan_ahead_at_eta_one_stops_before_a_due_checkpoint(tmp_path):
    """η = 1, B = 1, a checkpoint after every 2nd step: the plan of step 1 is sent before
    TrainStepDone(0) (plan ahead), that of step 2 only after TrainStepDone(1) and after the
    CheckpointRequest of step 1, whose books hold no planned batch."""
    async with _fleet(
        tmp_path,
        ["train_dataset.batch_size=1", "gconfig.n_samples=2", "rollout.max_head_offpolicyness=1", "saver.freq_steps=2"],
    ) as (svc, rollout, reward, trainer):
        reqs = _requests(await _next(rollout, (M.Batch, M.GenerateRequest)))
        assert len(reqs) == 2  # (η + v + 1) * B
        await _complete(rollout, reward, reqs, 0)
        p0, p1 = await _next(trainer, M.BatchPlan), await _next(trainer, M.BatchPlan)
        assert (p0.step, p1.step) == (0, 1)  # both out before any TrainStepDone
        assert [p0.sample_ids, p1.sample_ids] == [r.sample_ids for r in reqs]
        await send_message(trainer, M.TrainStepDone(step=0, version=1, metrics={}))
        more = _requests(await _next(rollout, (M.Batch, M.GenerateRequest)))
        assert len(more) == 1 and more[0].min_version == 1
        await _complete(rollout, reward, more, 1)
        await send_message(rollout, M.Ping(nonce=7))
        await _next(rollout, M.Pong)  # the scheduler has booked the group: ready, not planned (save due)
        assert svc.core.ahead_groups is None and list(svc.core.ready) == [more[0].group_id]
        await send_message(trainer, M.TrainStepDone(step=1, version=2, metrics={}))
        ckpt = await _next(trainer, (M.CheckpointRequest, M.BatchPlan))
        assert isinstance(ckpt, M.CheckpointRequest) and ckpt.step == 1 and ckpt.state["next_step"] == 2
        groups = {g["group_id"]: g["status"] for g in ckpt.state["ledger"]["groups"]}
        assert groups[more[0].group_id] == "ready" and "batched" not in groups.values()
        p2 = await _next(trainer, M.BatchPlan)
        assert p2.step == 2 and p2.sample_ids == more[0].sample_ids


async def test_a_workflow_failure_aborts_its_group_and_too_many_fail_the_run(tmp_path):
    """GroupAborted from the holder: the group is aborted with the workflow's reason and its prompt
    re-issued (a new group, same prompt); from another worker it is refused; Error(workflow_failed)
    ends the run non-zero with the message, telling every worker."""
    over = ["train_dataset.batch_size=2", "gconfig.n_samples=2", "rollout.max_concurrent_rollouts=2"]
    async with _fleet(tmp_path, over) as (svc, rollout, reward, trainer):
        first = (await _next(rollout, M.Batch)).items()
        g0, p0 = first[0].group_id, first[0].prompt_id
        why = "workflow m:Flaky, sample %s.1: RuntimeError: sandbox down" % g0
        await send_message(reward, M.GroupAborted(group_id=g0, worker_id="reward-0", reason=why))
        err = await _next(reward, M.Error)
        assert err.code == "refused" and "a reward worker may not send 'group_aborted'" in err.detail
        await send_message(rollout, M.GroupAborted(group_id=g0, worker_id="rollout-0", reason=why))
        again = await _next(rollout, M.GenerateRequest)  # the freed slot: the same prompt, re-issued
        assert again.prompt_id == p0 and again.group_id != g0
        recs = [svc.core.ledger.samples.get(f"{g0}.{k}") for k in range(2)]
        assert all(r.status == "aborted" and r.reason == f"workflow_error: {why}" for r in recs)
        await send_message(rollout, M.GroupAborted(group_id="g77", worker_id="rollout-0", reason=why))
        assert "does not hold" in (await _next(rollout, M.Error)).detail
        await send_message(rollout, M.Error(code="workflow_failed", detail="workflow m:Flaky: 21 of ...; last: x"))
        down = await _next(trainer, M.Shutdown)
        assert down.reason == "run failed: rollout-0: workflow m:Flaky: 21 of ...; last: x" and not down.lost
        assert svc.done.is_set() and svc.exit_code == 1


async def test_a_group_past_its_deadline_is_aborted_at_its_holder(tmp_path):
    over = ["train_dataset.batch_size=2", "gconfig.n_samples=2", "rollout.max_concurrent_rollouts=1"]
    over += ["rollout.gen_deadline_s=0.3", "cluster.heartbeat_s=0.1"]
    async with _fleet(tmp_path, over) as (svc, rollout, reward, trainer):
        req = await _next(rollout, M.GenerateRequest)
        abort = await _next(rollout, M.AbortGroups, timeout=5.0)
        assert abort == M.AbortGroups(group_ids=[req.group_id], reason="deadline")
        assert svc.core.ledger.samples[f"{req.group_id}.0"].reason.startswith("deadline: not generated")


@pytest.mark.parametrize("mode, first", [("fleet", M.CheckpointRequest), ("rollout_only", M.Shutdown)])
async def test_stop_asks_a_final_checkpoint_only_of_a_trainer_that_learns(tmp_path, mode, first):
    """A stop after step 0: a fleet's trainer saves first; mode=rollout_only's saves nothing (it never
    answers a CheckpointRequest), so the fleet is told to shut down at once instead of waiting its grace."""
    async with _fleet(
        tmp_path,
        ["train_dataset.batch_size=1", "gconfig.n_samples=2", "rollout.max_head_offpolicyness=0", f"mode={mode}"],
    ) as (svc, rollout, reward, trainer):
        reqs = _requests(await _next(rollout, (M.Batch, M.GenerateRequest)))
        await _complete(rollout, reward, reqs, 0)
        await _next(trainer, M.BatchPlan)
        await send_message(trainer, M.TrainStepDone(step=0, version=1, metrics={}))
        await send_message(trainer, M.Ping(nonce=1))
        await _next(trainer, M.Pong)
        svc.request_stop()
        assert isinstance(await _next(trainer, (M.CheckpointRequest, M.Shutdown)), first)


@pytest.mark.parametrize("stopping", [False, True], ids=["running", "stopping"])
async def test_a_restarted_rollout_workers_undelivered_groups_are_asked_for_aborted_and_replanned(tmp_path, stopping):
    """Step 0 is planned with rollout-0's two groups; rollout-0 restarts (a new process registers
    under its id). The scheduler asks the trainer which of the old process's generated samples it
    holds (HeldQuery); the trainer never got the second group's. That group is aborted as
    trajectories_lost, its prompt re-issued to the new process, and once it is generated and scored
    step 0's plan is revised: the first group and the re-issued one. A reply to a query never sent
    is refused. ``stopping`` (SIGTERM before the reply): the step the trainer holds still gets its
    revision (only the lacking group is admitted), then the final checkpoint after it is asked."""
    over = ["train_dataset.batch_size=2", "gconfig.n_samples=2", "rollout.max_head_offpolicyness=0"]
    async with _fleet(tmp_path, over) as (svc, rollout, reward, trainer):
        ctx = zmq.asyncio.Context.instance()
        reqs = _requests(await _next(rollout, (M.Batch, M.GenerateRequest)))
        await _complete(rollout, reward, reqs, 0)
        plan = await _next(trainer, M.BatchPlan)
        assert (plan.step, plan.revision, plan.group_ids) == (0, 0, [r.group_id for r in reqs for _ in range(2)])
        ep = RunManifest(ipc_endpoint(tmp_path, "c"), "", [], str(tmp_path))  # _fleet's control endpoint
        again = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="rollout-0/restarted")
        await send_message(again, M.Register(role="rollout", worker_id="rollout-0", pid=os.getpid() + 1))
        assert isinstance(await recv(again), M.RegisterAck)
        query = await _next(trainer, M.HeldQuery)
        assert (query.worker_id, query.sample_ids) == ("rollout-0", plan.sample_ids)
        await send_message(trainer, M.HeldReply(query_id=query.query_id + 1, missing_ids=[]))
        assert "did not send" in (await _next(trainer, M.Error)).detail
        lost = reqs[1]
        if stopping:
            svc.request_stop()
        await send_message(trainer, M.HeldReply(query_id=query.query_id, missing_ids=lost.sample_ids))
        redo = _requests(await _next(again, (M.Batch, M.GenerateRequest)))
        assert [r.prompt_id for r in redo] == [lost.prompt_id] and redo[0].group_id != lost.group_id
        recs = [svc.core.ledger.samples[s] for s in lost.sample_ids]
        assert all(r.status == "aborted" and r.reason.startswith("trajectories_lost") for r in recs)
        assert svc.counts["trajectories_lost"] == 2
        await _complete(again, reward, redo, 0)
        rev = await _next(trainer, M.BatchPlan)
        assert (rev.step, rev.revision) == (0, 1)
        assert rev.sample_ids == reqs[0].sample_ids + redo[0].sample_ids
        assert set(lost.sample_ids) <= set(rev.aborted_ids)
        if stopping:
            assert svc.core.running == 0  # nothing admitted beyond the revision's one group
            await send_message(trainer, M.TrainStepDone(step=0, version=1, metrics={}))
            ckpt = await _next(trainer, M.CheckpointRequest)
            assert ckpt.step == 0 and ckpt.state["next_step"] == 1
        again.close(0)
