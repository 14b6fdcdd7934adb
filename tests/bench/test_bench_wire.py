"""benchmarks/common/wire.py: the loopback TCP reference for gloo (a real socket, the peer op in a thread)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading

import msgpack
import pytest

from benchmarks.common.wire import _tcp_sink, of_wire


def _sink(size: int, reps: int):
    here, there = mp.Pipe()
    out: dict = {}

    def run():
        try:
            out["ret"] = _tcp_sink({"conn": there}, {"size": size, "reps": reps})
        except Exception as e:  # the test reads it
            out["err"] = e

    t = threading.Thread(target=run)
    t.start()
    port = msgpack.unpackb(here.recv_bytes(), raw=False)["port"]
    return t, out, port


def test_the_sink_takes_each_payload_whole_and_acks_it():
    t, out, port = _sink(3 << 20, 2)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for _ in range(2):
            s.sendall(b"\x07" * (1 << 20))  # in three parts: the sink's recv_into loop joins them
            s.sendall(b"\x07" * (1 << 20))
            s.sendall(b"\x07" * (1 << 20))
            assert s.recv(1) == b"k"
    t.join(10)
    assert out == {"ret": {"ok": True}}


def test_a_sender_that_stops_short_is_an_error_naming_the_bytes():
    t, out, port = _sink(1 << 20, 1)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"\x01" * 1000)
    t.join(10)
    assert isinstance(out["err"], ConnectionError) and "after 1000 of 1048576 bytes" in str(out["err"])


def test_gloo_rows_as_fractions_of_the_wire():
    wire = {"metric": "wire_bound", "gbps": 3.0, "ratio": 0.3}
    rows = [
        wire,
        {"metric": "weight_sync", "transport": "gloo", "model": "0.13B", "pipeline": True, "gbps": 2.4},
        {"metric": "weight_sync", "transport": "gloo", "model": "0.13B", "pipeline": False, "gbps": 1.5},
        {"metric": "weight_sync", "transport": "shm", "model": "0.13B", "pipeline": True, "gbps": 6.0},
    ]
    assert of_wire(rows) == [
        "gloo w:0.13B: 2.40 GB/s = 0.80 of loopback TCP (3.00 GB/s, 0.30 of the bound)",
        "gloo w:0.13B serial: 1.50 GB/s = 0.50 of loopback TCP (3.00 GB/s, 0.30 of the bound)",
    ]
    assert of_wire(rows[1:]) == []  # no wire row (no gloo in the run): nothing said


@pytest.mark.parametrize("size", [1, 4096])
def test_the_sink_rejects_nothing_of_a_small_payload(size):
    t, out, port = _sink(size, 1)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"\x02" * size)
        assert s.recv(1) == b"k"
    t.join(10)
    assert out == {"ret": {"ok": True}}


def test_results_renders_weight_rows_with_both_bounds():
    from benchmarks.results import recognise, transfer_latency

    rows = [
        {"metric": "weight_sync", "transport": "shm", "model": "0.13B", "pipeline": True, "repeats": 9,
         "p50_s": 0.0476, "gbps": 5.44, "bound_gbps": 10.83, "ratio": 0.5023, "ratio_memcpy": 0.52},
        {"metric": "weight_sync", "transport": "shm", "model": "1.5B", "pipeline": True, "repeats": 2,
         "p50_s": 0.5, "gbps": 6.2, "bound_gbps": 11.0, "bound_gbps_samples": [10.0, 11.0, 12.0, 11.5, 10.5],
         "bound_spread": 0.1818, "ratio": 0.5636, "memmove_gbps": 11.2, "ratio_memmove": 0.5536, "bound_def": "D"},
        {"metric": "wire_bound", "transport": "tcp", "payload": "loopback TCP", "repeats": 3,
         "p50_s": 0.0846, "gbps": 3.17, "bound_gbps": 8.61, "ratio": 0.368},
        {"metric": "gloo_fraction_of_wire", "value": 0.8, "model": "0.13B", "gloo_gbps": 2.4, "wire_gbps": 3.0,
         "streams": 2, "wire_gbps_samples": [3.0] * 6, "wire_spread": 0.0, "fraction_of_memmove": 0.2, "target": 0.75},
        {"metric": "run_info", "value": 0, "unit": "", "notes": ["a whole run's --json holds one"]},
    ]  # fmt: skip
    assert recognise(rows) == "benchmarks.transfer_latency"
    assert transfer_latency(rows)[2:] == [
        "| shm | 0.13B |  | 9 | 47.6 | 5.44 | 10.83 | - | - | 0.50 | - | 0.52 |",
        "| shm | 1.5B |  | 2 | 500.0 | 6.20 | 11.00 | 5 | 0.18 | 0.56 | 11.20 | 0.55 |",
        "| tcp | loopback TCP |  | 3 | 84.6 | 3.17 | 8.61 | - | - | 0.37 | - | - |",
        (
            "- gloo 0.13B: 2.40 GB/s = 0.80 of its wire (2 loopback streams, 3.00 GB/s, 6 samples, spread 0.00), "
            "0.20 of memmove; target 0.75"
        ),
        "- bound: D",
    ]


def test_results_flags_a_time_20_percent_slower_than_the_same_case_before():
    """The 1.5B shm rows of issue 32 (421.1 ms at 90520ad, 653.6 ms at 4a9f4bf) and cases that must not be
    compared: another machine class, another model, a time 20 % slower exactly (not more)."""
    from benchmarks.results import runs_of, slower

    def row(date, commit, model, p50, machine="2 CPUs"):
        where = {"run": f"at {commit}", "commit": commit, "date": date, "machine": machine, "load": "-"}
        case = {"metric": "weight_sync", "transport": "shm", "model": model, "pipeline": True}
        size = {"1.5B": 3, "0.13B": 1}[model]
        return {"benchmark": "benchmarks.transfer_latency", **where, **case, "bytes": size, "p50_s": p50, "unit": "s"}

    rows = [
        row("2026-12-02 08:33", "90520ad", "1.5B", 0.4211),
        row("2026-12-02 08:33", "90520ad", "0.13B", 0.050),
        row("2026-12-02 11:25", "4a9f4bf", "1.5B", 0.6536),
        row("2026-12-02 11:25", "4a9f4bf", "0.13B", 0.060),  # exactly 20 % slower: not flagged
        row("2026-12-02 12:00", "x", "1.5B", 0.9, machine="8 CPUs"),  # no earlier row of its machine class
    ]
    runs = runs_of(rows)["benchmarks.transfer_latency"]
    assert slower(runs) == {
        ("2026-12-02 11:25", "at 4a9f4bf", "4a9f4bf"): [
            (
                "**slower**: weight_sync shm 1.5B: 653.6 ms is 55% slower than 421.1 ms at `90520ad` "
                "(2026-12-02 08:33: at 90520ad)"
            )
        ]
    }


def test_a_bound_of_interleaved_samples_takes_the_faster_copy_and_writes_its_definition():
    """Each sample's bound is the faster of copy_ and memmove (hand-made times below); 5 at least, median."""
    from benchmarks.common.timing import MIN_BOUND_SAMPLES, BoundSamples

    class Fake:  # a Copier whose times are given: (copy_, memmove) seconds of 1e9 bytes
        size = 10**9
        times = iter([(0.20, 0.10), (0.10, 0.25), (0.125, 0.5), (0.5, 0.4), (0.25, 0.2), (0.1, 0.2)])

        def pair(self):
            return next(self.times)

    b = BoundSamples(Fake(), slots=2)  # 2 places to take them: ceil(5 / 2) = 3 each
    b.take()
    b.take()
    assert MIN_BOUND_SAMPLES == 5 and len(b.copy_s) == 6
    f = b.fields(gbps=4.0)
    # fastest per sample: 0.1, 0.1, 0.125, 0.4, 0.2, 0.1 s -> 10, 10, 8, 2.5, 5, 10 GB/s; median 9
    assert f["bound_gbps_samples"] == [10.0, 10.0, 8.0, 2.5, 5.0, 10.0] and f["bound_gbps"] == 9.0
    assert f["bound_spread"] == pytest.approx((10 - 2.5) / 9) and f["ratio"] == pytest.approx(4 / 9)
    # copy_ alone: median of 0.1, 0.1, 0.125, 0.2, 0.25, 0.5 = 0.1625 s; memmove: of 0.1, 0.2, 0.2, 0.25, 0.4, 0.5
    assert f["copy_gbps"] == pytest.approx(1 / 0.1625) and f["memmove_gbps"] == pytest.approx(1 / 0.225)
    assert (
        f["ratio_memmove"] == pytest.approx(4 * 0.225) and "fastest of torch copy_ and libc memmove" in f["bound_def"]
    )


def test_streams_carry_the_bytes_over_each_connection_at_once():
    """A real peer's sink: 5 MiB + 1 byte over 3 loopback streams (shares 1747627, 1747627, 1747627 - 1 ...)."""
    from benchmarks.common.peers import Peer
    from benchmarks.common.wire import WIRE_OPS, Streams, fraction_row, shares

    assert shares(7, 3) == [3, 2, 2] and sum(shares((5 << 20) + 1, 3)) == (5 << 20) + 1
    with Peer("cpu", WIRE_OPS) as peer:
        wire = Streams(peer, (5 << 20) + 1, 3)
        try:
            assert wire.seconds == []  # the warm-up sample is not kept
            for _ in range(4):
                assert wire.sample() > 0
        finally:
            wire.close()
    per = wire.gbps_samples()
    assert len(per) == 4 and all(x == pytest.approx(((5 << 20) + 1) / s / 1e9) for x, s in zip(per, wire.seconds))
    row = fraction_row({"gbps": min(per) / 2, "model": "m", "bytes": (5 << 20) + 1, "memmove_gbps": None}, wire)
    assert row["streams"] == 3 and row["value"] <= 0.5 and row["fraction_of_memmove"] is None
