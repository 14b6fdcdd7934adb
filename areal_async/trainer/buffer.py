"""The trainer's trajectory buffer: a receiver thread decodes each trajectory message from the rollouts
(``protocols.trajectories.TrajectoryBatch``) and keeps one ``Trajectory`` per sample id until a step
takes it (or the scheduler aborts it)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

from areal_async.transport.frames import to_host
from protocols.messages import ProtocolError
from protocols.trajectories import Trajectory, TrajectoryBatch

log = logging.getLogger("areal_async.trainer")

MAX_DROPPED = 100_000  # aborted ids whose tensors have not come (yet): oldest forgotten past this
# how often the receiving thread looks at ``stopping`` while nothing arrives: the trainer's close joins it, so
# this bounds how long the end of a run waits for it (it was 0.2 s; a look is one poll of the note pipe)
RECV_POLL_S = 0.05


class TrajectoryBuffer:
    """Trajectories received from rollouts (``protocols.trajectories.TrajectoryBatch`` messages), as one
    ``Trajectory`` per sample id (views of the message's tensors; filled by a thread).

    Bounded: an aborted sample's tensors are freed when it is dropped, or refused once when they
    arrive later (the id is then forgotten); ids whose tensors never come (their worker died)
    are kept at most ``max_dropped``, oldest first out.

    A sample id that arrives again (while its first copy waits here, after a step took it, or
    twice in one message) is an error, not an overwrite: the first copy stays, the new one is
    refused, logged, counted in ``duplicates`` and handed to ``on_duplicate(id, message)`` (the
    trainer's record). Taken ids are remembered up to ``max_dropped`` too, oldest first out."""

    def __init__(
        self,
        channel,
        max_dropped: int = MAX_DROPPED,
        on_duplicate: Optional[Callable[[str, str], None]] = None,
    ):
        self.channel = channel
        self.items: dict[str, Trajectory] = {}
        self.dropped: OrderedDict[str, None] = OrderedDict()
        self.taken: OrderedDict[str, None] = OrderedDict()
        self.max_dropped = max_dropped
        self.on_duplicate = on_duplicate
        self.duplicates = 0
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self._watch: Optional[tuple[int, Callable[[], None]]] = None
        self.thread = threading.Thread(target=self._run, name="traj-recv", daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                got = self.channel.recv(timeout_s=RECV_POLL_S)
            except TimeoutError:
                continue
            except (ValueError, RuntimeError) as e:  # a bad frame is refused; the channel stays usable
                log.error("trajectory frame refused: %s", e)
                continue
            if got is None:
                continue
            key, meta, tensors = got
            try:
                # the trainer keeps trajectories on the host (packing, the batch's broadcast over gloo and the
                # per-sequence bookkeeping are host work): a message received into GPU memory (nccl) is copied
                # once, as one buffer; the packed micro-batch goes to the device once per forward
                samples = TrajectoryBatch.decode(key, meta, to_host(tensors)).samples()
            except ProtocolError as e:  # it names the message and what is wrong with it
                log.error("refused: %s", e)
                continue
            except (KeyError, TypeError, ValueError) as e:
                log.error("trajectory message %r refused: %s", key, e)
                continue
            call = self._add(key, samples)
            if call is not None:  # in this thread, the buffer unlocked: nothing else arrives meanwhile
                call()

    def _add(self, key: str, samples: list[Trajectory]) -> Optional[Callable[[], None]]:
        """Buffer a message's samples (an id's first copy in it); returns the watch's call if they complete it."""
        first: dict[str, Trajectory] = {}
        dups: list[tuple[str, str]] = []
        for s in samples:
            if s.sample_id in first:
                dups.append((s.sample_id, "in the same message"))
            else:
                first[s.sample_id] = s
        call = None
        with self.cond:
            for sid, item in first.items():
                if sid in self.dropped:  # an aborted sample's late tensors: refused, and the id forgotten
                    del self.dropped[sid]
                elif sid in self.items or sid in self.taken:
                    dups.append((sid, "waiting in the buffer" if sid in self.items else "already taken by a step"))
                else:
                    self.items[sid] = item
            self.cond.notify_all()
            if self._watch is not None and len(self.items) >= self._watch[0]:
                (_, call), self._watch = self._watch, None
        for sid, where in dups:
            self._duplicate(key, sid, where)
        return call

    def _duplicate(self, key: str, sid: str, where: str) -> None:
        self.duplicates += 1
        msg = (
            f"sample id {sid!r} arrived again at the trainer buffer (message {key!r}; its first copy is "
            f"{where}): the new copy is refused, the first kept; expected every id once"
        )
        log.error("%s", msg)
        if self.on_duplicate is not None:
            self.on_duplicate(sid, msg)

    def watch(self, n: int, call: Optional[Callable[[], None]]) -> bool:
        """Have the receiver thread ``call()`` once, after the message that brings the buffer to ``n``
        items or more. False, and no watch, when it holds that many now; ``None`` stops watching."""
        with self.cond:
            if call is not None and len(self.items) >= n:
                self._watch = None
                return False
            self._watch = None if call is None else (n, call)
            return True

    def peek(self, n: int) -> list[tuple[str, Trajectory]]:
        """The first ``n`` items in arrival order (left in the buffer)."""
        with self.cond:
            return list(itertools.islice(self.items.items(), n))

    def drop(self, ids: list[str]) -> None:
        with self.cond:
            for sid in ids:
                if self.items.pop(sid, None) is None:  # its tensors may still come: refuse them then
                    self.dropped[sid] = None
            while len(self.dropped) > self.max_dropped:
                self.dropped.popitem(last=False)

    def take_ready(self, ids: list[str]) -> Optional[dict[str, Trajectory]]:
        """Every id's item if all have arrived (taken out of the buffer), else None (nothing taken); never blocks."""
        with self.cond:
            if any(i not in self.items for i in ids):
                return None
            return self._pop(ids)

    def _pop(self, ids: list[str]) -> dict[str, Trajectory]:
        """Take ``ids`` out (the lock held), remembering them: a later copy is a duplicate."""
        self.taken.update(dict.fromkeys(ids))
        while len(self.taken) > self.max_dropped:
            self.taken.popitem(last=False)
        return {i: self.items.pop(i) for i in ids}

    def take(
        self, ids: list[str], timeout_s: float, revised: Optional[Callable[[], bool]] = None
    ) -> Optional[dict[str, Trajectory]]:
        """Block until every id arrived; raise naming the missing ones after timeout_s. ``revised``:
        checked at each wake-up (``wake``); once true, return None (nothing taken)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(i not in self.items for i in ids):
                if revised is not None and revised():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [i for i in ids if i not in self.items]
                    raise TimeoutError(f"{len(missing)} planned trajectories never arrived, e.g. {missing[:3]}")
                self.cond.wait(min(left, 0.5))
            return self._pop(ids)

    def wake(self) -> None:
        """Wake a blocked ``take`` (its ``revised`` may have changed)."""
        with self.cond:
            self.cond.notify_all()

    def settle(self, ids: list[str], grace_s: float) -> list[str]:
        """Of ``ids``, those that neither arrived nor were taken after waiting up to ``grace_s`` for
        them (tensors still in flight when their sender died). They are given up on: a copy that
        comes later is refused once, as an aborted sample's is (see ``drop``)."""
        deadline = time.monotonic() + grace_s
        with self.cond:
            while True:
                missing = [i for i in ids if i not in self.items and i not in self.taken]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    break
                self.cond.wait(min(left, 0.5))
            self.drop(missing)  # under the same (reentrant) lock: nothing arrives in between
        return missing
