"""trainer/algo/mismatch.py and the actor's columns: hand-computed gaps, percentiles and ESS."""

import math

import pytest
import torch

from protocols.trajectories import Trajectory, TrajectoryBatch

from areal_async.trainer.actor import PPOActor, rollout_entropy
from areal_async.trainer.compute.dp import decode_batch, encode_batch
from areal_async.trainer.algo.mismatch import ess_fraction, mismatch_metrics, nearest_rank
from tests.unit.trainer.test_trainer_actor import boba_cfg, make_trajs, tiny_model


def test_gap_mean_p99_and_lags_by_hand():
    prox = torch.tensor([0.0, -1.0, -2.0, -0.5])
    behav = torch.tensor([0.0, -1.5, -1.0, -0.5])  # gaps 0, 0.5, 1.0, 0
    m = mismatch_metrics(prox, behav, torch.tensor([0, 1, 1, 0]))
    assert m["logp_gap_mean"] == pytest.approx(0.375)
    assert m["logp_gap_p99"] == pytest.approx(1.0)  # ceil(0.99 * 4) = 4th smallest
    assert (m["logp_gap_mean_lag0"], m["logp_gap_p99_lag0"], m["tokens_lag0"]) == (0.0, 0.0, 2.0)
    assert m["logp_gap_mean_lag1"] == pytest.approx(0.75)
    assert m["logp_gap_p99_lag1"] == pytest.approx(1.0)
    # log w = 0, 0.5, -1, 0: w = 1, 1.648721, 0.367879, 1; (sum w)^2 / (4 sum w^2)
    assert m["ess_frac"] == pytest.approx(4.016600**2 / (4 * 4.853617), rel=1e-5)
    # p50: the ceil(0.5 * 4) = 2nd smallest of 0, 0, 0.5, 1; k3 = (w - 1) - log w: 0, 0.148721, 0.367879, 0
    assert (m["logp_gap_p50"], m["logp_gap_max"]) == (0.0, 1.0)
    assert m["kl_k3"] == pytest.approx((0.148721 + 0.367879) / 4, rel=1e-5)
    assert (m["logp_gap_p50_lag0"], m["logp_gap_max_lag0"], m["kl_k3_lag0"]) == (0.0, 0.0, 0.0)
    assert (m["logp_gap_p50_lag1"], m["logp_gap_max_lag1"]) == (0.5, 1.0)  # the 1st smallest of 0.5, 1
    assert m["kl_k3_lag1"] == pytest.approx((0.148721 + 0.367879) / 2, rel=1e-5)


def test_p99_is_the_nearest_rank():
    gaps = torch.arange(1, 201, dtype=torch.float32) / 100  # 0.01 .. 2.00
    assert nearest_rank(gaps, 0.99) == pytest.approx(1.98)  # the 198th of 200
    assert nearest_rank(torch.tensor([3.0]), 0.99) == 3.0
    assert math.isnan(nearest_rank(torch.tensor([]), 0.99))


def test_masked_tokens_do_not_count():
    prox, behav = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0.0, -9.0, -0.2])
    m = mismatch_metrics(prox, behav, torch.tensor([0, 0, 2]), torch.tensor([True, False, True]))
    assert m["logp_gap_mean"] == pytest.approx(0.1)
    assert "tokens_lag0" in m and m["tokens_lag0"] == 1.0 and m["tokens_lag2"] == 1.0
    assert mismatch_metrics(prox, behav, torch.tensor([0, 0, 0]), torch.zeros(3, dtype=torch.bool)) == {}


def test_ess_is_one_for_equal_weights_and_one_over_n_for_one_dominant():
    assert ess_fraction(torch.full((5,), 0.7)) == pytest.approx(1.0)
    assert ess_fraction(torch.tensor([0.0, -800.0, -800.0, -800.0])) == pytest.approx(0.25)  # no overflow


def test_unequal_lengths_are_refused():
    with pytest.raises(ValueError, match="expected equal"):
        mismatch_metrics(torch.zeros(3), torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize("n_minibatches", [1, 2])  # proximal from the update's forward / a forward of its own
def test_the_actor_reports_the_gap_by_lag(n_minibatches):
    model = tiny_model()
    trajs = make_trajs(model)  # on-policy behaviour logprobs; 12 output tokens, 6 in the first two
    actor = PPOActor(model, boba_cfg(ppo_n_minibatches=n_minibatches), 1.0, 10)
    actor.step = 2
    for t in trajs:
        t.versions = torch.full_like(t.versions, 2)
    for t in trajs[:2]:  # generated a version earlier, 3 nats less likely than the proximal policy says
        t.logprobs = t.logprobs - 3.0
        t.versions = torch.full_like(t.versions, 1)
    m = actor.train_step(trajs)
    assert m["tokens_lag1"] == 6.0 and m["tokens_lag0"] == 6.0
    assert m["logp_gap_mean_lag1"] == pytest.approx(3.0, abs=1e-4)
    assert m["logp_gap_mean_lag0"] == pytest.approx(0.0, abs=1e-4)
    assert m["logp_gap_mean"] == pytest.approx(1.5, abs=1e-4)
    assert m["logp_gap_p99"] == pytest.approx(3.0, abs=1e-4)
    e3 = math.exp(3.0)  # six weights e^3, six 1: (6 e^3 + 6)^2 / (12 (6 e^6 + 6))
    assert m["ess_frac"] == pytest.approx((e3 + 1) ** 2 / (2 * (e3 * e3 + 1)), rel=1e-3)


def test_rollout_entropy_is_the_engines_mean_over_trained_tokens_by_hand():
    """Rows with the engine's entropy (one masked), one without (no column: NaN when broadcast beside them)."""
    a = Trajectory("a", "g", [1], [2, 3], [-1.0, -1.0], [0, 0], 1.0, entropy=[0.5, 1.5])
    b = Trajectory("b", "g", [1], [4, 5, 6], [-1.0] * 3, [0] * 3, 0.0, loss_mask=[True, False, True],
                   entropy=[2.0, 9.0, 4.0])  # fmt: skip
    c = Trajectory("c", "h", [1], [7], [-1.0], [0], 0.0)
    want = (0.5 + 1.5 + 2.0 + 4.0) / 4  # the masked 9.0 is not trained
    cols = TrajectoryBatch.of_samples([a, b, c])
    assert rollout_entropy(cols.entropy, cols.loss_mask) == {"rollout_entropy": pytest.approx(want)}
    back = TrajectoryBatch.of_samples(decode_batch(encode_batch([a, b, c])))  # the rank broadcast carries it
    assert back.entropy.tolist()[2:5] == [2.0, 9.0, 4.0] and math.isnan(back.entropy[5].item())
    assert rollout_entropy(back.entropy, back.loss_mask) == {"rollout_entropy": pytest.approx(want)}
    assert rollout_entropy(None, torch.ones(1, dtype=torch.bool)) == {}  # no engine gave it: no metric
