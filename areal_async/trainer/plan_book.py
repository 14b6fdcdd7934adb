"""The BatchPlans the trainer holds (``TrainerService``): the latest one received for each step not yet
trained (a revision replaces it), the steps whose plan was replaced, and the sample ids given up on
(its ``HeldReply``: their tensors never came). A plan naming a given-up sample is not trained: the
step waits for its revision (the scheduler sends one, see ``SchedulerCore.on_missing``)."""

from __future__ import annotations

import asyncio

from protocols.messages import BatchPlan


class PlanBook:
    def __init__(self) -> None:
        self.plans: dict[int, BatchPlan] = {}
        self.revised_steps: set[int] = set()
        self.given_up: set[str] = set()
        self._came = asyncio.Event()

    def note(self, plan: BatchPlan) -> None:
        """A plan received (in arrival order): the latest of its step from now on."""
        if plan.step in self.plans:
            self.revised_steps.add(plan.step)
        self.plans[plan.step] = plan
        self._came.set()

    def latest(self, plan: BatchPlan) -> BatchPlan:
        return self.plans.get(plan.step, plan)

    def replaced(self, plan: BatchPlan) -> bool:
        """A newer plan of ``plan``'s step has come (callable from any thread: one dict read)."""
        return self.plans.get(plan.step, plan) is not plan

    def superseded(self, plan: BatchPlan, next_step: int) -> bool:
        """An earlier plan of a step already trained on its latest revision (left in the queue)."""
        return plan.step < next_step and plan.step in self.revised_steps

    def names_given_up(self, plan: BatchPlan) -> bool:
        return not self.given_up.isdisjoint(plan.sample_ids)

    def trained(self, step: int) -> None:
        self.plans.pop(step, None)

    async def revision_of(self, plan: BatchPlan, timeout_s: float) -> BatchPlan:
        """Wait for a newer plan of ``plan``'s step; TimeoutError naming the step after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._until_replaced(plan), timeout_s)  # (asyncio.timeout: Python 3.11+)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"step {plan.step}: no revised BatchPlan within {timeout_s:g}s after its planned samples were "
                "given up on"
            ) from None
        return self.latest(plan)

    async def _until_replaced(self, plan: BatchPlan) -> None:
        while not self.replaced(plan):
            self._came.clear()
            await self._came.wait()
