"""Control-message round trip over TCP, with and without CURVE, measured during the tiny run.

    python -m benchmarks.control_rtt --json out.json [--steps 40] [--interval-ms 2]

For each of ``cluster.curve=false`` and ``cluster.curve=true`` (both ``cluster.control=tcp``),
runs ``configs/tiny_arith.yaml`` and, while it trains, a probe process joins the fleet as a
bring-your-own worker (``areal_async.client``: the run's keys, a roster entry, its launch token)
and sends ``Ping`` to the scheduler every ``interval`` ms; the round trip is send -> its ``Pong``
on the probe's DEALER (through the scheduler's ROUTER and event loop, which is serving the run at
the same time). Reports p50 / p99 / mean RTT per mode and the CURVE/plain ratios of the same
invocation. The run's RTT includes the scheduler's event loop serving the run and the machine's
load, so the benchmark also times the bare sockets: an echo ROUTER in another process, one
CURVE and one plain socket, alternating blocks of 100 round trips (``echo_rtt_*``): the load of
the moment hits both alike, so that ratio isolates CURVE's cost. What is not measured: bulk
tensor traffic (see transfer_latency), cross-host links.
Each JSON row: metric, value, unit, curve, n, steps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import zmq
import zmq.asyncio

from areal_async.api import run_command
from areal_async.client import connect, join, load_run
from benchmarks.common import write_rows
from protocols.curve import use_curve
from protocols.messages import Ping, Pong, Shutdown, encode

ROOT = Path(__file__).resolve().parents[1]
PROBE_ID = "rtt-probe"


def configure() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.control_rtt", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--steps", type=int, default=40, help="trainer steps of each tiny run")
    p.add_argument("--interval-ms", type=float, default=2.0, help="pause between pings")
    p.add_argument("--echo-only", action="store_true", help="only the bare-socket echo (no fleet runs)")
    return p.parse_args()


async def probe(run_dir: Path, interval_s: float) -> list[float]:
    """Ping the scheduler until the run's Shutdown; the round trips in seconds."""
    cfg, ep = load_run(run_dir)
    ctx = zmq.asyncio.Context()
    client = connect(ctx, cfg, ep, "reward", PROBE_ID, token=join(run_dir, "reward", PROBE_ID))
    rtts: list[float] = []
    try:
        await client.register(timeout_s=60)
        nonce = 0
        while True:
            nonce += 1
            t0 = time.perf_counter()
            await client.send(Ping(nonce=nonce))
            while True:
                msg = await client.recv()
                if isinstance(msg, Shutdown):
                    return rtts
                if isinstance(msg, Pong) and msg.nonce == nonce:
                    rtts.append(time.perf_counter() - t0)
                    break
            await asyncio.sleep(interval_s)
    finally:
        client.close()
        ctx.destroy(linger=0)


def measure(curve: bool, steps: int, interval_s: float, work: Path) -> list[float]:
    run_dir = work / f"curve-{curve}"
    ovr = [f"total_train_steps={steps}", "cluster.control=tcp", f"cluster.curve={str(curve).lower()}"]
    cmd = run_command(ROOT / "configs/tiny_arith.yaml", run_dir, ovr)
    use_curve(None)  # this process takes the run's keys (or none) in load_run
    with open(work / f"curve-{curve}.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (run_dir / "endpoints.json").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the fleet did not start; see {work}/curve-{curve}.log")
                time.sleep(0.1)
            rtts = asyncio.run(probe(run_dir, interval_s))
            if proc.wait(timeout=300) != 0:
                raise RuntimeError(f"the run failed (exit {proc.returncode}); see {work}/curve-{curve}.log")
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    return rtts


ECHO = r"""
import sys, zmq
from protocols.curve import CurveKeys, use_curve
from protocols.sockets import make_socket
pub, sec = zmq.curve_keypair(); cpub, csec = (k.encode() for k in sys.argv[1:3])
ctx = zmq.Context()
plain = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
use_curve(CurveKeys(server_public=pub, server_secret=sec, client_public=cpub, client_secret=csec,
                    allow={cpub: "probe"}))
curve = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
print(plain.getsockopt_string(zmq.LAST_ENDPOINT), curve.getsockopt_string(zmq.LAST_ENDPOINT), pub.decode(), flush=True)
poller = zmq.Poller(); poller.register(plain, zmq.POLLIN); poller.register(curve, zmq.POLLIN)
while True:
    for sock, _ in poller.poll():
        sock.send_multipart(sock.recv_multipart())
"""


def echo_rtts(blocks: int = 40, per_block: int = 100) -> dict[bool, list[float]]:
    """Ping/Pong messages (the encoded control messages) to an echo ROUTER in another process, over a
    CURVE and a plain TCP socket in alternating blocks, so the machine's load hits both alike."""
    cpub, csec = zmq.curve_keypair()
    proc = subprocess.Popen(
        [sys.executable, "-c", ECHO, cpub.decode(), csec.decode()], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        plain_ep, curve_ep, spub = proc.stdout.readline().split()
        ctx = zmq.Context()
        socks = {False: ctx.socket(zmq.DEALER), True: ctx.socket(zmq.DEALER)}
        socks[True].setsockopt(zmq.CURVE_SERVERKEY, spub.encode())
        socks[True].setsockopt(zmq.CURVE_PUBLICKEY, cpub)
        socks[True].setsockopt(zmq.CURVE_SECRETKEY, csec)
        socks[False].connect(plain_ep)
        socks[True].connect(curve_ep)
        out: dict[bool, list[float]] = {False: [], True: []}
        for b in range(blocks):
            for curve in (False, True) if b % 2 else (True, False):
                for i in range(per_block):
                    data = encode(Ping(nonce=i))
                    t0 = time.perf_counter()
                    socks[curve].send(data)
                    reply = socks[curve].recv()
                    out[curve].append(time.perf_counter() - t0)
                    assert reply == data
        ctx.destroy(linger=0)
        for xs in out.values():
            del xs[:per_block]  # the first block of each: connection set-up
        return out
    finally:
        proc.kill()
        proc.wait()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def rows_of(results: dict[bool, list[float]], steps: Optional[int], prefix: str = "control_rtt") -> list[dict]:
    rows = []
    for curve, xs in results.items():
        for name, v in (("p50", pct(xs, 0.50)), ("p99", pct(xs, 0.99)), ("mean", statistics.fmean(xs))):
            rows.append(
                {"metric": f"{prefix}_{name}", "value": v, "unit": "s", "curve": curve, "n": len(xs), "steps": steps}
            )
    for name in ("p50", "p99"):
        on, off = (
            next(r["value"] for r in rows if r["metric"] == f"{prefix}_{name}" and r["curve"] is c)
            for c in (True, False)
        )
        rows.append(
            {
                "metric": f"{prefix}_{name}_ratio_curve_over_plain",
                "value": on / off,
                "unit": "x",
                "curve": None,
                "n": None,
                "steps": steps,
            }
        )
    return rows


def table(rows: list[dict]) -> None:
    for r in rows:
        unit = f"{r['value'] * 1e6:9.1f} us" if r["unit"] == "s" else f"{r['value']:9.3f} x "
        print(f"{r['metric']:45s} curve={str(r['curve']):5s} n={str(r['n']):6s} {unit}")


def main() -> int:
    a = configure()
    rows = []
    if not a.echo_only:
        work = Path(tempfile.mkdtemp(prefix="areal-rtt-"))
        try:
            rows = rows_of({c: measure(c, a.steps, a.interval_ms / 1000, work) for c in (False, True)}, a.steps)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    rows += rows_of(echo_rtts(), None, prefix="echo_rtt")
    table(rows)
    print(f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    if a.json:
        write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
