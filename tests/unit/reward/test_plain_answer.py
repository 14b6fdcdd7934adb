"""Plain-text answers (reward/plain_answer.py): the last number of a completion, by hand-picked texts whose
last number is read off by eye. The reasoning-gym variant (gym_reward.gym_plain_reward): test_gym_reward.py."""

from __future__ import annotations

import pytest

from areal_async.reward.plain_answer import last_number, plain_answer_reward


@pytest.mark.parametrize(
    "text, want",
    [
        ("The answer is 13.", "13"),
        ("6 + 0 - 1 + 8 = 13", "13"),
        ("8-3=5", "5"),  # '-' between two numbers is an operator, not a sign
        ("so the total is -5", "-5"),
        ("x = +4", "4"),
        ("It costs 1,234 dollars", "1234"),
        ("2.50 then 3.", "3"),
        ("a list: 3,4", "4"),  # not a thousands separator: two numbers
        ("step2", "2"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number_reads_what_was_written_last(text, want):
    assert last_number(text) == want


def test_plain_answer_reward_compares_numbers_not_strings():
    assert plain_answer_reward("The answer is 13.", ["13"]) == 1.0
    assert plain_answer_reward("that is 13.0", ["13"]) == 1.0
    assert plain_answer_reward("13, no wait, 14", ["13"]) == 0.0  # the last number stated counts
    assert plain_answer_reward("The answer is thirteen", ["13"]) == 0.0
    assert plain_answer_reward("= 1,000", ["1000", "1e3"]) == 1.0
    with pytest.raises(ValueError, match="non-empty list"):
        plain_answer_reward("13", [])
