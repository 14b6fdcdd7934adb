"""The reasoning-gym mixture: how ``size`` problems are split among weighted tasks and laid out, and the
fraction of prompts each task gets when the run's prompt cursor walks them (counted by brute force).

Expected values come from the weights alone (hand-computed shares, size * w / sum w), not from the code.
The last test makes real reasoning-gym problems and checks their answers against the expressions' own
arithmetic (eval of the operands the prompt shows).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from areal_async.config import ConfigError, load_config
from areal_async.config.gym_tasks import GymTask, apportion
from areal_async.data.gym import GymSource, interleave
from areal_async.data.prompts import PromptCursor

CHAIN = str(Path(__file__).resolve().parents[3] / "configs/chain_sum.yaml")


def tasks(*weights: float) -> list[GymTask]:
    return [GymTask(f"t{i}", w, {}) for i, w in enumerate(weights)]


@pytest.mark.parametrize(
    "weights, size, expected",
    [
        ([1, 1, 1], 10, [4, 3, 3]),  # 3.33 each: the one extra goes to the first (ties by order)
        ([0.5, 0.3, 0.2], 7, [4, 2, 1]),  # 3.5, 2.1, 1.4: floors 3, 2, 1; the largest remainder (.5) gets one
        ([3, 2, 1], 600, [300, 200, 100]),
        ([2, 1], 5, [3, 2]),  # 3.33, 1.67: floors 3, 1; the remainder .67 goes to the second
    ],
)
def test_apportion_matches_hand_computed_counts(weights, size, expected):
    assert apportion(weights, size) == expected


def test_apportion_is_the_closest_integer_split_found_by_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        k, size = rng.randint(1, 3), rng.randint(3, 9)
        weights = [rng.uniform(0.1, 5) for _ in range(k)]
        exact = [size * w / sum(weights) for w in weights]
        splits = [c for c in itertools.product(range(size + 1), repeat=k) if sum(c) == size]
        best = min(max(abs(c - x) for c, x in zip(split, exact)) for split in splits)
        got = apportion(weights, size)
        assert sum(got) == size and max(abs(c - x) for c, x in zip(got, exact)) == pytest.approx(best)


def test_every_prefix_of_the_layout_holds_each_task_within_one_of_its_share():
    counts = [7, 4, 1]
    layout = interleave(counts)
    assert sorted(layout) == [(t, j) for t, n in enumerate(counts) for j in range(n)]  # each problem once
    seen = [0, 0, 0]
    for k, (t, _) in enumerate(layout, 1):
        seen[t] += 1
        for u in range(3):
            assert abs(seen[u] - k * counts[u] / 12) <= 1, (k, seen)


@pytest.mark.parametrize("shuffle", [True, False])
def test_prompt_fractions_per_task_are_within_2_percent_of_the_weights(shuffle):
    weights = [0.5, 0.3, 0.2]
    source = GymSource(tasks(*weights), size=1000, seed=3)
    cursor = PromptCursor(len(source), seed=3, shuffle=shuffle)
    counts = [0, 0, 0]
    for n in range(1, 5001):  # five epochs: what 160 steps of 32 prompts issue
        counts[source.task_of(cursor.next()[0])] += 1
        # a shuffled epoch's prefix is a draw without replacement: half an epoch in, one task's count is off
        # by ~8 of 2500 (std); the unshuffled layout is within one problem of every share at every prefix
        if n in (1000, 2500, 5000) or (not shuffle and n >= 50):
            assert all(abs(c / n - w) <= 0.02 for c, w in zip(counts, weights)), (n, counts)
    assert counts == [2500, 1500, 1000]  # whole epochs: exactly the weights


def test_a_negative_or_zero_weight_and_a_size_too_small_for_every_task_are_config_errors():
    base = ["train_dataset.type=reasoning_gym", "reward.fn=areal_async.reward.gym_reward:gym_reward"]
    with pytest.raises(ConfigError, match=r"train_dataset\.tasks\[1\]\.weight=-1: expected a number > 0"):
        load_config(CHAIN, [*base, "train_dataset.tasks=[{name: a}, {name: b, weight: -1}]"])
    with pytest.raises(ConfigError, match=r"train_dataset\.tasks\[0\]\.weight=0: expected a number > 0"):
        load_config(CHAIN, [*base, "train_dataset.tasks=[{name: a, weight: 0}]"])
    with pytest.raises(ConfigError, match=r"train_dataset\.size=2: expected enough problems for every task"):
        three = "train_dataset.tasks=[{name: a}, {name: b}, {name: c}]"
        load_config(CHAIN, [*base, "train_dataset.size=2", three])
    with pytest.raises(
        ConfigError, match=r"train_dataset\.tasks\[0\]\.config\.seed=5: expected a field of the task's config"
    ):
        load_config(CHAIN, [*base, "train_dataset.tasks=[{name: a, config: {seed: 5}}]"])


def test_real_chain_sum_problems_carry_their_oracle_answer_and_follow_the_weights():
    pytest.importorskip("reasoning_gym")
    knobs = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    source = GymSource([GymTask("chain_sum", 3.0, knobs), GymTask("products", 1.0, {"max_digits": 1})], 40, seed=1)
    problems = source.problems()
    names = [json.loads(p.solutions[0])["task"] for p in problems]
    assert names.count("chain_sum") == 30 and names.count("products") == 10
    for p in problems:
        expr = re.search(r"([-+*0-9 ]+?)(?: =|\.)", p.prompt.split(":")[-1]).group(1)
        assert json.loads(p.solutions[0])["answer"] == str(eval(expr)), p.prompt  # the arithmetic itself
        assert p.answer == "\\boxed{" + str(eval(expr)) + "}"
    assert source.problems() == problems  # made again: the same problems (seeded)
