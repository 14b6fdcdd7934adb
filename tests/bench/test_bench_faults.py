"""benchmarks.faults: which roles a preset's fleet offers to the kills, and that one seed draws the same
kills on every preset with the same roles (the table compares presets under the same faults)."""

from pathlib import Path

import pytest

from areal_async.config import load_config
from benchmarks.faults import ROLES, fleet_roles, kill_plan, overrides

ROOT = Path(__file__).resolve().parents[2]


def roles(preset: str, *extra: str) -> tuple[str, ...]:
    return fleet_roles(load_config(ROOT / "configs" / preset, overrides(60, 10, 3) + list(extra)))


def test_each_preset_offers_the_roles_its_fleet_has():
    assert roles("tiny_arith.yaml") == ROLES == ("rollout", "reward", "trainer", "scheduler")
    assert roles("tiny_arith.yaml", "cluster.n_trainer_ranks=2") == ROLES  # trainer-1 is a 'trainer' process
    assert roles("multi_turn_math.yaml") == ROLES
    assert roles("tiny_arith.yaml", "rollout.backend=sglang") == (*ROLES, "sglang")
    attached = "sglang.addresses=['http://127.0.0.1:9','http://127.0.0.1:10']"  # servers of their own: not ours
    assert roles("tiny_arith.yaml", "rollout.backend=sglang", attached) == ROLES
    ext = roles("tiny_arith.yaml", "cluster.n_reward_workers=0", "cluster.n_external_reward_workers=1")
    assert ext == ("rollout", "trainer", "scheduler", "external")


def test_one_seed_draws_the_same_kills_on_presets_with_the_same_roles():
    tiny = kill_plan(1, 10, 60, roles("tiny_arith.yaml"))
    assert tiny == kill_plan(1, 10, 60) == kill_plan(1, 10, 60, roles("multi_turn_math.yaml"))
    steps = [s for s, _, _ in tiny]
    assert steps == sorted(steps) and min(b - a for a, b in zip(steps, steps[1:])) >= 3  # a checkpoint between
    with pytest.raises(ValueError, match="room for at most 2 kills"):
        kill_plan(1, 3, 10)
