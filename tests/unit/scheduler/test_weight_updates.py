"""The fleet's weight-update clock (scheduler.weight_updates): totals and phases by hand."""

from __future__ import annotations

import pytest

from areal_async.app.commands.status import render
from areal_async.scheduler.weight_updates import WeightUpdates, metrics_columns
from protocols.messages import StatusReport, WeightsLoaded, WeightsPublished, decode, encode


def _times(manifest, received, start, loaded, **split):
    return {"manifest": manifest, "received": received, "load_start": start, "loaded": loaded, **split}


def test_the_update_ends_when_the_last_rollout_generates_with_it_and_its_phases_add_up():
    wu = WeightUpdates()
    wu.published(3, t_ready=100.0, t_sent=100.5)
    slow = _times(100.6, 100.9, 101.0, 101.4, load_s=0.1, recompute_s=0.3)
    assert wu.loaded("r0", 3, slow, rollouts=["r0", "r1"]) is None  # r1 still on v2
    assert wu.loaded("r1", 3, {"manifest": 100.55}, rollouts=["r0", "r1"]) is None  # incomplete: not booked
    row = wu.loaded("r1", 3, _times(100.55, 100.7, 100.7, 101.2), rollouts=["r0", "r1"])
    want = {"publish_s": 0.5, "notify_s": 0.1, "receive_s": 0.3, "queue_s": 0.1, "load_s": 0.1, "recompute_s": 0.3}
    assert row["weight_update_s"] == pytest.approx(1.4) and row["slowest_worker"] == "r0" and row["workers"] == 2
    assert {k: row[k] for k in want} == pytest.approx(want)
    assert sum(row[k] for k in want) == pytest.approx(row["weight_update_s"])
    cols = metrics_columns(row)
    assert cols["weight_update_version"] == 3 and cols["weight_update_recompute_s"] == pytest.approx(0.3)
    assert wu.loaded("r1", 3, slow, rollouts=["r0", "r1"]) is None  # already complete: counted once


def test_a_lost_workers_load_does_not_stand_in_for_its_replacements():
    """r0 loads and is lost, r2 registers: two loads (r0, r1) for two rollouts (r1, r2) are not all of them."""
    wu = WeightUpdates()
    wu.published(4, t_ready=10.0, t_sent=10.1)
    assert wu.loaded("r0", 4, _times(10.2, 10.3, 10.3, 10.4), rollouts=["r0", "r1"]) is None
    assert wu.loaded("r1", 4, _times(10.2, 10.3, 10.3, 10.5), rollouts=["r1", "r2"]) is None  # r2 still owes it
    row = wu.loaded("r2", 4, _times(10.2, 10.3, 10.3, 10.9), rollouts=["r1", "r2"])
    assert row["slowest_worker"] == "r2" and row["workers"] == 3 and row["weight_update_s"] == pytest.approx(0.9)


def test_untimed_and_unknown_versions_and_an_engine_without_a_split():
    wu = WeightUpdates()
    wu.published(0, t_ready=0.0, t_sent=5.0)  # the initial weights: no optimizer step to time from
    assert wu.loaded("r0", 0, _times(5.1, 5.2, 5.3, 5.4), rollouts=["r0"]) is None and wu.last == {}
    assert wu.loaded("r0", 9, _times(5.1, 5.2, 5.3, 5.4), rollouts=["r0"]) is None  # never published
    wu.published(1, t_ready=10.0, t_sent=10.25)
    row = wu.loaded("r0", 1, _times(10.5, 11.0, 11.0, 11.75), rollouts=["r0"])
    assert row["load_s"] == pytest.approx(0.75) and row["recompute_s"] == 0.0  # no split: all of it is load
    assert metrics_columns({}) == {}


def test_the_times_travel_in_the_messages_and_status_shows_the_last_update():
    m = decode(encode(WeightsPublished(version=2, manifest={}, t_ready=1.5, t_sent=2.0)))
    assert (m.t_ready, m.t_sent) == (1.5, 2.0)
    loaded = decode(encode(WeightsLoaded(worker_id="r0", version=2, times=_times(2.1, 2.2, 2.3, 2.6))))
    wu = WeightUpdates()
    wu.published(2, m.t_ready, m.t_sent)
    wu.loaded(loaded.worker_id, loaded.version, loaded.times, rollouts=["r0"])
    report = StatusReport(
        nonce=1, version=2, next_step=2, total_steps=4, finished=False, wall_s=3.0, admitted=4, running=0,
        ready=0, stale=0, samples_trained=8, samples_aborted=0, weight_update=wu.last,
    )  # fmt: skip
    text = render(decode(encode(report)))
    assert "weights v2: every rollout generating 1.100s after the optimizer step" in text
    assert "publish 0.500, notify 0.100, receive 0.100, queue 0.100, load 0.300, recompute 0.000" in text
