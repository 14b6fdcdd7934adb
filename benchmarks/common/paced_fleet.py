"""The paced fleet of ``heartbeat_load`` (a spawned child: this module imports no torch, so it starts in
well under a second): the config's workers register, then send only heartbeats, evenly spaced."""

from __future__ import annotations

import os
import time

import zmq

from areal_async.base.control import routing_identity
from protocols import messages as M
from protocols.sockets import make_socket

PACE_SLEEP_S = 0.0001  # the fleet's loop: send what is due, sleep this long


def paced_heartbeats(control: str, roles: dict, tokens: dict, rate: float, seconds: float, cpus: list, q) -> None:
    """Register the config's workers, then heartbeats at ``rate`` a second for ``seconds``; puts the count sent."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    ctx = zmq.Context()
    socks = {w: make_socket(ctx, zmq.DEALER, connect=control, identity=routing_identity(w)) for w in roles}
    sent = 0
    try:
        for wid, role in roles.items():
            socks[wid].send(M.encode(M.Register(role=role, worker_id=wid, pid=os.getpid(), token=tokens[wid])))
        for wid, s in socks.items():
            if not s.poll(30_000) or not isinstance(M.decode(s.recv()), M.RegisterAck):
                raise RuntimeError(f"paced fleet: no RegisterAck for {wid}")
        wids, t0 = list(socks), time.monotonic()
        while (elapsed := time.monotonic() - t0) < seconds:
            while sent < int(elapsed * rate):
                wid = wids[sent % len(wids)]
                socks[wid].send(M.encode(M.Heartbeat(worker_id=wid, ts=time.time(), stats={"samples": sent})))
                sent += 1
            time.sleep(PACE_SLEEP_S)
    finally:
        for s in socks.values():
            s.close(0)  # what the service took is counted at its end; the rest, after its window, is dropped
        ctx.term()
        q.put(sent)
