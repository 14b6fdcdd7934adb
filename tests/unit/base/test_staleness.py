"""The staleness rule as a pure function (invariant 1)."""

import itertools

import pytest

from areal_async.base.staleness import admission_budget, can_admit, is_fresh_enough


def test_eta_zero_admits_exactly_one_batch_per_version():
    B = 4
    assert [can_admit(a, 0, 0, 0, B) for a in range(6)] == [True] * 4 + [False] * 2
    assert can_admit(3, 0, 0, 0, B) and not can_admit(3, 1, 0, 0, B)
    # after step 0 published version 1: room for exactly one more batch
    assert admission_budget(4, 0, 1, 0, B) == 4


def test_budget_grows_with_eta_and_version():
    for eta, v, B in itertools.product(range(4), range(4), (1, 3, 8)):
        limit = (eta + v + 1) * B
        assert admission_budget(0, 0, v, eta, B) == limit
        assert can_admit(limit - 1, 0, v, eta, B)
        assert not can_admit(limit, 0, v, eta, B)
        assert not can_admit(limit - 2, 2, v, eta, B)  # running groups count too


def test_fresh_enough_is_version_min_at_least_step_minus_eta():
    assert is_fresh_enough(3, 5, 2) and not is_fresh_enough(2, 5, 2)
    assert is_fresh_enough(5, 5, 0) and not is_fresh_enough(4, 5, 0)


@pytest.mark.parametrize("bad", [dict(eta=-1), dict(batch_size=0), dict(version=-1)])
def test_bad_arguments_are_refused(bad):
    args = dict(accepted=0, running=0, version=0, eta=1, batch_size=2) | bad
    with pytest.raises(ValueError, match="can_admit"):
        can_admit(**args)
