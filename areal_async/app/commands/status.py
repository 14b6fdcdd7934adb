"""``areal-async status RUN_DIR``: a live fleet, from the scheduler over the control plane.

It reads the run directory as a worker does (config, endpoints, the run's CURVE keys), connects a
DEALER to the scheduler's control socket, sends one ``StatusRequest`` and prints the
``StatusReport``: the scheduler's version, step and books (groups admitted / running / ready,
samples aborted as stale), then one line per worker (role, pid, host, state, loaded version,
samples and samples/s since it registered, restarts). Nothing is read from logs. A run that is
not running (no answer within ``timeout_s``) is an error naming the endpoint.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import zmq

from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import install_run_keys
from areal_async.scheduler.weight_updates import PHASES
from protocols.messages import ProtocolError, StatusReport, StatusRequest, decode, encode
from protocols.sockets import make_socket


class StatusError(RuntimeError):
    """The fleet did not answer (not running, or not this run's keys); the message names the endpoint."""


def query_status(run_dir: str | Path, timeout_s: float = 5.0) -> StatusReport:
    """One StatusRequest -> StatusReport round trip (blocking)."""
    run_dir = Path(run_dir)
    if not (run_dir / "endpoints.json").is_file():
        raise StatusError(f"{run_dir / 'endpoints.json'} does not exist: is a fleet running in {run_dir}?")
    try:
        install_run_keys(run_dir)  # its tcp:// sockets admit only the run's keys
    except RuntimeError as e:
        raise StatusError(str(e)) from None
    ep = RunManifest.load(run_dir)
    nonce = random.getrandbits(31)
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=ep.control, identity=f"status-{os.getpid()}-{nonce}")
    try:
        sock.send(encode(StatusRequest(nonce=nonce)))
        return _await_report(sock, nonce, ep.control, timeout_s)
    finally:
        sock.close(0)
        ctx.term()


def _await_report(sock, nonce: int, endpoint: str, timeout_s: float) -> StatusReport:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000)):
            break
        try:
            msg = decode(sock.recv(), expect=(StatusReport,))
        except ProtocolError:
            continue  # not ours (e.g. an Error about something else): keep waiting
        if msg.nonce == nonce:
            return msg
    raise StatusError(f"no status from the scheduler at {endpoint} within {timeout_s:g}s: is the run still going?")


def render(r: StatusReport) -> str:
    head = (
        f"step {r.next_step}/{r.total_steps}  version {r.version}  {'finished' if r.finished else 'running'}  "
        f"{r.wall_s:.1f}s\n"
        f"groups: admitted {r.admitted}, running {r.running}, ready {r.ready}; samples: trained "
        f"{r.samples_trained}, aborted {r.samples_aborted} (stale {r.stale})"
    )
    cols = (
        f"{'worker':12s} {'role':8s} {'pid':>7s} {'host':14s} {'state':7s} {'version':>7s} {'samples':>8s} "
        f"{'samples/s':>9s} {'groups':>6s} {'restarts':>8s}"
    )
    lines = [
        f"{w['worker_id']:12s} {w['role']:8s} {w['pid']:7d} {w['host'][:14]:14s} {w['state']:7s} "
        f"{w['version']:7d} {w['samples']:8d} {w['samples_per_s']:9.1f} {w['groups']:6d} {w['restarts']:8d}"
        for w in r.workers
    ]
    tail = [f"oldest unfinished work: {r.overdue}"] if r.overdue else []
    return "\n".join([head, *_weight_update(r.weight_update), cols, *lines, *tail])


def _weight_update(w: dict) -> list[str]:
    """One line: the last weight update every rollout loaded, its total and phases (seconds)."""
    if not w:
        return []
    phases = ", ".join(f"{k[:-2]} {w[k]:.3f}" for k in PHASES if isinstance(w.get(k), (int, float)))
    head = f"weights v{w['weight_update_version']}: every rollout generating {w['weight_update_s']:.3f}s"
    return [f"{head} after the optimizer step ({phases}; slowest {w.get('slowest_worker', '?')})"]
