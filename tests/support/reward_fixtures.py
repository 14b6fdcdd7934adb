"""Reward functions that misbehave on purpose, loaded by dotted path into RewardPool children.

All follow the plug-in contract ``f(completion: str, solutions: list[str], **kwargs)``; the pool
tests name them as ``"reward_fixtures:<name>"`` (pytest puts ``tests/`` on ``sys.path`` and the
pool hands its ``sys.path`` to the children).
"""

import os
import re
import sys
import time


def exact_match(completion, solutions, strip: bool = False):
    """A minimal well-behaved plug-in: 1.0 if the completion equals a solution."""
    text = completion.strip() if strip else completion
    return 1.0 if text in solutions else 0.0


def length_parity(completion, solutions):
    """1.0 for a completion of odd length: mixed scores in a group from an untrained policy (a fleet test
    that needs unequal scores without the warm-up a real reward would take)."""
    return float(len(completion) % 2)


def sleep_echo(completion, solutions):
    """Sleep ``float(completion)`` seconds, then return ``float(solutions[0])`` (ordering tests)."""
    time.sleep(float(completion))
    return float(solutions[0])


def sleep_echo_logged(completion, solutions, log: str):
    """``sleep_echo`` that appends "pid start end" (this child's CLOCK_MONOTONIC, shared by every process of
    the machine) to ``log``: which child ran a check, and when, by the children's own clocks."""
    import os

    t0 = time.monotonic()
    time.sleep(float(completion))
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {t0!r} {time.monotonic()!r} {solutions[0]}\n")
    return float(solutions[0])


def hang_forever(completion, solutions):
    """Blocked in a syscall (sleep): the GIL is free but the check never ends."""
    time.sleep(3600)
    return 1.0


def busy_loop(completion, solutions):
    """Pure-Python busy loop: never yields to a signal-free timeout."""
    while True:
        pass


def gil_hog(completion, solutions):
    """One C call that holds the GIL for hours: catastrophic regex backtracking (like a sympy
    power tower, no Python signal handler can run until it returns)."""
    return float(bool(re.match(r"(a+)+$", "a" * 64 + "b")))


def raise_error(completion, solutions):
    raise RuntimeError(f"boom on {completion!r}")


def return_string(completion, solutions):
    return "not-a-number"


def return_nan(completion, solutions):
    return float("nan")


def return_true(completion, solutions):
    return True


def die(completion, solutions):
    os._exit(3)


def noisy(completion, solutions):
    """Prints to stdout, which must not corrupt the pool's framing on the child's stdout."""
    print("stray output \x00\xff" * 100)
    sys.stdout.flush()
    return 1.0


def torch_imported(completion, solutions):
    """1.0 if torch is loaded in this (child) process: the pool's children must stay torch-free."""
    return float("torch" in sys.modules)


NOT_CALLABLE = 42


def dispatch(completion, solutions):
    """Behave as the fixture named by ``completion`` (e.g. "hang_forever"), else ``exact_match``:
    lets one pool meet a misbehaving check and then a normal one."""
    fn = globals().get(completion)
    if callable(fn) and completion != "dispatch":
        return fn(completion, solutions)
    return exact_match(completion, solutions)


def allocate_gib(completion, solutions):
    """Allocate ``float(completion)`` GiB and touch it (a check that blows up in memory); 1.0 if it could."""
    block = bytearray(int(float(completion) * (1 << 30)))
    block[:: 1 << 20] = b"x" * len(block[:: 1 << 20])
    return 1.0


def batched_length(completion, solutions):
    """A batch-aware fn (as reward.judge): ``batched_length.batch`` scores a frame in one call, writing
    the frame's size to the file named by its first solution so a test sees how the checks were framed."""
    (score,) = batched_length.batch([completion], [solutions])
    return score


def _batched_length_batch(completions, solutions):
    import os

    with open(solutions[0][0], "a") as f:
        f.write(f"{os.getpid()} {len(completions)}\n")
    out = []
    for c in completions:
        if c == "raise":
            out.append(ValueError("no verdict in 'raise'"))
        elif c == "hang":
            time.sleep(60)
        else:
            out.append(len(c) / 10)
    return out


batched_length.batch = _batched_length_batch


def sum_judge(completion, solutions):
    """A batch-aware fn that reads the question (as reward.judge does): ``sum_judge.batch`` scores 1.0 when the
    completion is the sum asked by its question ``"A+B="``, whatever the solutions say; no question: an error."""
    (score,) = sum_judge.batch([completion], [solutions])
    if isinstance(score, Exception):
        raise score
    return score


def _sum_judge_batch(completions, solutions, prompts=None):
    if prompts is None:
        return [ValueError("no question came with the check")] * len(completions)
    out = []
    for c, q in zip(completions, prompts):
        a, b = q.rstrip("=").split("+")
        out.append(float(c.strip() == str(int(a) + int(b))))
    return out


sum_judge.batch = _sum_judge_batch
