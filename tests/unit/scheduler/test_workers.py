"""The scheduler's worker records (``scheduler/workers.py``): who may send what, restarts, silence, and
the rows status.json and the status report read, with every figure written out by hand."""

from __future__ import annotations

import pytest

from protocols.messages import Batch, Heartbeat, Ping, RewardResult, TrainStepDone

from areal_async.config.experiment import SaverConfig
from areal_async.scheduler.saves import Saves
from areal_async.scheduler.workers import WorkerRecord, WorkerTable

STEP_DONE = TrainStepDone(step=0, version=1, metrics={}, skipped_ids=[])


def table() -> WorkerTable:
    t = WorkerTable()
    t.add("rollout-0", "rollout", b"rollout-0", pid=11, host="h", now=100.0)
    t.add("trainer", "trainer", b"trainer", pid=12, host="h", now=100.0)
    return t


def test_a_sender_must_be_registered_on_its_own_connection_and_of_a_role_that_may_send_it():
    t = table()
    assert t.sender(b"rollout-0", Heartbeat(worker_id="rollout-0", ts=0.0), now=105.0) == "rollout-0"
    assert t["rollout-0"].last_seen == 105.0 and t["trainer"].last_seen == 100.0
    assert t.sender(b"stranger", Ping(nonce=1), now=106.0) == "stranger"  # a ping needs no registration
    with pytest.raises(ValueError, match="heartbeat from unregistered peer 'stranger'"):
        t.sender(b"stranger", Heartbeat(worker_id="stranger", ts=0.0), now=106.0)
    with pytest.raises(ValueError, match="a rollout worker may not send 'train_step_done' \\(only trainer\\)"):
        t.sender(b"rollout-0", STEP_DONE, now=106.0)
    scored = RewardResult("g1", "trainer", ["g1.0"], [1.0], ["ok"], [""])
    for msg in (scored, Batch.of([scored])):  # a batch is checked for its items' type
        with pytest.raises(ValueError, match=r"trainer worker may not send 'reward_result' \(only reward \| rollout\)"):
            t.sender(b"trainer", msg, now=106.0)
    t.records["rollout-0"].ident = b"rollout-0-old-connection"
    with pytest.raises(ValueError, match="not the connection that registered as 'rollout-0'"):
        t.sender(b"rollout-0", Heartbeat(worker_id="rollout-0", ts=0.0), now=107.0)
    # a message refused for its role still shows the worker alive (106); one from another connection does not
    assert t["rollout-0"].last_seen == 106.0


def test_restarts_count_registrations_of_an_id_after_its_record_is_gone():
    t = table()
    with pytest.raises(RuntimeError, match="registered already"):
        t.add("rollout-0", "rollout", b"rollout-0", 13, "h", 110.0)
    with pytest.raises(ValueError, match="role 'judge' is not rollout | reward | trainer"):
        t.add("j", "judge", b"j", 1, "h", 0.0)
    t.pop("rollout-0")
    t.add("rollout-0", "rollout", b"rollout-0", 13, "h", 110.0)
    t.pop("rollout-0")
    assert "rollout-0" not in t and t.restarts("rollout-0") == 1 and t.restarts("trainer") == 0
    t.add("rollout-0", "rollout", b"rollout-0", 14, "h", 120.0)
    assert t.restarts("rollout-0") == 2 and t["rollout-0"].pid == 14 and t.role("rollout") == ["rollout-0"]


def test_silence_busy_seconds_and_the_status_rows():
    t = table()
    t.add("reward-0", "reward", b"reward-0", 15, "h2", now=100.0)
    t["rollout-0"].last_seen, t["trainer"].last_seen = 130.0, 140.0
    assert t.silent(now=150.0, timeout_s=15.0) == [("rollout-0", 20.0), ("reward-0", 50.0)]
    t["rollout-0"].stats = {"busy_s": 2.5, "waiting_for": "weights v3", "engine_step_s": 0.4, "samples": 9}
    t["reward-0"].stats = {"busy_s": 1.0}
    assert t.busy_s_total("rollout") == 2.5 and t.busy_s_total("trainer") == 0.0
    assert t.status(150.0)["rollout-0"] == {
        "role": "rollout",
        "silent_s": 20.0,
        "waiting_for": "weights v3",
        "stats": {"engine_step_s": 0.4},  # only the stats the overdue check reads
    }
    rec = WorkerRecord("w", "rollout", b"w", 7, "h", since=100.0, last_seen=148.0, samples=30)
    assert rec.report(now=160.0, heartbeat_s=5.0, version=3, samples=30, restarts=1, groups=2) == {
        "worker_id": "w",
        "role": "rollout",
        "pid": 7,
        "host": "h",
        "state": "silent",  # 12 s silent > 2 heartbeats of 5 s
        "version": 3,
        "samples": 30,
        "samples_per_s": 0.5,  # 30 samples in the 60 s since it registered
        "groups": 2,
        "restarts": 1,
        "silent_s": 12.0,
    }


def test_saves_are_due_every_freq_steps_and_a_confirmation_clears_the_pending_one():
    s = Saves(SaverConfig(freq_steps=3), saved=-1)
    assert [step for step in range(9) if s.due(step)] == [2, 5, 8]
    s.asked(2)
    assert s.pending == 2
    s.confirmed(1)  # an older confirmation: the pending one still waits
    assert (s.saved, s.pending) == (1, 2)
    s.confirmed(2)
    assert (s.saved, s.pending) == (2, None)
    assert not any(Saves(SaverConfig(), saved=-1).due(step) for step in range(9))  # off by default


def test_the_ids_of_a_role_keep_registration_order_across_a_restart_and_the_view_stays_live():
    t = table()
    t.add("rollout-1", "rollout", b"rollout-1", 21, "h", 101.0)
    view = t.ids("rollout")
    assert list(view) == ["rollout-0", "rollout-1"] and t.role("trainer") == ["trainer"]
    t.pop("rollout-0")  # restarted: its new record comes after rollout-1
    t.add("rollout-0", "rollout", b"rollout-0", 22, "h", 102.0)
    t.add("reward-0", "reward", b"reward-0", 23, "h", 102.0)
    assert list(view) == t.role("rollout") == ["rollout-1", "rollout-0"] and len(view) == 2
    assert t.role("reward") == ["reward-0"] and list(t) == ["trainer", "rollout-1", "rollout-0", "reward-0"]
