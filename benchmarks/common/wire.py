"""The wire under gloo on one host: loopback TCP's own speed, measured in the same run as the gloo rows.

gloo moves a CPU broadcast over TCP; between two processes of one host that is the loopback device,
whose speed the CPU sets (a copy into the kernel on the sending core, one out of it on the receiving
core, TCP's own work), not a network. ``wire_row`` sends the bytes of the copy bound over one
127.0.0.1 connection from this process to the peer (TCP_NODELAY, one ``sendall``; the peer
``recv_into`` a buffer of its own, kept across samples, and acks with one byte), each sample right
after a sample of the copy bound, one warm-up first. A gloo weight row's GB/s over this row's is
then what gloo, its pack and its checksums leave of their wire.

``Streams`` is the wire as gloo's weight channel uses it: as many loopback connections as the channel
has lanes (``transport.collective.WEIGHT_LANES``: each gloo group its own connection and thread), each
carrying its share of the bytes from its own thread at once. It is sampled between the timed versions of
a gloo weight row (``time_weights(between=...)``) with the row's own byte count, so each
``gloo_fraction_of_wire`` row compares gloo with its wire under the same load, same bytes, same streams.
Each stream reuses one buffer of at most ``STREAM_CHUNK`` bytes per side, sent as many times as its share
needs (the wire moves the bytes gloo moves; neither end holds another copy of the model).

Peer side: ``WIRE_OPS`` (``tcp_sink``; ``tcp_streams_open`` / ``tcp_streams_close`` serve ``Streams``
from a thread, so the peer keeps serving the channel's ops between samples). Rows:
``metric="wire_bound"`` (one stream, ``transport="tcp"``) and ``gloo_fraction_of_wire``.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common.peers import Op, Peer, reply
from benchmarks.common.timing import BoundSamples, Copier, stats

STREAM_CHUNK = 256 << 20  # bytes of the buffer each stream reuses, per side
GLOO_WIRE_TARGET = 0.75  # gloo's weight sync as a fraction of its wire (benchmarks/README.md)


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


def shares(size: int, streams: int) -> list[int]:
    """``size`` bytes split over ``streams`` as evenly as whole bytes allow."""
    return [size // streams + (1 if i < size % streams else 0) for i in range(streams)]


def _recv_share(conn: socket.socket, share: int, errors: list) -> None:
    """Take ``share`` bytes per sample into one reused buffer and ack each, until the sender closes."""
    buf = memoryview(bytearray(min(share, STREAM_CHUNK) or 1))
    try:
        with conn:
            while True:
                got = 0
                while got < share:
                    n = conn.recv_into(buf[: min(len(buf), share - got)])
                    if not n:
                        if got:
                            raise ConnectionError(f"loopback stream closed after {got} of {share} bytes")
                        return  # the sender closed between samples: done
                    got += n
                conn.sendall(b"k")
    except Exception as e:  # reported by tcp_streams_close
        errors.append(f"{type(e).__name__}: {e}")


def _tcp_streams_open(state: dict, cmd: dict) -> dict:
    """Listen on loopback for ``streams`` connections, each taking its share of ``size`` bytes per sample
    in a thread of its own (``_recv_share``); returns the port at once (the peer keeps serving ops)."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=cmd["streams"])
    srv.settimeout(60)
    errors: list[str] = []
    threads: list[threading.Thread] = []

    def accept() -> None:
        try:
            for share in shares(cmd["size"], cmd["streams"]):
                conn, _ = srv.accept()
                conn.settimeout(600)
                threads.append(threading.Thread(target=_recv_share, args=(conn, share, errors), daemon=True))
                threads[-1].start()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            srv.close()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    state["tcp_streams"] = (acceptor, threads, errors)
    return {"port": srv.getsockname()[1]}


def _tcp_streams_close(state: dict, cmd: dict) -> dict:
    acceptor, threads, errors = state.pop("tcp_streams")
    acceptor.join(60)
    for t in threads:
        t.join(60)
    if errors:
        raise ConnectionError("; ".join(errors))
    return {"ok": True}


WIRE_OPS: dict[str, Op] = {
    "tcp_sink": _tcp_sink,
    "tcp_streams_open": _tcp_streams_open,
    "tcp_streams_close": _tcp_streams_close,
}


class Streams:
    """``streams`` loopback connections to the peer; ``sample()`` sends ``size`` bytes split over them, each
    from its own thread at once, and returns the seconds until every stream's ack came back."""

    def __init__(self, peer: Peer, size: int, streams: int):
        self.peer, self.size, self.shares = peer, size, shares(size, streams)
        port = peer.call("tcp_streams_open", size=size, streams=streams)["port"]
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=600) for _ in self.shares]
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.bufs = [memoryview(bytearray(b"\x01") * (min(n, STREAM_CHUNK) or 1)) for n in self.shares]  # written
        self.pool = ThreadPoolExecutor(max_workers=len(self.shares), thread_name_prefix="wire")
        self.seconds: list[float] = []
        self.sample()  # warm-up: connections and buffers in use once before any timed sample
        self.seconds.clear()

    def _send(self, i: int) -> None:
        s, buf, left = self.socks[i], self.bufs[i], self.shares[i]
        while left:
            n = min(len(buf), left)
            s.sendall(buf[:n])
            left -= n
        if s.recv(1) != b"k":
            raise ConnectionError(f"loopback stream {i}: the receiver did not ack")

    def sample(self) -> float:
        t0 = time.perf_counter()
        for f in [self.pool.submit(self._send, i) for i in range(len(self.socks))]:
            f.result()
        self.seconds.append(time.perf_counter() - t0)
        return self.seconds[-1]

    def gbps_samples(self) -> list[float]:
        return [self.size / s / 1e9 for s in self.seconds]

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.pool.shutdown()
        self.peer.call("tcp_streams_close")


def fraction_row(weight: dict, wire: Streams) -> dict:
    """``gloo_fraction_of_wire``: a gloo weight row's GB/s over its wire's (``Streams``, the same bytes and
    streams, sampled between the row's versions), and over the libc memmove of the row's bound samples."""
    per = wire.gbps_samples()
    wire_gbps = statistics.median(per)
    memmove = weight.get("memmove_gbps")
    return {
        "metric": "gloo_fraction_of_wire",
        "value": weight["gbps"] / wire_gbps,
        "unit": "fraction",
        "transport": "gloo",
        "model": weight["model"],
        "bytes": weight["bytes"],
        "streams": len(wire.shares),
        "gloo_gbps": weight["gbps"],
        "wire_gbps": wire_gbps,
        "wire_gbps_samples": [round(x, 3) for x in per],
        "wire_spread": (max(per) - min(per)) / wire_gbps,
        "memmove_gbps": memmove,
        "fraction_of_memmove": weight["gbps"] / memmove if memmove else None,
        "wire_fraction_of_memmove": wire_gbps / memmove if memmove else None,
        "target": GLOO_WIRE_TARGET,
        "def": (
            f"gloo weight sync GB/s (p50 of the row's versions) / loopback TCP GB/s (median of {len(per)} samples of "
            f"the same {weight['bytes']} bytes over {len(wire.shares)} connection(s), one thread each, sampled "
            "between the versions)"
        ),
    }


def wire_row(peer: Peer, size: int, reps: int, bound: Copier) -> dict:
    """``size`` bytes over loopback TCP to the peer, ``reps`` timed samples (p50), beside the copy bound."""
    peer.ask("tcp_sink", size=size, reps=reps + 1)
    port = peer.answer()["port"]
    data = bytearray(b"\x01") * size  # written: its pages are in before the first sample
    lat, b = [], BoundSamples(bound, slots=reps)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(reps + 1):
            if i:
                b.take()
            t0 = time.perf_counter()
            s.sendall(data)
            if s.recv(1) != b"k":
                raise ConnectionError("the loopback receiver did not ack")
            if i:
                lat.append(time.perf_counter() - t0)
    peer.answer()
    st = stats(lat)
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
        **b.fields(gbps),
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


def fraction_lines(rows: list[dict]) -> list[str]:
    """One line per ``gloo_fraction_of_wire`` row: gloo against its wire (same bytes and streams) and memmove."""
    out = []
    for r in rows:
        if r["metric"] != "gloo_fraction_of_wire":
            continue
        mm = f", {r['fraction_of_memmove']:.2f} of memmove ({r['memmove_gbps']:.2f} GB/s)" if r["memmove_gbps"] else ""
        met = "met" if r["value"] >= r["target"] else "NOT met"
        out.append(
            f"gloo w:{r['model']}: {r['gloo_gbps']:.2f} GB/s = {r['value']:.2f} of its wire ({r['streams']} loopback "
            f"streams, {r['wire_gbps']:.2f} GB/s, median of {len(r['wire_gbps_samples'])}, spread "
            f"{r['wire_spread']:.2f}){mm}; target {r['target']} {met}"
        )
    return out
