"""The scheduler's logic, free of sockets: it takes events and returns the messages to send.

::

    dataset cursor ──> re-issue queue first, then next prompt (rollout.skip_solved_after: settled ones passed over)
         │   admission: can_admit(accepted, running, v, η, B) and running < max_concurrent
         │   (rollout.over_provision: E groups more while accepted < (η + v + 1) B; when it gets
         │   there every group still running is cut as a straggler and re-issued: long_tail.py)
         v
    GenerateRequest(group of n, min_version=v) ──> rollout worker with the fewest groups
         │
    TrajectoryReady (rollout) + RewardResult (reward), one each per group   [either order]
         │   group ready when all n samples are generated and rewarded
         v
    ready queue (completion order) ──> plan(): trainer idle, B fresh groups
         │   a group whose oldest token version < step - η is aborted ("stale") and re-issued
         v
    BatchPlan(step) ──> trainer ──> TrainStepDone(step, version=step+1)
         │   at η >= 1, while step trains: BatchPlan(step+1) when B groups are fresh enough for
         │   step+1 (plan ahead, depth 1; the trainer finds it queued when step ends)
         │   samples -> trained, v = step + 1, metrics line, trajectory lines
         v
    total_train_steps reached -> everything still open is aborted ("run_end"), Shutdown

Invariants (tests pin them): admission never exceeds the staleness budget; a trained sample's
oldest token version is >= its step - η; every issued sample ends trained or aborted with a
reason, exactly once; a lost worker's open groups are aborted and their prompts re-issued, and
so are its generated groups whose tensors never reached the trainer (``on_missing``), every plan
that named one revised to B groups again. Units: B = ``train_dataset.batch_size`` groups per step;
each group has n samples.

About 600 lines: one state machine over one ledger (admission, readiness, plans and their revisions,
stragglers); each part changes the others' fields. Its checkpoint state is core_state.py, the group
deadlines (issue and generation times, which groups are overdue) deadlines.py.
"""

from __future__ import annotations

import time
from collections import deque
from heapq import heapify, heapreplace
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Callable, Optional, Sequence

from protocols.messages import Batch, BatchPlan, GenerateRequest, RewardResult, TrajectoryReady

from areal_async.base.eta import EtaMode
from areal_async.base.staleness import accept_bound, admission_budget
from areal_async.scheduler.core_state import core_state, restore_core
from areal_async.scheduler.deadlines import Deadlines
from areal_async.scheduler.group_filter import GroupFilter
from areal_async.scheduler.ledger import GroupRecord, GroupState, Ledger, SampleRecord, SampleState
from areal_async.scheduler.long_tail import LongTail, extra_groups, straggler_reason
from areal_async.scheduler.prompt_memory import PromptMemory

_SAMPLE_ID, _SCORE = attrgetter("sample_id"), attrgetter("score")


@dataclass
class RolloutState:
    worker_id: str
    loaded_version: int = -1
    groups: set[str] = field(default_factory=set)


@dataclass
class SchedulerParams:
    batch_size: int  # groups per trainer step
    n_samples: int
    eta: int
    total_steps: int
    max_concurrent: int
    gen: dict  # max_new_tokens, temperature, top_p, greedy, stop_token_ids
    gen_deadline_s: float = 0.0  # a group not generated this long after issue is aborted (0: no deadline)
    reward_deadline_s: float = 0.0  # a generated group not scored this long after is aborted (0: no deadline)
    max_reissues: int = -1  # a prompt re-issued this many times is dropped on its next abort (-1: never)
    group_filter: Optional[GroupFilter] = None  # rollout.dynamic_filter: judges each group once it is scored
    filter_max_gen_batches: int = 0  # the filter dropping this many batches for one step fails the run (0: never)
    skip_solved_after: int = 0  # rollout.skip_solved_after: prompts settled by their last k groups are skipped (0: off)
    over_provision: float = 0.0  # rollout.over_provision: E = ceil(F B) groups beyond the bound (long_tail.py)


class SchedulerCore:
    """Pure state machine of the single controller. See the module docstring."""

    def __init__(
        self,
        params: SchedulerParams,
        cursor,
        problem: Callable[[int], tuple[list[int], list[str]]],
        log_sample: Callable[[SampleRecord], None] = lambda r: None,
        clock: Callable[[], float] = time.time,
        log_samples: Optional[Callable[[list[SampleRecord]], None]] = None,
    ):
        """``log_sample``: each record that ends (trained or aborted); ``log_samples``, when given, takes
        the records that end together (a step's, a group's) in one call instead."""
        self.p, self.mode = params, EtaMode(params.eta)  # the mode: plan-ahead and the freshness rule (base/eta.py)
        self.cursor = cursor
        self.problem = problem  # problem index -> (prompt token ids, solutions)
        self.log_samples = log_samples or (lambda recs: list(map(log_sample, recs)))
        self.clock = clock
        self.ledger = Ledger()
        self.version = 0
        self.next_step = 0
        self.trainer_ready = False
        self.trainer_busy = False
        self.accepted = 0  # groups that finished generating (not counting aborted ones)
        self.ready: deque[str] = deque()
        self.reissue: deque[tuple[int, str]] = deque()
        self.rollouts: dict[str, RolloutState] = {}
        self.batch_groups: list[str] = []
        self.ahead_groups: Optional[list[str]] = None  # groups planned for next_step + 1 (plan ahead)
        # planned steps that lost groups (on_missing): their plan is revised once B groups are there again
        self.short_steps: set[int] = set()
        self.revisions: dict[int, int] = {}  # step -> revisions of its plan sent
        self.finished = False
        self.aborted_since_plan: list[str] = []
        self.resumes = 0
        self.deadlines = Deadlines(clock, params.gen_deadline_s, params.reward_deadline_s)  # deadlines.py
        self.reissues: dict[str, int] = {}  # prompt id -> times re-issued since it was last trained
        self.n_reissued = {"prompts": 0, "samples": 0, "dropped": 0}
        # [sum of scores, samples] of every group scored (trained later, dropped by the filter or waiting)
        self.scored = [0.0, 0]
        self.dropped_since_plan = 0  # groups the dynamic filter dropped since the last batch was planned
        k = params.skip_solved_after
        self.memory: Optional[PromptMemory] = PromptMemory(k) if k > 0 else None  # prompt_memory.py
        self.extra = extra_groups(params.over_provision, params.batch_size)
        self.tail = LongTail(clock)  # tail_s and wasted tokens (long_tail.py)
        self.stragglers: list[SampleRecord] = []  # cut since the service last took them (cut_stragglers)

    # ---- workers -------------------------------------------------------------------------
    def add_rollout(self, worker_id: str) -> None:
        self.rollouts.setdefault(worker_id, RolloutState(worker_id))

    def on_trainer_ready(self, version: int, next_step: int) -> None:
        self.trainer_ready, self.version, self.next_step = True, version, next_step
        self.tail.trainer_free()

    def on_weights_loaded(self, worker_id: str, version: int) -> None:
        if worker_id in self.rollouts:
            self.rollouts[worker_id].loaded_version = max(version, self.rollouts[worker_id].loaded_version)

    def lose_worker(self, worker_id: str, why: str) -> list[SampleRecord]:
        """A rollout worker is gone: abort its open groups and re-issue their prompts."""
        st = self.rollouts.pop(worker_id, None)
        out = []
        for gid in sorted(st.groups) if st else []:
            g = self.ledger.groups[gid]
            if g.status == GroupState.RUNNING:
                out += self._abort(gid, f"worker_lost: {worker_id} ({why})", reissue=True)
        return out

    def lose_reward_worker(self, worker_id: str, why: str) -> list[SampleRecord]:
        """A reward worker is gone: the requests it held are lost with it. Which ones is not known
        (rollouts spread requests over reward workers), so every open group with a sample that
        was generated but not yet scored is aborted and its prompt re-issued. Results that still
        come for them are refused (already aborted): nothing is counted twice."""
        out = []
        for g in list(self.ledger.open_groups()):
            unscored = any(self.ledger.samples[s].status == SampleState.GENERATED for s in g.sample_ids)
            if g.status == GroupState.RUNNING and unscored:
                out += self._abort(g.group_id, f"reward_worker_lost: {worker_id} ({why})", reissue=True)
        return out

    def abort_running(self, gid: str, reason: str) -> list[SampleRecord]:
        """Its rollout worker gave up on a running group (a workflow failed): abort it, re-issue its
        prompt. A group no longer running (already aborted, e.g. past its deadline) changes nothing."""
        if self.ledger.groups[gid].status != GroupState.RUNNING:
            return []
        return self._abort(gid, reason, reissue=True)

    # ---- admission -----------------------------------------------------------------------
    @property
    def running(self) -> int:
        return sum(len(r.groups) for r in self.rollouts.values())

    def admit(self, only_short: bool = False) -> list[tuple[str, GenerateRequest]]:
        """Start as many groups as the staleness budget and concurrency cap allow; ``only_short`` (the
        run is stopping): no more than the planned steps waiting for a revision still lack."""
        return [
            (
                wid,
                GenerateRequest(
                    g.group_id, g.prompt_id, list(g.sample_ids), list(ids), list(sol), self.version, **self.p.gen
                ),
            )
            for wid, g, ids, sol in self._admitted(only_short)
        ]

    def admit_batches(self, only_short: bool = False) -> dict[str, Batch]:
        """``admit``'s groups as one ``Batch`` of ``GenerateRequest`` per rollout worker (the groups admitted
        together), built as columns: no message per group. The lists are the ledger's and the prompt table's own."""
        cols: dict[str, tuple[list, ...]] = {}
        for wid, g, prompt_ids, solutions in self._admitted(only_short):
            c = cols.get(wid) or cols.setdefault(wid, ([], [], [], [], []))
            for column, value in zip(c, (g.group_id, g.prompt_id, g.sample_ids, prompt_ids, solutions)):
                column.append(value)
        return {w: Batch("generate_request", self._request_columns(*c)) for w, c in cols.items()}

    def _request_columns(self, gids: list, pids: list, sids: list, prompt_ids: list, solutions: list) -> dict:
        """The columns of a ``Batch`` of ``GenerateRequest``: per group, and the settings all groups share."""
        shared = {"min_version": self.version, **self.p.gen}
        per_group = {"group_id": gids, "prompt_id": pids, "sample_ids": sids, "prompt_ids": prompt_ids}
        return per_group | {"solutions": solutions} | {k: [v] * len(gids) for k, v in shared.items()}

    def _admitted(self, only_short: bool) -> list[tuple[str, GroupRecord, list[int], list[str]]]:
        """(worker, group, prompt ids, solutions) of each group issued now, in issue order (see ``admit``)."""
        out, n = [], self._budget()  # counted once: issuing a group changes only `running`
        # the worker with the fewest groups (ties: the lowest id) at the heap's top: O(log workers) a group
        fewest = [(len(r.groups), r.worker_id, r) for r in self.rollouts.values()] if n > 0 else []
        heapify(fewest)
        while n > 0 and (not only_short or self.running + len(self.ready) < self.short_need()):
            if not self.reissue and self._all_settled():
                break  # no prompt to issue (a group still in flight may unsettle one)
            k, wid, worker = fewest[0]
            out.append((wid, *self._issue(worker)))
            heapreplace(fewest, (k + 1, wid, worker))  # ids are unique: the records are never compared
            n -= 1
        return out

    def _budget(self) -> int:
        """How many groups may start now: the staleness budget (``staleness.admission_budget``) and the
        concurrency cap, 0 before the trainer is ready, without rollout workers, or once finished."""
        if self.finished or not self.trainer_ready or not self.rollouts:
            return 0
        running = self.running
        budget = admission_budget(self.accepted, running, self.version, self.p.eta, self.p.batch_size, self.extra)
        return min(budget, self.p.max_concurrent - running)

    def short_need(self) -> int:
        """The groups that the planned steps waiting for a revision (``on_missing``) still lack."""
        planned = [self._planned(step) for step in self.short_steps]
        return sum(self.p.batch_size - len(groups) for groups in planned if groups is not None)

    def _planned(self, step: int) -> Optional[list[str]]:
        """The groups planned for ``step`` (the trainer's next step, or the one planned ahead); None: none."""
        if step == self.next_step:
            return self.batch_groups
        return self.ahead_groups if step == self.next_step + 1 else None

    def _all_settled(self) -> bool:
        return self.memory is not None and self.memory.all_settled(self.cursor.n)

    def _issue(self, worker: RolloutState) -> tuple[GroupRecord, list[int], list[str]]:
        if self.reissue:
            idx, prompt_id = self.reissue.popleft()
        else:  # the memory passes over settled prompts before any group exists: admission never counts them
            idx, prompt_id = self.cursor.next() if self.memory is None else self.memory.draw(self.cursor)
        g = self.ledger.issue_group(prompt_id, idx, self.p.n_samples, worker.worker_id, self.version)
        worker.groups.add(g.group_id)
        self.deadlines.issued(g.group_id)
        prompt_ids, solutions = self.problem(idx)
        return g, prompt_ids, solutions

    # ---- progress ------------------------------------------------------------------------
    def on_trajectory(self, m: TrajectoryReady) -> Optional[str]:
        """Record the generated samples of one group. Returns why some were ignored, or None.

        Each sample is checked on its own: a refused one (unknown, of another group, already
        final, reported twice) changes nothing, and the others of the message still count."""
        return self.on_generated(
            m.group_id, m.sample_ids, m.n_output_tokens, m.version_min, m.version_max, m.finish_reasons, m.turns
        )

    def on_generated(self, gid: str, sids, n_tokens, vmins, vmaxs, finishes, turns) -> Optional[str]:
        """``on_trajectory`` from a ``TrajectoryReady``'s fields (a ``Batch``'s columns: no message object)."""
        led = self.ledger
        whys, took = led.record_generated(gid, sids, n_tokens, vmins, vmaxs, finishes, turns)
        if whys:  # a group aborted while it ran (past a deadline, a straggler) finished anyway: wasted tokens
            self.tail.wasted += self._late_tokens(sids, n_tokens)
        if took:  # once per message: a per-sample check costs n^2 per group
            if led.check_ready(gid):
                self._on_ready(gid)
            elif led.groups[gid].status == GroupState.RUNNING and led.all_generated(gid):
                self.deadlines.generated(gid)  # now only the scores are missing
        return "; ".join(whys) or None

    def _late_tokens(self, sids, n_tokens) -> int:
        """Tokens of the reported samples that were aborted (or forgotten after their abort)."""
        recs = map(self.ledger.samples.get, sids)
        return sum(n for r, n in zip(recs, n_tokens) if r is None or r.status == SampleState.ABORTED)

    def on_stopped(self, n_tokens: Sequence[int]) -> None:
        """A rollout's engine stopped aborted groups mid-generation (``GroupsStopped``): their tokens."""
        self.tail.wasted += sum(n_tokens)

    def cut_stragglers(self) -> list[SampleRecord]:
        """``rollout.over_provision``: the records of the groups cut as stragglers since the last call (the
        service stops them at their workers; ``long_tail.py``)."""
        out, self.stragglers = self.stragglers, []
        return out

    def _cut_running(self) -> None:
        """The accepted groups just reached the bound: every group still running is aborted, its prompt
        re-issued."""
        bound = accept_bound(self.version, self.p.eta, self.p.batch_size)
        why = straggler_reason(self.accepted, bound, self.version, self.p.eta, self.p.over_provision)
        for gid in sorted(g for r in self.rollouts.values() for g in r.groups):
            self.stragglers += self._abort(gid, why, reissue=True)

    def on_reward(self, m: RewardResult) -> Optional[str]:
        """Record the scores of one group's samples; per-sample refusal as in ``on_trajectory``."""
        return self.on_scored(m.group_id, m.sample_ids, m.scores, m.statuses)

    def on_scored(self, gid: str, sids, scores, statuses) -> Optional[str]:
        """``on_reward`` from a ``RewardResult``'s fields (a ``Batch``'s columns: no message object)."""
        led = self.ledger
        whys, took = led.record_rewarded(gid, sids, scores, statuses)
        if took and led.check_ready(gid):
            self._on_ready(gid)
        return "; ".join(whys) or None

    def _on_ready(self, gid: str) -> None:
        """A group just became ready (every sample generated and scored)."""
        g = self.ledger.groups[gid]
        worker = self.rollouts.get(g.worker)
        if worker is not None:
            worker.groups.discard(gid)
        self.deadlines.forget(gid)
        self.tail.ready(gid)
        scores = list(map(_SCORE, self.ledger.members[gid]))
        self.scored[0], self.scored[1] = self.scored[0] + sum(scores), self.scored[1] + len(scores)
        if self.memory is not None:
            self.memory.record(g.problem_index, scores)
        if self._filtered_out(gid):
            return
        self.accepted += 1
        self.ready.append(gid)
        if self.extra and self.accepted == accept_bound(self.version, self.p.eta, self.p.batch_size):
            self._cut_running()

    def _filtered_out(self, gid: str) -> bool:
        """Dynamic sampling: a group the filter drops is booked aborted, its prompt not re-issued (the
        cursor supplies the next one). It was never accepted, so admission refills its place within
        the same bound (accepted + running < (eta + v + 1) B) and staleness is judged at plan as ever."""
        f = self.p.group_filter
        if f is None:
            return False
        recs = [self.ledger.samples[s] for s in self.ledger.groups[gid].sample_ids]
        g = self.ledger.groups[gid]
        why = f.judge([r.score for r in recs], prompt_id=g.prompt_id, n_output_tokens=[r.n_output_tokens for r in recs])
        if why is None:
            return False
        self._abort(gid, why, reissue=False)
        self.dropped_since_plan += 1
        return True

    def filter_starved(self) -> Optional[str]:
        """Why the run must stop: the dynamic filter dropped filter_max_gen_batches batches of groups while
        one step waited (every group solved, or failed, by all its samples: verl's max_num_gen_batches);
        or the prompt memory settled every prompt while nothing in flight could unsettle one."""
        if self._settled_out():
            return self.memory.exhausted(self.cursor.n, self.next_step, len(self.ready), self.p.batch_size)
        limit = self.p.filter_max_gen_batches * self.p.batch_size
        if limit <= 0 or self.dropped_since_plan < limit or self.p.group_filter is None:
            return None
        return (
            f"rollout.dynamic_filter={self.p.group_filter.name!r} dropped {self.dropped_since_plan} groups while step "
            f"{self.next_step} waited for {self.p.batch_size} (rollout.dynamic_filter_max_gen_batches="
            f"{self.p.filter_max_gen_batches}): the prompts are all solved or all failed by every sample; use "
            "easier/harder data, more samples per prompt, or raise the limit (0 = none)"
        )

    def _settled_out(self) -> bool:
        stuck = not self.finished and not self.trainer_busy and len(self.ready) < self.p.batch_size
        return stuck and self._all_settled() and not self.reissue and self.running == 0

    # ---- training ------------------------------------------------------------------------
    def plan(self, ahead: bool = False) -> tuple[Optional[BatchPlan], list[SampleRecord]]:
        """A batch for the next step when the trainer is idle and B fresh groups are ready.

        ``ahead`` (the service allows it: no checkpoint due, not stopping): at η >= 1, while
        the trainer trains ``next_step`` and nothing is planned ahead yet, a batch for
        ``next_step + 1`` of the first B ready groups fresh enough for that step. A group's
        oldest token version is fixed once it is ready, so the staleness check is exact; groups
        fresh for ``next_step`` only stay ready (and are aborted as stale after it).

        Returns (plan or None, samples aborted as stale on the way)."""
        aborted = self._drop_stale()
        if self.finished or not self.trainer_ready:
            return None, aborted
        if self.short_steps:  # a revision comes before any new plan: fresh groups go to the earlier step
            return self._revise(), aborted
        if len(self.ready) < self.p.batch_size:
            return None, aborted
        if not self.trainer_busy:
            gids = [self.ready.popleft() for _ in range(self.p.batch_size)]
            self.batch_groups, self.trainer_busy = gids, True
            self.tail.planned(self.next_step, gids, waited=True)
            return self._batch_plan(gids, self.next_step), aborted
        gids = self._ahead_batch() if ahead else None
        if gids is None:
            return None, aborted
        self.ahead_groups = gids
        self.tail.planned(self.next_step + 1, gids, waited=False)
        return self._batch_plan(gids, self.next_step + 1), aborted

    def _ahead_batch(self) -> Optional[list[str]]:
        """B ready groups (completion order) fresh enough for ``next_step + 1``, taken off the ready
        queue; None when plan ahead is not allowed now or too few are fresh."""
        step = self.next_step + 1
        if not self.mode.plan_ahead or self.ahead_groups is not None or step >= self.p.total_steps:
            return None
        fresh = self._fresh_for(step)
        if len(fresh) < self.p.batch_size:
            return None
        gids = fresh[: self.p.batch_size]
        for gid in gids:
            self.ready.remove(gid)
        return gids

    def _fresh_for(self, step: int) -> list[str]:
        return [g for g in self.ready if self.mode.fresh_enough(self._vmin(g), step)]

    def _vmin(self, gid: str) -> int:
        """A ready group's oldest token version (the ledger keeps it once the group is ready)."""
        v = self.ledger.vmin.get(gid)
        return self.ledger.group_version_min(gid) if v is None else v

    def _batch_plan(self, gids: list[str], step: int, new: Optional[list[str]] = None, revision: int = 0) -> BatchPlan:
        """The plan of ``gids`` for ``step``; ``new`` (default: all of them) are booked batched now."""
        self.ledger.mark_batched(gids if new is None else new, step)
        self.dropped_since_plan = 0
        sids, owners, scores, members = [], [], [], self.ledger.members
        for gid in gids:
            recs = members[gid]
            sids += map(_SAMPLE_ID, recs)
            owners += repeat(gid, len(recs))
            scores += map(_SCORE, recs)
        plan = BatchPlan(
            step=step,
            sample_ids=sids,
            group_ids=owners,
            scores=scores,
            aborted_ids=self.aborted_since_plan,
            revision=revision,
        )
        self.aborted_since_plan = []
        return plan

    def _drop_stale(self) -> list[SampleRecord]:
        out = []
        stale = [g for g in self.ready if not self.mode.fresh_enough(self._vmin(g), self.next_step)]
        for gid in stale:
            self.ready.remove(gid)
            self.accepted -= 1
            vmin = self._vmin(gid)
            why = f"stale: oldest token version {vmin} < step {self.next_step} - eta {self.p.eta}"
            out += self._abort(gid, why, reissue=True)
        return out

    def on_step_done(self, step: int, version: int, skipped_ids: Sequence[str] = ()) -> list[SampleRecord]:
        """Book the planned batch trained; ``skipped_ids`` (samples of a minibatch whose optimizer step
        the trainer skipped) are booked aborted, not trained. Returns the trained records."""
        if not self.trainer_busy or step != self.next_step:
            planned = self.next_step if self.trainer_busy else None
            raise ValueError(f"TrainStepDone for step {step}, but the trainer was planned step {planned}")
        if skipped_ids:
            planned_ids = {s for g in self.batch_groups for s in self.ledger.groups[g].sample_ids}
            unknown = [s for s in skipped_ids if s not in planned_ids]
            if unknown:
                raise ValueError(f"TrainStepDone for step {step} skipped {unknown[:3]}, which step {step} did not plan")
        why = f"optimizer_step_skipped: step {step}'s optimizer step was not applied to this sample's minibatch"
        ended = self.ledger.mark_trained(self.batch_groups, frozenset(skipped_ids), why)
        trained = [r for r in ended if r.status == SampleState.TRAINED] if skipped_ids else ended
        self.tail.wasted += sum(r.n_output_tokens for r in ended if r.status == SampleState.ABORTED)
        self.tail.trainer_free()
        self.log_samples(ended)
        for prompt_id in {r.prompt_id for r in trained} if self.reissues else ():
            self.reissues.pop(prompt_id, None)  # a trained prompt starts a fresh re-issue count
        # a batch planned ahead is the trainer's next step: it stays busy (also when on_missing emptied
        # it: the trainer holds that plan and waits for its revision)
        self.trainer_busy = self.ahead_groups is not None
        self.batch_groups, self.ahead_groups = self.ahead_groups or [], None
        self.short_steps.discard(step)
        self.revisions.pop(step, None)
        self.version, self.next_step = version, step + 1
        self.finished = self.next_step >= self.p.total_steps
        return trained

    # ---- trajectories lost on the way to the trainer ------------------------------------
    def unconfirmed(self, worker_id: str) -> list[str]:
        """The samples of ``worker_id``'s groups that are generated and scored but not trained (ready or
        planned). The trainer holds their tensors, unless they died in the worker's send queue: a
        worker sends a group's tensors, then its ``TrajectoryReady``, and a SIGKILL between the
        send and the bytes leaving the process loses the first but not the second."""
        live = (GroupState.READY, GroupState.BATCHED)
        return [
            s for g in self.ledger.groups.values() if g.worker == worker_id and g.status in live for s in g.sample_ids
        ]

    def on_missing(self, sample_ids: Sequence[str], why: str) -> list[SampleRecord]:
        """The trainer says these samples' tensors never came (``HeldReply``). Their groups are aborted
        and their prompts re-issued. A plan that named one of them (the step the trainer waits for,
        or the one planned ahead) is revised by ``plan`` as soon as enough ready groups are fresh for
        its step to fill it to B again: its other groups stay planned, the trainer trains the
        revision. Returns the aborted samples (logged)."""
        gids: list[str] = []
        for sid in sample_ids:
            rec = self.ledger.samples.get(sid)
            g = self.ledger.groups.get(rec.group_id) if rec is not None else None
            if g is not None and g.group_id not in gids and g.status in (GroupState.READY, GroupState.BATCHED):
                gids.append(g.group_id)
        out = []
        for gid in gids:
            if gid in self.ready:
                self.ready.remove(gid)
            for step in (self.next_step, self.next_step + 1):
                groups = self._planned(step)
                if groups is not None and gid in groups:
                    groups.remove(gid)
                    self.short_steps.add(step)
            self.accepted -= 1
            out += self._abort(gid, why, reissue=True)
        return out

    def _revise(self) -> Optional[BatchPlan]:
        """The revised plan of the earliest planned step that lost groups, once B - (its groups left)
        ready groups are fresh enough for it (they join it, in completion order); else None."""
        for step in sorted(self.short_steps):
            groups = self._planned(step)
            if groups is None:  # no longer planned (trained, or the run restored)
                self.short_steps.discard(step)
                continue
            fresh = self._fresh_for(step)[: self.p.batch_size - len(groups)]
            if len(groups) + len(fresh) < self.p.batch_size:
                return None  # the trainer trains the earlier step first: it waits for this one
            for gid in fresh:
                self.ready.remove(gid)
            groups.extend(fresh)
            self.short_steps.discard(step)
            self.revisions[step] = self.revisions.get(step, 0) + 1
            return self._batch_plan(groups, step, new=fresh, revision=self.revisions[step])
        return None

    # ---- deadlines -----------------------------------------------------------------------
    def expire(self) -> list[SampleRecord]:
        """Abort (and re-issue) every running group past its deadline (``deadlines.py``)."""
        return [r for gid, why in self.deadlines.overdue(self.ledger.groups) for r in self._abort(gid, why, True)]

    # ---- ending --------------------------------------------------------------------------
    def _abort(self, gid: str, reason: str, reissue: bool) -> list[SampleRecord]:
        g = self.ledger.groups[gid]
        self.rollouts.get(g.worker, RolloutState("")).groups.discard(gid)
        self.deadlines.forget(gid)
        self.tail.forget(gid)
        self.tail.wasted += sum(r.n_output_tokens for r in self.ledger.members[gid])
        if reissue and not self.finished:
            reason = self._reissue(g, reason)
        else:
            self.reissues.pop(g.prompt_id, None)
        recs = self.ledger.abort_group(gid, reason)
        self.log_samples(recs)
        self.aborted_since_plan += map(_SAMPLE_ID, recs)
        return recs

    def _reissue(self, g, reason: str) -> str:
        """Queue the group's prompt again, unless it was re-issued max_reissues times already:
        then it is dropped, and the abort reason says so. Returns the reason to book."""
        n = self.reissues.get(g.prompt_id, 0)
        if 0 <= self.p.max_reissues <= n:
            self.reissues.pop(g.prompt_id, None)
            self.n_reissued["dropped"] += 1
            return (
                f"{reason}; prompt {g.prompt_id} dropped after {n} re-issues "
                f"(rollout.max_reissues={self.p.max_reissues})"
            )
        self.reissues[g.prompt_id] = n + 1
        self.n_reissued["prompts"] += 1
        self.n_reissued["samples"] += len(g.sample_ids)
        self.reissue.append((g.problem_index, g.prompt_id))
        return reason

    def abort_open(self, reason: str) -> list[SampleRecord]:
        """End of run (or resume): every open group is aborted with `reason`."""
        out = []
        for g in self.ledger.open_groups():
            if g.group_id in self.ready:
                self.ready.remove(g.group_id)
            out += self._abort(g.group_id, reason, reissue=False)
        return out

    # ---- checkpoint ----------------------------------------------------------------------
    def restart_ids(self, attempt: int) -> None:
        """A run restarted without a checkpoint (attempt k >= 1 in this run directory): its ids get
        the prefix ``r<k>-``, so they differ from those the attempts before it issued."""
        self.resumes = attempt
        self.ledger.id_prefix = f"r{attempt}-"

    def state(self) -> dict:
        """Everything a resumed run needs to continue the same books (JSON-able; ``core_state.py``)."""
        return core_state(self)

    def restore(self, state: dict, at_least: int = 0) -> list[SampleRecord]:
        """Continue from a checkpoint's state (``core_state.py``); returns the records aborted on the way."""
        return restore_core(self, state, at_least)
