"""The backend rows of transfer_latency (benchmarks/common/backends.py): phases from the client's own call log,
by hand-made timelines whose phases are worked out by hand here, and which (backend, model) rows run."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.common import backends as B


def ev(what: str, t0: float, t1: float, server: dict | None = None) -> dict:
    return {"what": what, "t0": t0, "t1": t1, "server": server}


def answer(events: list, t_recv: float, t_loaded: float, t1: float) -> dict:
    return {"events": events, "t_recv": t_recv, "t_loaded": t_loaded, "t1": t1}


# an SGLang update of two buckets, published at t = 10.000 (ms below, seconds in the events)
SGLANG = [
    ev("/pause_generation", 10.004, 10.005),
    ev("/begin_weight_update", 10.006, 10.007),
    ev("broadcast", 10.008, 10.012),  # bucket 0 on the wire 4 ms
    ev("/update_weights_from_distributed", 10.0075, 10.015, {"load_s": 0.002, "recompute_s": 0.0005}),
    ev("broadcast", 10.016, 10.019),  # bucket 1: 3 ms
    ev("/update_weights_from_distributed", 10.0155, 10.021, {"load_s": 0.001, "recompute_s": 0.0}),
    ev("/end_weight_update", 10.022, 10.023),
    ev("/model_info", 10.024, 10.026),
    ev("update", 10.006, 10.026),
    ev("/continue_generation", 10.027, 10.028),
    ev("/generate", 10.029, 10.035),
]


def test_sglang_phases_are_the_clients_calls_and_the_load_the_twin_reports():
    got = B.backend_phases("sglang", answer(SGLANG, 10.003, 10.0285, 10.035), 10.0)
    want_ms = {
        "channel": 3, "pause": 1, "session": 2, "pack": 0.5 + 0.5, "wire": 7, "load": 3 + 2, "check": 2,
        "resume": 1, "generate": 6.5, "other": 35 - (3 + 1 + 2 + 1 + 7 + 5 + 2 + 1 + 6.5),
    }  # fmt: skip
    assert got["phases"] == pytest.approx({f"{k}_s": v / 1e3 for k, v in want_ms.items()}, abs=1e-9)
    assert got["server_load_s"] == pytest.approx(0.002 + 0.0005 + 0.001) and got["server_load_source"] == "server"
    assert sum(got["phases"].values()) == pytest.approx(0.035) == pytest.approx(got["phased_total_s"])


def test_a_server_that_does_not_report_its_load_gets_the_clients_view():
    """A real SGLang server answers {success, message} only: the load is the client's (broadcast end -> answer)."""
    events = [dict(e, server=None) for e in SGLANG]
    got = B.backend_phases("sglang", answer(events, 10.003, 10.0285, 10.035), 10.0)
    assert got["server_load_s"] == pytest.approx(0.005) and got["server_load_source"] == "client"


def test_vllm_phases_split_the_update_at_its_calls():
    events = [
        ev("/pause", 20.010, 20.012),
        ev("/collective_rpc", 20.040, 20.100),  # file written 20.013 -> 20.040 (27 ms), reloaded in 60 ms
        ev("/reset_prefix_cache", 20.101, 20.103),
        ev("/resume", 20.104, 20.105),  # the probe's resume: part of the check
        ev("/v1/completions", 20.106, 20.150),
        ev("update", 20.013, 20.160),  # returns after the worker's own probe forward
        ev("/resume", 20.161, 20.163),
        ev("/v1/completions", 20.164, 20.180),
    ]
    got = B.backend_phases("vllm", answer(events, 20.005, 20.1635, 20.180), 20.0)
    want_ms = {"channel": 5, "pause": 2, "wire": 27, "load": 60, "kv": 2, "check": 57, "resume": 2, "generate": 16.5}
    want_ms["other"] = 180 - sum(want_ms.values())
    assert got["phases"] == pytest.approx({f"{k}_s": v / 1e3 for k, v in want_ms.items()}, abs=1e-9)
    assert got["server_load_s"] == pytest.approx(0.060) and got["server_load_source"] == "client"


def test_a_bucket_answered_before_its_broadcast_returns_has_no_load_and_a_shorter_wire():
    """The client's thread noted the broadcast's return 1 ms after the server answered the bucket's call (a real
    1.5B run crashed on load = -0.78 ms): the wire ends at the answer and that bucket's load is 0."""
    events = [dict(e) for e in SGLANG]
    events[2] = ev("broadcast", 10.008, 10.016)  # bucket 0's call answered at 10.015
    got = B.backend_phases("sglang", answer(events, 10.003, 10.0285, 10.035), 10.0)
    assert got["phases"]["wire_s"] == pytest.approx((7 + 3) / 1e3)  # 10.008 -> 10.015, then bucket 1's 3 ms
    assert got["phases"]["load_s"] == pytest.approx((0 + 2) / 1e3)  # bucket 1: 10.019 -> 10.021


@pytest.mark.parametrize(
    "events, t1, needle",
    [
        (SGLANG, 10.020, "not disjoint parts of the total"),  # the phases outlast the answer
        ([e for e in SGLANG if e["what"] != "broadcast"], 10.035, "0 broadcasts for 2 update calls"),
    ],
)
def test_a_timeline_that_cannot_be_an_update_is_refused(events, t1, needle):
    with pytest.raises(ValueError, match=needle):
        B.backend_phases("sglang", answer(events, 10.003, min(t1, 10.0285), t1), 10.0)


def test_vllm_without_its_reload_call_is_refused():
    with pytest.raises(ValueError, match="expected one '/collective_rpc' call"):
        B.vllm_phases([ev("update", 0, 1), ev("/reset_prefix_cache", 0.5, 0.6)])


def args(**kw) -> argparse.Namespace:
    base = {"backends": None, "backend_models": "tiny", "quick": True, "no_e2e": False, "device": "cpu"}
    return argparse.Namespace(**(base | kw))


def test_cases_follow_the_flags():
    notes: list[str] = []
    assert B.cases(args(), notes) == [("sglang", "tiny")]
    assert B.cases(args(backend_models="tiny,0.13B"), notes) == [("sglang", "tiny"), ("sglang", "0.13B")]
    assert B.cases(args(no_e2e=True), notes) == B.cases(args(backends="none"), notes) == []
    assert B.cases(args(device="cuda"), notes) == [] and notes == []
    with pytest.raises(SystemExit, match="--backend-models '7B'"):
        B.cases(args(backend_models="tiny,7B"), notes)


def test_vllm_rows_without_its_environment_are_skipped_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_VLLM_ENV", str(tmp_path / "absent"))
    notes: list[str] = []
    assert B.cases(args(quick=False), notes) == [("sglang", "tiny")]  # the full run's default asks for vLLM too
    assert len(notes) == 1 and notes[0].startswith("backend rows of vllm skipped:") and "setup_vllm.sh" in notes[0]


def test_a_failed_backend_row_keeps_the_rows_measured_before_it(monkeypatch, tmp_path):
    """A 25-minute run lost every row to one backend's phase error: now the rows are written, then it fails."""
    from benchmarks import transfer_latency as T

    measured = [{"metric": "run_info", "value": 0, "unit": ""}, {"metric": "memcpy_gbps", "value": 9.5, "unit": "GB/s"}]

    def failing_run(opts):
        try:
            raise ValueError("phases are not disjoint")
        except ValueError as e:
            raise T.PartialRun(measured) from e

    monkeypatch.setattr(T, "run", failing_run)
    monkeypatch.setattr(T, "show", lambda rows: None)
    out = tmp_path / "rows.json"
    with pytest.raises(SystemExit, match="2 rows measured before a backend row failed.*not disjoint"):
        T.main(["--quick", "--json", str(out)])
    assert [r["metric"] for r in json.loads(out.read_text())] == ["run_info", "memcpy_gbps"]
