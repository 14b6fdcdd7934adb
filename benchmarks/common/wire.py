"""The wire under gloo on one host: loopback TCP's own speed, measured in the same run as the gloo rows.

gloo moves a CPU broadcast over TCP; between two processes of one host that is the loopback device,
whose speed the CPU sets (a copy into the kernel on the sending core, one out of it on the receiving
core, TCP's own work), not a network. ``wire_row`` sends the bytes of the copy bound over one
127.0.0.1 connection from this process to the peer (TCP_NODELAY, one ``sendall``; the peer
``recv_into`` a buffer of its own, kept across samples, and acks with one byte), each sample right
after a sample of the copy bound, one warm-up first. A gloo weight row's GB/s over this row's is
then what gloo, its pack and its checksums leave of their wire.

Peer side: ``WIRE_OPS`` (``tcp_sink``). Row: ``metric="wire_bound"``, ``transport="tcp"``.
"""

from __future__ import annotations

import socket
import time

from benchmarks.common.peers import Op, Peer, reply
from benchmarks.common.timing import Copier, stats


def _tcp_sink(state: dict, cmd: dict) -> dict:
    """Listen on loopback, say the port, then take ``reps`` payloads of ``size`` bytes, acking each."""
    buf = memoryview(bytearray(cmd["size"]))
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(60)
        reply(state, {"port": srv.getsockname()[1]})
        conn, _ = srv.accept()
    with conn:
        conn.settimeout(60)
        for _ in range(cmd["reps"]):
            got = 0
            while got < len(buf):
                n = conn.recv_into(buf[got:])
                if not n:
                    raise ConnectionError(f"loopback sender closed after {got} of {len(buf)} bytes")
                got += n
            conn.sendall(b"k")
    return {"ok": True}


WIRE_OPS: dict[str, Op] = {"tcp_sink": _tcp_sink}


def wire_row(peer: Peer, size: int, reps: int, bound: Copier) -> dict:
    """``size`` bytes over loopback TCP to the peer, ``reps`` timed samples (p50), beside the copy bound."""
    peer.ask("tcp_sink", size=size, reps=reps + 1)
    port = peer.answer()["port"]
    data = bytearray(b"\x01") * size  # written: its pages are in before the first sample
    lat, ref = [], []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(reps + 1):
            ref.append(bound.sample())
            t0 = time.perf_counter()
            s.sendall(data)
            if s.recv(1) != b"k":
                raise ConnectionError("the loopback receiver did not ack")
            if i:
                lat.append(time.perf_counter() - t0)
    peer.answer()
    st, bound_gbps = stats(lat), bound.gbps(ref[1:])
    gbps = size / st["p50_s"] / 1e9
    return {
        "metric": "wire_bound",
        "value": gbps,
        "unit": "GB/s",
        "transport": "tcp",
        "payload": "loopback TCP",
        "bytes": size,
        "repeats": reps,
        **st,
        "gbps": gbps,
        "bound_gbps": bound_gbps,
        "ratio": gbps / bound_gbps,
        "device": "cpu",
    }


def of_wire(rows: list[dict]) -> list[str]:
    """One line per gloo weight row: its speed as a fraction of the loopback TCP row of the same run."""
    wire = next((r for r in rows if r["metric"] == "wire_bound"), None)
    if wire is None:
        return []
    return [
        f"gloo w:{r['model']}{'' if r['pipeline'] else ' serial'}: {r['gbps']:.2f} GB/s = "
        f"{r['gbps'] / wire['gbps']:.2f} of loopback TCP ({wire['gbps']:.2f} GB/s, {wire['ratio']:.2f} of the bound)"
        for r in rows
        if r["metric"] == "weight_sync" and r["transport"] == "gloo"
    ]
