"""benchmarks/common/metrics.py (figures from a run's metrics rows) and fleet.placement, on synthetic rows."""

import pytest
from tests.support.bench_fixtures import make_rows

from benchmarks.common import metrics as m
from benchmarks.common.fleet import placement


def test_moving_average_uses_full_trailing_windows():
    assert m.moving_average([1, 2, 3, 4, 5], 2) == [1.5, 2.5, 3.5, 4.5]
    assert m.moving_average([1, 2, 3], 3) == [2.0]
    assert m.moving_average([1, 2], 3) == []
    with pytest.raises(ValueError, match="window"):
        m.moving_average([1.0], 0)


def test_time_to_threshold_first_full_window_and_seconds_since_step0():
    rewards = [1.0] * 5 + [0.0] * 5 + [0.9] * 20  # early luck must not count: no full window yet
    rows = make_rows(30, step_s=2.0, train_s=1.0, rewards=rewards)
    step, secs = m.time_to_threshold(rows, threshold=0.8, window=10)
    # window ending at step i holds the steps i-9..i; mean >= 0.8 first at i = 18 (0.9 * 9 / 10 = 0.81)
    assert step == 18
    assert secs == pytest.approx(18 * 2.0)


def test_steady_throughput_excludes_warmup_rows():
    rows = make_rows(20, step_s=0.5, train_s=0.3, batch=100)
    rows[1]["wall_s"] += 100.0  # a slow warm-up step must not change the steady figure
    for r in rows[2:]:
        r["wall_s"] += 100.0
    assert m.steady_samples_per_s(rows, skip=2) == pytest.approx(100 / 0.5)
    with pytest.raises(ValueError, match="metrics rows"):
        m.steady_samples_per_s(rows[:3], skip=2)


def test_phase_times_split_a_synchronous_step():
    rows = make_rows(20, step_s=1.0, train_s=0.55, publish_s=0.05, gen_busy_per_step=0.25)
    ph = m.phase_times(rows, skip=5)
    assert ph["t_train"] == pytest.approx(0.6)
    assert ph["t_gen"] == pytest.approx(0.4)  # step_s - train - publish
    assert ph["t_gen_engine"] == pytest.approx(0.25)
    assert ph["step_s"] == pytest.approx(1.0)  # step 0's 25 s start-up is outside the window


def test_phase_times_count_the_forward_run_ahead_as_training_and_as_overlap():
    # a 1 s step: the trainer waited 0.4 s (0.1 s of it running the step's first forward ahead),
    # then trained 0.55 s and published 0.05 s after the plan
    rows = make_rows(20, step_s=1.0, train_s=0.55, publish_s=0.05)
    for r in rows:
        r["ahead_s"] = 0.1
    ph = m.phase_times(rows, skip=5)
    assert (ph["t_gen"], ph["t_train"], ph["t_ahead"]) == pytest.approx((0.4, 0.7, 0.1))
    # perfect overlap: a step of max(0.4, 0.7) = 0.7 s instead of 1 s
    assert m.ideal_limit(ph["t_gen"], ph["t_train"], ph["t_ahead"]) == pytest.approx(1.0 / 0.7)
    with pytest.raises(ValueError, match="t_ahead"):
        m.ideal_limit(0.4, 0.7, 0.8)


def test_ideal_limit():
    assert m.ideal_limit(1.0, 1.0) == pytest.approx(2.0)
    assert m.ideal_limit(0.4, 0.6) == pytest.approx(1.0 / 0.6)
    assert m.ideal_limit(0.0, 0.6) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="t_gen"):
        m.ideal_limit(0.0, 0.0)
    with pytest.raises(ValueError, match="t_gen"):
        m.ideal_limit(-0.1, 0.5)


def test_cpu_limit_adds_the_machine_as_a_bound():
    # t_gen 0.2, t_train 0.25: ideal 1.8x; 0.6 CPU-s per step on 2 cores -> a step >= 0.3 s
    assert m.cpu_limit(0.2, 0.25, 0.6, 2) == pytest.approx(0.45 / 0.3)
    assert m.cpu_limit(0.2, 0.25, 0.4, 2) == pytest.approx(m.ideal_limit(0.2, 0.25))


def test_placement_gives_the_trainer_a_cpu_of_its_own():
    assert placement([0, 1], []) == [
        "cluster.cpu_affinity.trainer=0",
        "cluster.cpu_affinity.scheduler=1",
        "cluster.cpu_affinity.rollout=1",
        "cluster.cpu_affinity.reward=1",
    ]
    assert placement([2, 5, 6], [])[-1] == "cluster.cpu_affinity.reward=5,6"
    assert placement([0], []) == []  # one CPU: nothing to separate
    assert placement([0, 1], ["cluster.cpu_affinity.trainer=1"]) == []  # the caller's placement wins
