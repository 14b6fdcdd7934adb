"""benchmarks.trainer_ranks compares set-ups that run the same forwards (counted, not assumed)."""

import pytest

from benchmarks import trainer_ranks as bench
from areal_async.trainer.actor import PPOActor


@pytest.mark.parametrize("fused, expected", [(False, 2), (True, 1)])
def test_one_rank_runs_the_proximal_forward_of_its_own_unless_fused(fused, expected):
    """One micro-batch (8 x 8 tokens under 4096): the proximal logprobs' forward plus the update's = 2 a
    step, as a rank of K > 1 runs them; fused (the default K = 1 trainer) the update's alone = 1."""
    actor = PPOActor(bench.model(32, 1), bench.actor_cfg(), 1.0, 10)
    if not fused:
        actor.prox_from_update = False
    times, forwards = bench.time_steps(actor, bench.batch(8, 4, 4), repeats=2)
    assert len(times) == 2 and forwards == expected
    with bench.counting_forwards() as n:  # the modules are themselves again after the block
        pass
    actor.train_step(bench.batch(8, 4, 4))
    assert n() == 0


def test_set_ups_with_different_forward_counts_are_not_compared():
    bench.check_equal_forwards({"plain_1": [2.0], "fsdp_1": [2.0], "fsdp_2": [2.0, 2.0], "plain_1_fused": [1.0]})
    with pytest.raises(RuntimeError, match="forwards per step differ"):
        bench.check_equal_forwards({"plain_1": [1.0], "fsdp_1": [2.0], "fsdp_2": [2.0, 2.0]})
    with pytest.raises(RuntimeError, match="forwards per step differ"):
        bench.check_equal_forwards({"plain_1": [2.0], "fsdp_1": [2.0], "fsdp_2": [2.0, 3.0]})
