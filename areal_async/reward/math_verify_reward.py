"""The boba math reward: the last ``\\boxed{}`` answer checked with math-verify.

Covered: ``boxed_math_reward`` (1.0 if the boxed answer, found by ``answers.extract_boxed`` (re-exported
here), is equivalent to ANY reference solution per math-verify ``parse`` + ``verify``, else 0.0; no box or a
parse failure gives 0.0). References may be bare answers (``"7"``, ``"1/2"``), contain ``\\boxed{}``, or
contain ``$...$`` math.

Not covered: timeouts. math-verify's own timeout uses ``signal.alarm``, which only works in a
main thread and cannot interrupt C code holding the GIL, so we switch it OFF here
(``parsing_timeout=None``, ``timeout_seconds=None``) and run this function inside
``areal_async.reward.pool.RewardPool``, whose parent kills a check that runs past its deadline.
Calling it directly on adversarial input (``9^{9^{9^{9^{9}}}}``) can therefore run for minutes.
"""

from __future__ import annotations

import logging

from math_verify import parse, verify

from areal_async.reward.answers import BOXED as _BOXED
from areal_async.reward.answers import extract_boxed

__all__ = ["extract_boxed", "boxed_math_reward"]


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; it is off on purpose here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def boxed_math_reward(completion: str, solutions: list[str], precision: int = 6) -> float:
    """1.0 if the completion's last boxed answer matches any of ``solutions``, else 0.0.

    ``precision`` is math-verify's ``float_rounding`` (digits kept when comparing numbers).
    """
    _check_inputs(completion, solutions, precision)
    answer = extract_boxed(completion)
    if answer is None or not answer.strip():
        return 0.0
    predicted = parse(_BOXED + "{" + answer + "}", parsing_timeout=None)
    if not predicted:
        return 0.0
    for solution in solutions:
        gold = parse(_as_latex(solution), parsing_timeout=None)
        if gold and verify(gold, predicted, float_rounding=precision, timeout_seconds=None):
            return 1.0
    return 0.0


def _as_latex(solution: str) -> str:
    """Make a reference parseable: keep boxed / ``$``-delimited math, box a bare answer."""
    boxed = extract_boxed(solution)
    if boxed is not None:
        return _BOXED + "{" + boxed + "}"
    if "$" in solution or "\\(" in solution or "\\[" in solution:
        return solution
    return _BOXED + "{" + solution.strip() + "}"


def _check_inputs(completion, solutions, precision) -> None:
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}: {completion!r:.80}")
    if not isinstance(solutions, (list, tuple)) or not solutions:
        raise ValueError(f"solutions must be a non-empty list of str, got {solutions!r:.80}")
    bad = [s for s in solutions if not isinstance(s, str)]
    if bad:
        raise TypeError(f"solutions must all be str, got {type(bad[0]).__name__}: {bad[0]!r:.80}")
    if isinstance(precision, bool) or not isinstance(precision, int) or precision < 0:
        raise ValueError(f"precision must be an int >= 0 (math-verify float_rounding), got {precision!r}")
