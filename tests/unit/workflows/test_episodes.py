"""A rollout worker's workflow episodes (rollout/episodes.py): owned tasks, counted, bounded by
``episode_timeout_s``, cancelled with their group, and a failure that ends its group only; the error
window that fails the run. Real asyncio tasks; the expected counts are worked out by hand."""

from __future__ import annotations

import asyncio

import pytest

from protocols.messages import GenerateRequest

from areal_async.rollout.episodes import EpisodeFailed, Episodes, ErrorWindow
from areal_async.workflows.base import EpisodeBuilder, Generation, RolloutWorkflow

REQ = GenerateRequest(
    group_id="g3",
    prompt_id="p3",
    sample_ids=["g3.0", "g3.1", "g3.2"],
    prompt_ids=[5, 6],
    solutions=["7"],
    min_version=0,
    max_new_tokens=4,
)


class Scripted(RolloutWorkflow):
    """Per call, in order: 'ok' (an episode at once), 'hang' (never returns), 'boom' (raises once the
    test sets ``release``, after it has seen the others start). Records which episodes were cancelled."""

    def __init__(self, *plan):
        self.plan, self.cancelled, self.calls = list(plan), [], 0
        self.release = asyncio.Event()

    async def arun_episode(self, engine, prompt):
        kind = self.plan[self.calls % len(self.plan)]
        self.calls += 1
        try:
            if kind == "hang":
                await asyncio.Event().wait()
            if kind == "boom":
                await self.release.wait()  # not a sleep: a busy machine could pass it before the test looks
                raise RuntimeError("sandbox unreachable")
            if kind == "bad":
                return EpisodeBuilder(prompt.prompt_ids).finish(1.0)  # no model token
            b = EpisodeBuilder(prompt.prompt_ids)
            b.add_generation(Generation([9], [-0.5], [0], "stop"))
            return b.finish(1.0)
        except asyncio.CancelledError:
            self.cancelled.append(kind)
            raise


def group(workflow, timeout_s=0.0, clock=None, errors=None):
    eps = Episodes(workflow, "tests.m:Scripted", timeout_s, errors, **({"clock": clock} if clock else {}))
    return eps, eps.start(REQ.group_id, eps.run_group(None, REQ))


async def settle(eps: Episodes):
    for _ in range(3):
        await asyncio.sleep(0)
    return eps.stats()


def test_a_good_group_returns_its_episodes_and_leaves_no_task():
    async def main():
        eps, task = group(Scripted("ok"))
        episodes = await task
        assert [e.output_ids for e in episodes] == [[9], [9], [9]]
        assert await settle(eps) == {"workflow": "tests.m:Scripted", "episodes": 0, "episode_oldest_s": 0.0}
        assert eps.groups == {}

    asyncio.run(main())


def test_an_episode_past_the_timeout_fails_its_group_naming_the_workflow_and_the_bound():
    async def main():
        wf = Scripted("ok", "hang", "hang")
        eps, task = group(wf, timeout_s=0.2)
        with pytest.raises(EpisodeFailed) as e:
            await asyncio.wait_for(task, 5)
        assert e.value.reason == (
            "workflow tests.m:Scripted, sample g3.1: episode_timeout: no episode within 0.2s "
            "(rollout.episode_timeout_s)"
        )
        assert (await settle(eps))["episodes"] == 0  # the other hanging sibling was cancelled too
        assert wf.cancelled == ["hang", "hang"]

    asyncio.run(main())


def test_an_exception_fails_its_group_with_the_traceback_and_cancels_the_siblings():
    async def main():
        wf = Scripted("hang", "boom", "hang")
        eps, task = group(wf, errors=ErrorWindow("tests.m:Scripted", 0, 10))
        await asyncio.sleep(0.01)
        assert (await settle(eps))["episodes"] == 3
        wf.release.set()
        with pytest.raises(EpisodeFailed) as e:
            await asyncio.wait_for(task, 5)
        assert e.value.reason == "workflow tests.m:Scripted, sample g3.1: RuntimeError: sandbox unreachable"
        assert "in arun_episode" in e.value.trace and "RuntimeError: sandbox unreachable" in e.value.trace
        assert (await settle(eps))["episodes"] == 0 and sorted(wf.cancelled) == ["hang", "hang"]
        assert list(eps.errors.outcomes) == [True]  # the cancelled siblings have no outcome
        assert eps.errors.verdict().endswith(
            f"1 of its last 1 episodes failed (rollout.max_workflow_errors=0 in "
            f"rollout.workflow_error_window=10); last error: {e.value.reason}"
        )

    asyncio.run(main())


def test_a_malformed_episode_fails_its_group_with_the_problem():
    async def main():
        eps, task = group(Scripted("ok", "bad", "ok"))
        with pytest.raises(EpisodeFailed, match=r"sample g3.1: loss_mask has no 1"):
            await task

    asyncio.run(main())


def test_status_counts_running_episodes_and_the_oldest_age_and_cancel_stops_the_group():
    async def main():
        now = [100.0]
        wf = Scripted("hang")
        eps, task = group(wf, clock=lambda: now[0])
        await settle(eps)
        now[0] = 112.5
        assert eps.stats() == {"workflow": "tests.m:Scripted", "episodes": 3, "episode_oldest_s": 12.5}
        assert eps.cancel(["g9", "g3"]) == 1  # g9: not here
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await settle(eps))["episodes"] == 0 and wf.cancelled == ["hang"] * 3

    asyncio.run(main())


class Stubborn(RolloutWorkflow):
    """Swallows the first cancellation: the kind of episode ``close`` reports as leaked."""

    async def arun_episode(self, engine, prompt):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(3600)  # the second cancellation ends it


def test_close_cancels_everything_and_counts_what_outlived_it():
    async def main():
        wf = Scripted("hang")
        eps, _ = group(wf)
        await settle(eps)
        assert await eps.close(timeout_s=1.0) == 0 and wf.cancelled == ["hang"] * 3
        eps, _ = group(Stubborn())
        await settle(eps)
        live = list(eps.started)
        assert await eps.close(timeout_s=0.1) == 4  # three stubborn episodes and their group task awaiting them
        for t in live:
            t.cancel()
        await asyncio.wait(live, timeout=1.0)
        assert all(t.done() for t in live) and eps.stats()["episodes"] == 0

    asyncio.run(main())


def test_error_window_judges_outcomes_in_start_order_and_fails_after_more_than_max_errors():
    w = ErrorWindow("m:Flaky", max_errors=2, window=5)
    a, b, c = w.start(), w.start(), w.start()
    w.end(b, True, "fast failure")
    assert list(w.outcomes) == []  # a (started first) is still running: b's failure waits for it
    w.end(c, None)  # cancelled: no outcome
    w.end(a, False)
    assert list(w.outcomes) == [False, True] and w.verdict() is None
    later = [w.start() for _ in range(4)]
    for seq, why in zip(later, "defg"):
        w.end(seq, True, why)
    assert list(w.outcomes) == [True] * 5  # six outcomes; the window keeps the last five
    assert w.verdict() == (
        "workflow m:Flaky: 5 of its last 5 episodes failed (rollout.max_workflow_errors=2 in "
        "rollout.workflow_error_window=5); last error: g"
    )
    for seq in [w.start() for _ in range(3)]:
        w.end(seq, False)
    assert list(w.outcomes) == [True, True, False, False, False] and w.verdict() is None  # the last five
    never = ErrorWindow("m:X", -1, 3)
    for r in "abc":
        never.end(never.start(), True, r)
    assert sum(never.outcomes) == 3 and never.verdict() is None
