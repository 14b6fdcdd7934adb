"""scheduler/health.py: truncation, lengths, group reward spread, staleness at the bound, idle fractions."""

import pytest

from areal_async.scheduler.health import IdleMeter, sample_health, trainer_idle
from areal_async.scheduler.ledger import SampleRecord


def rec(sid, group, score, n_out, finish="stop", version_min=5):
    return SampleRecord(
        sid, group, "p", 0, n_output_tokens=n_out, finish_reason=finish, score=score, version_min=version_min
    )


def test_a_step_by_hand():
    trained = [
        rec("a0", "a", 0.0, 4),
        rec("a1", "a", 0.0, 12, "length"),  # all zero
        rec("b0", "b", 1.0, 6),
        rec("b1", "b", 1.0, 8),  # all one
        rec("c0", "c", 1.0, 10, version_min=4),
        rec("c1", "c", 0.0, 12, "length", version_min=4),  # mixed
    ]
    h = sample_health(trained, step=6, eta=2)
    assert h["truncated_frac"] == pytest.approx(2 / 6)
    assert h["completion_len_mean"] == pytest.approx(52 / 6)
    # sorted 4 6 8 10 12 12: p50 = ceil(3)rd = 8, p90 = ceil(5.4) = 6th = 12
    assert (h["completion_len_p50"], h["completion_len_p90"], h["completion_len_max"]) == (8.0, 12.0, 12.0)
    assert h["groups_all_zero_frac"] == pytest.approx(1 / 3)
    assert h["groups_all_one_frac"] == pytest.approx(1 / 3)
    assert h["staleness_at_bound_frac"] == pytest.approx(2 / 6)  # 6 - 4 = 2 = eta for the c samples


def test_eta_zero_has_no_bound_column_and_no_samples_no_columns():
    assert "staleness_at_bound_frac" not in sample_health([rec("a", "a", 1.0, 3)], step=3, eta=0)
    assert sample_health([], step=3, eta=1) == {}


def test_trainer_idle_is_the_share_neither_training_nor_publishing():
    assert trainer_idle({"train_s": 0.3, "publish_s": 0.1}, 1.0) == pytest.approx(0.6)
    assert trainer_idle({"train_s": 2.0}, 1.0) == 0.0  # clamped
    assert trainer_idle({}, 1.0) is None


def test_idle_meter_over_a_trailing_window():
    m = IdleMeter(window_s=10.0)
    assert m.add(0.0, 2, 0.0) is None  # no span yet
    assert m.add(5.0, 2, 5.0) == pytest.approx(0.5)  # 5 busy s of 2 x 5 s
    assert m.add(10.0, 2, 15.0) == pytest.approx(0.25)  # 15 of 20
    # t=20: the window drops t=0 (the oldest kept point is t=10): 4 busy s of 2 x 10
    assert m.add(20.0, 2, 19.0) == pytest.approx(0.8)
    assert m.add(21.0, 2, 3.0) is None  # a restarted worker counts from 0: start again
    assert m.add(23.0, 2, 5.0) == pytest.approx(0.5)
