"""``areal-async check-plugin module:obj``: a plug-in's contract test, one clear verdict.

A reward function (``reward.fn``) is loaded, its signature checked against
``f(completion: str, solutions: list[str], **kwargs) -> float``, and then run on sample inputs
in a ``RewardPool`` child: the same killable process the reward workers use, so a plug-in that
hangs is killed at ``timeout_s`` and reported as too slow instead of hanging the check. The
score must be a finite number in [0, 1].

A rollout workflow (``rollout.workflow``: a class with ``async arun_episode(engine, prompt)``)
is loaded, built, and run on one sample prompt against a random-token engine handle in a
killable child process (``areal_async.app.commands.check_workflow_child``); its episode must be a
well-formed ``Episode`` (see ``areal_async.workflows.base``).

Every failure is one line naming the plug-in, what was expected and what was found.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from areal_async.base.plugins import AGENT_SIGNATURE, REWARD_SIGNATURE, contract_problem
from areal_async.reward.pool import RewardPool

__all__ = ["Verdict", "check_plugin", "REWARD_SAMPLES"]

# (completion, solutions): a right and a wrong answer in the boxed format of the shipped tasks
REWARD_SAMPLES = [("7 + 5 = \\boxed{12}", ["12"]), ("7 + 5 = \\boxed{13}", ["12"])]


@dataclass
class Verdict:
    ok: bool
    kind: str  # reward | workflow | unknown
    message: str


def check_plugin(path: str, kind: str = "auto", timeout_s: float = 5.0) -> Verdict:
    """Load, inspect and run the plug-in ``path``; never raises for a broken plug-in."""
    kind, problem = contract_problem(path, kind)  # loads and inspects (base/plugins.py)
    if problem:
        return Verdict(False, kind, problem)
    if kind == "workflow":
        return _run_workflow_child(path, timeout_s)
    if kind == "agent":  # its episodes need a rollout worker's endpoint: checked statically only
        return Verdict(True, kind, f"ok: agent {path} imports and is {AGENT_SIGNATURE} (not run: it needs a fleet)")
    return _check_reward(path, timeout_s)


def _check_reward(path: str, timeout_s: float) -> Verdict:
    with RewardPool(path, n_procs=1, timeout_s=timeout_s) as pool:
        scores = []
        for completion, solutions in REWARD_SAMPLES:
            out = pool.score_sync(completion, solutions)
            if out.status == "timeout":
                return Verdict(
                    False,
                    "reward",
                    f"too slow: reward fn {path!r} did not return within {timeout_s:g} s "
                    f"on {completion!r} (its process was killed)",
                )
            if out.status != "ok":
                return Verdict(False, "reward", _reward_error(path, completion, out.detail))
            if not 0.0 <= out.score <= 1.0:
                return Verdict(
                    False,
                    "reward",
                    f"score out of range: reward fn {path!r} returned {out.score!r} on "
                    f"{completion!r}; expected a task score in [0, 1]",
                )
            scores.append(out.score)
    shown = ", ".join(f"{c!r} -> {s:g}" for (c, _), s in zip(REWARD_SAMPLES, scores))
    return Verdict(True, "reward", f"ok: reward fn {path!r} follows {REWARD_SIGNATURE} ({shown})")


def _reward_error(path: str, completion: str, detail: str) -> str:
    if detail.startswith("reward function returned"):  # the pool child's wording for a non-number
        what = detail.removeprefix("reward function returned ").split("; expected")[0]
        return (
            f"wrong return type: reward fn {path!r} returned {what} on {completion!r}; expected a float score in [0, 1]"
        )
    return f"raises: reward fn {path!r} raised {detail} on {completion!r}"


def _run_workflow_child(path: str, timeout_s: float, startup_s: float = 60.0) -> Verdict:
    """One episode in a child process: it says ready once the plug-in is built, then has
    ``timeout_s`` for the episode before it is killed; its last JSON line is the verdict."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(os.path.abspath(p) for p in sys.path if p)))
    cmd = [sys.executable, "-m", "areal_async.app.commands.check_workflow_child", path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    lines = _Lines(proc.stdout.fileno())
    try:
        first = lines.next(startup_s)
        last = lines.next(timeout_s) if first and json.loads(first).get("ready") else first
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        err = proc.stderr.read().decode(errors="replace").strip()
        proc.stdout.close()
        proc.stderr.close()
    if first is None:
        return Verdict(
            False,
            "workflow",
            f"too slow: workflow {path!r} was not loaded and built within {startup_s:g} s (its process was killed)",
        )
    if last is None:
        return Verdict(
            False,
            "workflow",
            f"too slow: workflow {path!r} did not finish an episode in {timeout_s:g} s (its process was killed)",
        )
    if not last:
        return Verdict(
            False, "workflow", f"crashed: the check process of workflow {path!r} exited {proc.returncode}: {err[-400:]}"
        )
    out = json.loads(last)
    return Verdict(out["ok"], "workflow", out["message"])


class _Lines:
    """Lines from a pipe with a deadline each (raw reads: nothing hides in a buffer from poll)."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""

    def next(self, timeout_s: float) -> str | None:
        """The next line; '' at EOF; None if none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace")
