"""benchmarks.data_path's accounting on hand-made inputs, and its real-service figure's null fleet
(the mix it replays, its answers) and one short run of it against the real SchedulerService."""

import pytest

from benchmarks import data_path as bench
from benchmarks.common import check_rows, scheduler_load as sl
from protocols import messages as M


@pytest.mark.parametrize(
    "traj, reward",
    [("batch:trajectory_ready", "batch:reward_result"), ("trajectories_ready", "reward_results")],
    ids=["batch", "before the batch envelope"],
)
def test_a_runs_summary_gives_the_mix_per_step(traj, reward):
    """The default run's counts: 139 heartbeats in 100 steps; 3158 groups in 233 batches of TrajectoryReady
    plus 74 lone TrajectoryReady = 3232 groups in 307 messages (10.5 -> 11 a message); 3232 groups in 262
    batches of RewardResult (12.3 -> 12). A summary of a run before the Batch envelope names the batches
    by their old types; it gives the same mix."""
    summary = {
        "steps": 100,
        "messages_received": {
            "heartbeat": 139,
            traj: 233,
            "trajectory_ready": 74,
            reward: 262,
            "train_step_done": 100,
        },
        "groups_in_batched_messages": {traj: 3158, reward: 3232},
    }
    mix = sl.Mix.of_summary(summary, n_metrics=24, source="r")
    assert (mix.heartbeats, mix.traj_groups, mix.reward_groups, mix.n_metrics) == (1.39, 11, 12, 24)
    assert mix.per_step["trajectory_ready"] == pytest.approx(0.74) and mix.per_step["train_step_done"] == 1.0
    assert bench.DEFAULT_MIX.traj_groups == mix.traj_groups and bench.DEFAULT_MIX.heartbeats == mix.heartbeats


def test_the_summary_of_an_earlier_run_is_refused_by_name(tmp_path):
    (tmp_path / "summary.json").write_text('{"steps": 3}')
    with pytest.raises(SystemExit, match="no messages_received"):
        bench.mix_of(str(tmp_path))


def test_the_window_counts_messages_steps_and_cpu_between_two_snapshots():
    """2 s apart: 4 + 6 + 2 = 12 messages (6/s; 12 / 1.5 CPU-s = 8 per CPU-s), 4 steps (2/s), 512
    samples (256/s); the null fleet used 1.9 CPU-s of 2 s (0.95 of a core): it may have bound the rate.
    Versions 5 -> 9, with 1 then 3 WeightsLoaded still owed at the two ends."""
    a = {"t": 10.0, "cpu": 5.0, "fleet_cpu": 1.0, "received": {"heartbeat": 10, "x": 5}, "step": 5, "samples": 640}
    a |= {"version": 5, "owed": 1}
    b = {"t": 12.0, "cpu": 6.5, "fleet_cpu": 2.9, "step": 9, "samples": 1152, "version": 9, "owed": 3}
    b["received"] = {"heartbeat": 14, "x": 11, "y": 2}
    w = sl._window(a, b, None)
    assert w["value"] == pytest.approx(6.0) and w["messages"] == 12
    assert w["messages_per_cpu_s"] == pytest.approx(8.0) and w["service_cpu_frac"] == pytest.approx(0.75)
    assert w["steps_per_s"] == pytest.approx(2.0) and w["samples_trained_per_s"] == pytest.approx(256.0)
    assert w["mix_per_step"] == {"heartbeat": 1.0, "x": 1.5, "y": 0.5}
    assert w["null_fleet_cpu_frac"] == pytest.approx(0.95) and w["bound"].startswith("null fleet")
    assert w["received"] == {"heartbeat": 4, "x": 6, "y": 2} and w["versions"] == 4 and w["weights_owed"] == [1, 3]
    b["fleet_cpu"] = 2.0
    assert sl._window(a, b, None)["bound"] == "scheduler service"


class Recorded(sl.NullFleet):
    """The null fleet with its sends recorded instead of sent."""

    def __init__(self, tmp_path, mix):
        roles = {"trainer": "trainer", "rollout-0": "rollout", "reward-0": "reward"}
        super().__init__(f"ipc://{tmp_path}/nobody.sock", roles, {w: "t" for w in roles}, mix, {"m": 1})
        self.sent = []

    def send(self, wid, msg):
        self.sent.append((wid, msg))


def test_the_null_fleet_answers_in_the_mixs_chunks_with_the_requested_versions(tmp_path):
    """25 groups given at min_version 3: batches of 11, 11 and 3 TrajectoryReady from the rollout
    worker, of 12, 12 and 1 RewardResult from the reward worker (always a batch)."""
    fleet = Recorded(tmp_path, sl.Mix(heartbeats=1.39, traj_groups=11, reward_groups=12))
    try:
        sids = [[f"g{i}.{j}" for j in range(4)] for i in range(25)]
        req = M.Batch.of([M.GenerateRequest(f"g{i}", f"p{i}", sids[i], [1, 2], ["3"], 3, 4) for i in range(25)])
        fleet.on_message("rollout-0", req)
        assert fleet.sent == []  # answered when the frames that arrived together are all in
        fleet.flush()
        traj = [m for w, m in fleet.sent if w == "rollout-0"]
        scored = [m for w, m in fleet.sent if w == "reward-0"]
        assert [m.size for m in traj] == [11, 11, 3] and {m.kind for m in traj} == {"trajectory_ready"}
        assert [m.size for m in scored] == [12, 12, 1] and {m.kind for m in scored} == {"reward_result"}
        assert {v for m in traj for g in m.items() for v in g.version_min} == {3}
        assert [g.group_id for m in traj for g in m.items()] == [f"g{i}" for i in range(25)]
    finally:
        fleet.close()


def test_the_null_fleet_trains_publishes_and_beats_as_the_mix_says(tmp_path):
    """Each BatchPlan: WeightsPublished(step + 1), TrainStepDone(step); heartbeats 1.39 a step come
    as 1, 1, 2 after three steps (the fractions carried over: 1.39, 1.78, 2.17)."""
    fleet = Recorded(tmp_path, sl.Mix(heartbeats=1.39, traj_groups=11, reward_groups=12, n_metrics=3))
    try:
        beats = []
        for step in range(3):
            fleet.sent = []
            fleet.on_message("trainer", M.BatchPlan(step=step, sample_ids=[], group_ids=[], scores=[]))
            kinds = [type(m).__name__ for _, m in fleet.sent]
            assert kinds[:2] == ["WeightsPublished", "TrainStepDone"]
            assert fleet.sent[0][1].version == step + 1 and fleet.sent[1][1].step == step
            assert len(fleet.sent[1][1].metrics) == 3
            beats.append(kinds.count("Heartbeat"))
        assert beats == [1, 1, 2]
        fleet.on_message("rollout-0", M.WeightsPublished(version=7, manifest={}))
        assert fleet.sent[-1] == ("rollout-0", M.WeightsLoaded(worker_id="rollout-0", version=7))
        fleet.on_message("reward-0", M.Error(code="refused", detail="no"))
        assert fleet.errors == ["reward-0: refused: no"]
    finally:
        fleet.close()


def test_bound_rows_divide_the_copy_by_the_path_in_wall_and_cpu_time():
    """The copy took 0.25 s of wall and 0.2 s of CPU, the path 1.0 s and 0.8 s: 0.25 both ways. Only the
    payload-only bound (the row's first definition) carries the target, judged on shm only."""
    common = {"seconds": 1.0, "cpu_seconds": 0.8}
    payload = bench.bound_row("boba_batch_fraction_of_payload_memcpy", "shm", 0.25, 0.2, 10**9, common)
    written = bench.bound_row("boba_batch_fraction_of_payload_and_packed_memcpy", "shm", 0.25, 0.2, 10**9, common)
    zmq = bench.bound_row("boba_batch_fraction_of_payload_memcpy", "zmq", 0.25, 0.2, 10**9, common)
    check_rows([payload, written, zmq])
    assert payload["value"] == pytest.approx(0.25) and payload["cpu_fraction"] == pytest.approx(0.25)
    assert payload["bound_gbps"] == pytest.approx(4.0) and payload["meets_target"] is False
    assert bench.TARGET_ROW == "boba_batch_fraction_of_payload_memcpy"
    assert written["target"] is None and written["meets_target"] is None
    assert zmq["target"] == 0.5 and zmq["meets_target"] is None


def test_the_real_service_takes_the_null_fleets_mix_with_no_refusal():
    """One second of the real SchedulerService (tiny_arith: 32 groups of 4 a step, 2 rollout workers)
    under the default mix: nothing refused, every step trains its 128 samples, one TrainStepDone a step.
    Held against the null fleet's own count of what it sent and got (kept in its own process, not read
    from the scheduler): once the fleet stopped and the service drained, the service took exactly the
    WeightsLoaded and heartbeats the fleet sent; every version the fleet's trainer published reached both
    rollout workers, but for those whose forward was still on its way when the fleet stopped."""
    # The window is wall time: ~700 steps in its 1 s on an idle machine, but a loaded runner that stalls
    # the service's process for most of it leaves fewer than the 3 steps the per-step mix below needs. Such a
    # window is measured again, longer (1, 2 then 4 s); a service that trains fewer than 3 steps in every
    # window still fails, and a refusal fails at once (never measured away).
    for seconds in (1.0, 2.0, 4.0):
        m = sl.measure(bench.SERVICE_CONFIG, [], bench.DEFAULT_MIX, seconds=seconds, warmup_steps=2)
        assert m["n_fleet_errors"] == 0, m["fleet_errors"]
        if m["steps"] >= 3:
            break
    assert m["steps"] >= 3 and m["messages"] > 0
    assert m["samples_trained_per_s"] == pytest.approx(128 * m["steps_per_s"])
    assert m["mix_per_step"]["train_step_done"] == pytest.approx(1.0, abs=1.5 / m["steps"])
    fleet, got = m["fleet_counts"], m["drained_received"]
    rollouts = ["rollout-0", "rollout-1"]
    sent_loaded = sum(fleet.get(f"sent weights_loaded {w}", 0) for w in rollouts)
    assert sent_loaded > 0 and got["weights_loaded"] == sent_loaded
    assert got["heartbeat"] == sum(n for k, n in fleet.items() if k.startswith("sent heartbeat "))
    published = fleet["sent weights_published trainer"]  # version 0 and one a step, by the fleet's trainer
    for w in rollouts:  # the scheduler forwards each to every rollout worker; at most 2 in flight (plan ahead)
        assert 0 <= published - fleet[f"got weights_published {w}"] <= 2, (w, fleet)
    # the fleet's heartbeats: 1.39 a step (the mix), counted where they were sent (whole ones: within 1)
    steps_done = fleet["sent train_step_done trainer"]
    beats = sum(n for k, n in fleet.items() if k.startswith("sent heartbeat "))
    assert abs(beats - bench.DEFAULT_MIX.heartbeats * steps_done) <= 1
