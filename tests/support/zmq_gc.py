"""The test processes' guard against pyzmq's collector hazard (installed by tests/conftest.py), and a program
that shows the hazard (tests/unit/house/test_zmq_gc.py runs it with and without the guard)."""

from __future__ import annotations

import warnings

# a context and its socket in one reference cycle, dropped, then collected; a socket with a queued frame to a
# peer that never answers, so nothing but close() ends it. Prints "collected" when gc.collect() returns.
CYCLE = """
import gc, sys, zmq
if sys.argv[1] == "guarded":
    from tests.support.zmq_gc import collected_contexts_are_not_terminated
    collected_contexts_are_not_terminated()
class Holder:
    pass
h = Holder()
h.ctx = zmq.Context()
h.sock = h.ctx.socket(zmq.DEALER)
h.sock.connect("tcp://127.0.0.1:9")
h.sock.send(b"x")
h.me = h
del h
gc.collect()
print("collected", flush=True)
"""


def collected_contexts_are_not_terminated() -> None:
    """pyzmq's ``Context.__del__`` (pyzmq >= 24) closes the sockets it still knows, then calls ``term()``, which
    waits until every socket of the context is closed. When the collector frees a context together with its
    sockets (a reference cycle), the context's weak set of sockets is already empty and the sockets' own
    finalizers have not run yet: ``term()`` waits forever. Seen here: an xdist worker of tests/unit in
    ``no_shm_leaks``'s ``gc.collect()`` (py-spy: ``Context.__del__`` -> ``destroy`` -> ``term``, ``sockets: []``)
    until pytest-timeout's signal broke the wait; the likely cause of the CI run whose tests/unit hung for its
    whole 5400 s (its log shows no more than that the tier stopped at ~85 %). In the test processes a context
    that reaches the collector unclosed is reported (``ResourceWarning``, where it was made is not known) and
    not terminated: the sockets' finalizers close them, and libzmq's context (its I/O thread) lives until the
    process ends. Every context the project's code makes is closed explicitly; this guards what a test drops."""
    from zmq.sugar.context import Context

    def __del__(self) -> None:
        if not self._shadow and not self.closed:
            warnings.warn(f"zmq context {self!r} collected unclosed: not terminated", ResourceWarning, stacklevel=2)

    Context.__del__ = __del__
