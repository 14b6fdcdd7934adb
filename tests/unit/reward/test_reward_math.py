"""boxed_math_reward / extract_boxed in-process (no pool): answers, references, precision."""

import pytest

from areal_async.reward.math_verify_reward import boxed_math_reward, extract_boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{a^{2}}{b_{1}}} done", r"\frac{a^{2}}{b_{1}}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"$\boxed 5$", "5"),
        (r"\boxed {7}", "7"),
        (r"\boxed{3} and a truncated \boxed{\frac{1}{", "3"),
        ("no answer here", None),
        (r"\boxed", None),
        (r"\boxedx{3}", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "completion, solutions, expected",
    [
        (r"The answer is \boxed{7}.", ["7"], 1.0),
        (r"The answer is \boxed{8}.", ["7"], 0.0),
        (r"\boxed{8}", ["7", r"\boxed{8}", "9"], 1.0),  # any reference matching is enough
        (r"\boxed{10}", ["7", "9"], 0.0),
        (r"\boxed{1/2}", ["0.5"], 1.0),
        (r"\boxed{\frac{1}{2}}", ["1/2"], 1.0),
        (r"\boxed{0.5}", [r"$\frac{1}{2}$"], 1.0),
        (r"\boxed{-3}", ["-3"], 1.0),
        (r"\boxed{3}", ["-3"], 0.0),
        (r"\boxed{\{2, 1\}}", [r"\boxed{\{1,2\}}"], 1.0),
        (r"\boxed{2\sqrt{2}}", [r"\sqrt{8}"], 1.0),
        ("The answer is 7 (no box).", ["7"], 0.0),
        (r"\boxed{}", ["7"], 0.0),
    ],
)
def test_boxed_math_reward(completion, solutions, expected):
    assert boxed_math_reward(completion, solutions) == expected


def test_score_is_a_float():
    assert type(boxed_math_reward(r"\boxed{7}", ["7"])) is float


def test_precision_is_math_verify_float_rounding():
    # 0.3333 agrees with 1/3 to 4 digits, not to 6.
    assert boxed_math_reward(r"\boxed{0.3333}", ["1/3"], precision=3) == 1.0
    assert boxed_math_reward(r"\boxed{0.3333}", ["1/3"], precision=6) == 0.0
    assert boxed_math_reward(r"\boxed{0.333333}", ["1/3"]) == 1.0  # default 6
    assert boxed_math_reward(r"\boxed{0.333333}", ["1/3"], precision=8) == 0.0


@pytest.mark.parametrize(
    "completion, solutions, error",
    [
        (None, ["7"], TypeError),
        (r"\boxed{7}", [], ValueError),
        (r"\boxed{7}", "7", ValueError),
        (r"\boxed{7}", [7], TypeError),
    ],
)
def test_bad_inputs_raise(completion, solutions, error):
    with pytest.raises(error, match="completion|solutions"):
        boxed_math_reward(completion, solutions)


def test_bad_precision_raises():
    with pytest.raises(ValueError, match="precision"):
        boxed_math_reward(r"\boxed{7}", ["7"], precision=-1)
