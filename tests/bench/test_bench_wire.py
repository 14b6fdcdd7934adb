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
        {"metric": "wire_bound", "transport": "tcp", "payload": "loopback TCP", "repeats": 3,
         "p50_s": 0.0846, "gbps": 3.17, "bound_gbps": 8.61, "ratio": 0.368},
        {"metric": "run_info", "value": 0, "unit": "", "notes": ["a whole run's --json holds one"]},
    ]  # fmt: skip
    assert recognise(rows) == "benchmarks.transfer_latency"
    assert transfer_latency(rows)[2:] == [
        "| shm | 0.13B |  | 9 | 47.6 | 5.44 | 10.83 | 0.50 | 0.52 |",
        "| tcp | loopback TCP |  | 3 | 84.6 | 3.17 | 8.61 | 0.37 | - |",
    ]
