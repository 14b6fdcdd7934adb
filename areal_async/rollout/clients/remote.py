"""The remote-engine seam: a ``RolloutEngine`` whose tokens come from inference servers over HTTP.

One small abstract base, ``ServerClient`` (one server: generate, pause, resume, update weights,
health), and one engine over any number of them, ``RemoteEngine``, which the rollout worker drives
exactly like the embedded ``TorchEngine`` (``add_request`` / ``step`` / ``update_weights``).
``sglang_client.SGLangClient`` is the SGLang implementation; a vLLM client implements the same
five calls and reuses everything here (routing, interruption, re-issue, revival).

::

    add_request(group) -> one sample per request in `queue`
    step():  revive servers that came back (health, then the current weights)
             dispatch queued samples to the least-loaded healthy server (a thread per request)
             collect finished requests (waits <= poll_s):
               stop / length       -> sample done (its group is returned when all n are)
               abort (we paused)   -> requeued: prompt + tokens so far, the remaining budget
               server unreachable  -> server marked down, sample requeued (its tokens so far kept)
    update_weights(v, sd): every healthy server in parallel: pause(mode) -> load v -> resume;
             a server that fails is marked down and revived later with the newest weights; when every
             server has refused the weights REFUSALS_TO_FAIL times in a row (``UpdateRefused``: a live
             server's answer, not unreachability) the engine raises ``Unfixable`` naming the reason

Per-token versions come from the server's answer (``meta_info.weight_versions`` spans, else
``weight_version`` for all tokens of that answer), never from what the client believes it
loaded, so a resubmitted sample carries the old version on its first tokens and the new one on
the rest. Versions are integers on our side and SGLang's strings on the wire (``str(v)``).

A sample's answers stay the servers' JSON lists, appended to across resubmissions; a finished group
becomes the one trajectory type once (``group_batch``: each column one tensor of its declared dtype,
made from the group's lists end to end; no tensor a sample).

Not covered: streaming, prefix-aware routing, several samples per request (``n`` > 1 would share
the prompt's prefill on the server but not survive a partial resubmission).
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Optional

import torch

from protocols.trajectories import TrajectoryBatch

from areal_async.base.process import Unfixable
from areal_async.rollout.clients.http_json import HTTPStatusError
from areal_async.rollout.engines.engine import ON_WEIGHTS, GenRequest, RolloutEngine, group_output

log = logging.getLogger("areal_async.rollout.clients.remote")


class ServerDown(ConnectionError):
    """A server cannot be used now (unreachable, timed out, or failed a weight update)."""


class UpdateRefused(ServerDown):
    """A live server answered a weight update with a refusal (its reason in the message): it stays down
    until an update succeeds, and the same weights sent again meet the same answer."""


# consecutive refusals (the push, then the revivals, one a revive_every_s) after which a server counts as
# refusing the weights for good; when every server does, the engine raises Unfixable (no restart helps)
REFUSALS_TO_FAIL = 3


@dataclass
class Completion:
    """One answer of a server to one request; lists align with ``output_ids``."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"


class ServerClient(ABC):
    """One inference server. Methods block; ``RemoteEngine`` calls them from its threads.

    Failures: ``ServerDown`` when the server cannot be used now (the engine moves its work and
    revives it later); any other exception is a bug or a contract violation and ends the worker.
    """

    address: str

    @abstractmethod
    def wait_ready(self, timeout_s: float) -> None:
        """Return once the server answers its health check; ``ServerDown`` after timeout_s."""

    @abstractmethod
    def generate(self, rid: str, input_ids: list[int], max_new_tokens: int, req: GenRequest) -> Completion:
        """Sample up to ``max_new_tokens`` continuing ``input_ids`` with ``req``'s sampling settings."""

    @abstractmethod
    def pause(self) -> None:
        """Stop generating (running requests end with "abort" or wait, per the client's mode)."""

    @abstractmethod
    def resume(self) -> None:
        """Generate again."""

    @abstractmethod
    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Make the server hold ``state_dict`` as ``version``, checked; ``ServerDown`` otherwise."""

    def reset(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Forget per-server state (weight groups) before reviving a restarted server."""

    def abort_all(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """End every running request now (best effort)."""

    def abort(self, rid: str) -> None:  # noqa: B027 (optional: a no-op by default; its answer is then discarded)
        """End the running request ``rid`` now (best effort)."""

    def close(self) -> None:  # noqa: B027 (optional: a no-op by default)
        """Free what the client holds."""


@dataclass
class _Group:
    req: GenRequest
    samples: list  # per sample index: its ``_Sample`` once finished, else None
    left: int


@dataclass
class _Sample:
    group: _Group
    index: int
    out: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    ver: list = field(default_factory=list)
    attempts: int = 0
    reason: str = "abort"  # the finish reason, once finished

    @property
    def remaining(self) -> int:
        return self.group.req.max_new_tokens - len(self.out)

    def rid(self) -> str:
        return f"{self.group.req.group_id}/{self.index}.{self.attempts}"


@dataclass
class _Server:
    client: ServerClient
    up: bool = True
    load: int = 0
    down_since: float = 0.0
    next_check: float = 0.0
    reviving: Optional[Future] = None
    refusals: int = 0  # weight updates refused in a row (UpdateRefused), 0 after one succeeds
    refused: str = ""  # the last refusal's reason


class RemoteEngine(RolloutEngine):
    """Rollout engine over ``ServerClient``s; see the module docstring."""

    def __init__(
        self,
        clients: list[ServerClient],
        *,
        max_in_flight: int = 256,
        poll_s: float = 0.02,
        down_timeout_s: float = 120.0,
        revive_every_s: float = 1.0,
        max_attempts: int = 100,
        ready_timeout_s: float = 300.0,
        on_weights: str = "recompute",
    ):
        """``on_weights`` (``rollout.on_weights``): "keep" needs clients that keep a paused request's cache
        (SGLang's in_place, checked by the config); "finish" is the rollout worker's drain (``hold_new``,
        ``in_flight``), so no request runs when the servers pause; "recompute" is whatever the clients' pause
        does to running requests (abort and resubmit, or retract)."""
        if on_weights not in ON_WEIGHTS:
            raise ValueError(f"on_weights={on_weights!r}: expected one of {ON_WEIGHTS}")
        if not clients:
            raise ValueError("clients=[]: a remote engine needs at least one server")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight!r}: expected an int >= 1")
        self.servers = [_Server(c) for c in clients]
        self.max_in_flight, self.poll_s = max_in_flight, poll_s
        self.down_timeout_s, self.revive_every_s, self.max_attempts = down_timeout_s, revive_every_s, max_attempts
        self.pool = ThreadPoolExecutor(max_in_flight + 2 * len(clients) + 2, thread_name_prefix="remote")
        self.queue: deque[_Sample] = deque()
        self.inflight: dict[Future, tuple[_Sample, _Server]] = {}
        self.groups: dict[str, _Group] = {}
        self.weights: Optional[tuple[int, dict]] = None
        self.version = -1
        self.resubmitted = 0  # samples sent again after an abort (interruption) or a lost server
        self.on_weights, self.holding = on_weights, False
        for f in [self.pool.submit(s.client.wait_ready, ready_timeout_s) for s in self.servers]:
            f.result()

    # ---- the seam ------------------------------------------------------------------------
    def add_request(self, req: GenRequest) -> None:
        req.validate()
        if req.group_id in self.groups:
            raise ValueError(f"group_id {req.group_id!r} is already generating: expected a new id")
        g = self.groups[req.group_id] = _Group(req, [None] * req.n, req.n)
        self.queue.extend(_Sample(g, i) for i in range(req.n))

    def has_work(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[TrajectoryBatch]:
        self._revive()
        self._dispatch()
        if not self.inflight:
            time.sleep(self.poll_s)
            return []
        done, _ = wait(list(self.inflight), timeout=self.poll_s, return_when=FIRST_COMPLETED)
        finished: list[TrajectoryBatch] = []
        for f in done:
            finished += self._collect(f)
        return finished

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Pause, load and resume every healthy server in parallel; tokens sampled after this
        carry ``version`` (the servers say so in their answers)."""
        self.weights = (version, state_dict)
        up = [s for s in self.servers if s.up]
        futures = {self.pool.submit(_swap, s.client, version, state_dict): s for s in up}
        for f, s in futures.items():
            try:
                f.result()
                s.refusals = 0
            except ServerDown as e:
                self._down(s, e)
        self.version = version
        self._check_refusals()

    def in_flight(self) -> bool:
        """A request running, or a sample with tokens waiting to be resubmitted."""
        return bool(self.inflight) or any(smp.out for smp in self.queue)

    def hold_new(self, hold: bool) -> None:
        self.holding = hold

    def abort_groups(self, group_ids: list[str]) -> dict[str, int]:
        """Forget the groups (queued samples dropped, running requests aborted at their servers, best effort;
        an answer that still comes is discarded): {group id: tokens its samples held here}."""
        out = {}
        for gid in [g for g in group_ids if g in self.groups]:
            g = self.groups.pop(gid)
            out[gid] = sum(len(s.out) for s in g.samples if s is not None)
            out[gid] += sum(len(smp.out) for smp in self.queue if smp.group is g)
            for smp, srv in [(smp, srv) for smp, srv in self.inflight.values() if smp.group is g]:
                out[gid] += len(smp.out)
                try:
                    srv.client.abort(smp.rid())
                except (ServerDown, HTTPStatusError) as e:  # its answer is discarded when it comes
                    log.info("abort of %s at %s failed: %s", smp.rid(), srv.client.address, e)
        if out:
            self.queue = deque(smp for smp in self.queue if smp.group.req.group_id in self.groups)
        return out

    def abort_all(self) -> list[TrajectoryBatch]:
        for s in self.servers:
            if s.up:
                try:
                    s.client.abort_all()
                except ServerDown:
                    pass
        wait(list(self.inflight), timeout=5.0)
        out = [group_batch(g.req, g.samples) for g in self.groups.values()]  # unfinished: no token, "abort"
        self.groups, self.queue, self.inflight = {}, deque(), {}
        return out

    def close(self) -> None:
        """Abort what the servers still run for us (so no request thread outlives the worker), stop."""
        for s in self.servers:
            try:
                s.client.abort_all()
            except (ServerDown, RuntimeError):
                pass
        self.pool.shutdown(wait=False, cancel_futures=True)
        for s in self.servers:
            s.client.close()

    # ---- dispatch and collection ---------------------------------------------------------
    def _dispatch(self) -> None:
        while self.queue and len(self.inflight) < self.max_in_flight:
            up = [s for s in self.servers if s.up]
            smp = self._next_sample() if up else None
            if smp is None:
                return
            srv = min(up, key=lambda s: s.load)
            req = smp.group.req
            f = self.pool.submit(srv.client.generate, smp.rid(), req.prompt_ids + smp.out, smp.remaining, req)
            self.inflight[f] = (smp, srv)
            srv.load += 1

    def _next_sample(self) -> Optional[_Sample]:
        """The next sample to send: the queue's first, or while ``holding`` the first already started."""
        if not self.holding:
            return self.queue.popleft()
        smp = next((x for x in self.queue if x.out), None)
        if smp is not None:
            self.queue.remove(smp)
        return smp

    def _collect(self, f: Future) -> list[TrajectoryBatch]:
        smp, srv = self.inflight.pop(f)
        srv.load -= 1
        if self.groups.get(smp.group.req.group_id) is not smp.group:  # its group was aborted meanwhile
            return []
        try:
            c = f.result()
        except ServerDown as e:
            self._down(srv, e)
            return self._requeue(smp)
        smp.out += c.output_ids
        smp.logp += c.logprobs
        smp.ver += c.versions
        if c.finish_reason == "abort" and smp.remaining > 0 and smp.attempts < self.max_attempts:
            return self._requeue(smp)
        reason = "length" if c.finish_reason == "abort" and smp.remaining <= 0 else c.finish_reason
        return self._finish(smp, reason)

    def _requeue(self, smp: _Sample) -> list[TrajectoryBatch]:
        smp.attempts += 1
        self.resubmitted += 1
        self.queue.appendleft(smp)
        return []

    def _finish(self, smp: _Sample, reason: str) -> list[TrajectoryBatch]:
        g = smp.group
        smp.reason, g.samples[smp.index] = reason, smp
        g.left -= 1
        if g.left:
            return []
        del self.groups[g.req.group_id]
        return [group_batch(g.req, g.samples)]

    # ---- failures ------------------------------------------------------------------------
    def _down(self, srv: _Server, err: Exception) -> None:
        if isinstance(err, UpdateRefused):
            srv.refusals, srv.refused = srv.refusals + 1, str(err)
        if srv.up:
            log.warning(
                "server %s is down (%s); its requests go to the others and it is revived when it answers",
                srv.client.address,
                err,
            )
            srv.up, srv.down_since, srv.next_check = False, time.monotonic(), 0.0

    def _revive(self) -> None:
        now = time.monotonic()
        for srv in self.servers:
            if srv.up:
                continue
            if srv.reviving is not None and srv.reviving.done():
                self._revived(srv, srv.reviving)
            elif srv.reviving is None and now >= srv.next_check:
                srv.next_check = now + self.revive_every_s
                srv.reviving = self.pool.submit(_bring_back, srv.client, self.weights)
        self._check_refusals()
        if all(not s.up for s in self.servers):
            oldest = min(s.down_since for s in self.servers)
            if now - oldest > self.down_timeout_s:
                raise RuntimeError(
                    f"every server has been down for more than {self.down_timeout_s}s: "
                    f"{[s.client.address for s in self.servers]}"
                )

    def _check_refusals(self) -> None:
        """Every server down, each having refused the weights REFUSALS_TO_FAIL times in a row: ``Unfixable``,
        naming the first server's reason (a restarted worker would send the same weights to the same servers)."""
        if all(not s.up and s.refusals >= REFUSALS_TO_FAIL for s in self.servers):
            s = self.servers[0]
            raise Unfixable(
                f"every server refused the weights of v{self.version} {s.refusals} times in a row; "
                f"{s.client.address}: {s.refused}"
            )

    def _revived(self, srv: _Server, f: Future) -> None:
        srv.reviving = None
        try:
            pushed = f.result()
        except ServerDown as e:
            if isinstance(e, UpdateRefused):
                srv.refusals, srv.refused = srv.refusals + 1, str(e)
            log.info("server %s not back yet: %s", srv.client.address, e)
            return
        if self.weights is not None and pushed != self.weights[0]:
            return  # newer weights arrived meanwhile: the next check pushes those
        srv.up, srv.refusals = True, 0
        log.info("server %s is back (weights v%s)", srv.client.address, pushed)


def group_batch(req: GenRequest, samples: list[Optional[_Sample]]) -> TrajectoryBatch:
    """A group as the one trajectory type, each column made once from its samples' lists (the servers' JSON
    values) laid end to end: no tensor a sample, no copy to join them. A sample not finished (None) has no
    token and finish reason "abort"."""
    done = [(s.out, s.logp, s.ver, s.reason) if s is not None else ([], [], [], "abort") for s in samples]
    out, logp, ver, reasons = zip(*done)
    flat = itertools.chain.from_iterable
    return group_output(req, list(map(len, out)), list(flat(out)), list(flat(logp)), list(flat(ver)), reasons)


def servers_of(addresses: list[str], worker_index: int, n_workers: int) -> list[str]:
    """The servers rollout worker ``worker_index`` owns: every n_workers-th, starting at its index. Each
    server has one owner, the only one that pauses it, updates its weights and re-issues its requests."""
    mine = addresses[worker_index::n_workers]
    if not mine:
        raise ValueError(f"rollout worker {worker_index} of {n_workers} gets no server out of {len(addresses)}")
    return mine


def _swap(client: ServerClient, version: int, sd: dict) -> None:
    """A server whose load fails stays paused (never half-updated and serving) and is marked down."""
    client.pause()
    client.update_weights(version, sd)
    client.resume()


def _bring_back(client: ServerClient, weights: Optional[tuple[int, dict]]) -> Optional[int]:
    """Health check, then the newest weights; returns the version pushed (None: no weights yet)."""
    client.wait_ready(2.0)
    client.reset()
    if weights is None:
        return None
    client.update_weights(*weights)
    client.resume()  # it may have been left paused by a failed update
    return weights[0]
