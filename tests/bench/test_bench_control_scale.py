"""benchmarks.common.control_scale: the control plane's messages at 1000 and 10,000 GPUs, counted by hand,
over a measured rate (the lowest of the rows given)."""

import json

import pytest

from benchmarks import scale_model
from benchmarks.common import control_scale as cs


def test_a_thousand_gpus_send_about_618_messages_a_second():
    # 1000 workers / 2 s = 500 heartbeats; 3 x 512 groups / 30 s = 51.2; 2 x 1000 workers / 30 s = 66.67
    parts = cs.control_messages(1000)
    assert parts == pytest.approx({"heartbeats": 500.0, "groups": 51.2, "weights": 2000 / 30})
    assert sum(cs.control_messages(10_000).values()) == pytest.approx(5000 + 51.2 + 20000 / 30)


def test_the_share_of_a_core_divides_by_the_lowest_measured_rate(tmp_path):
    rows = [
        {"metric": "scheduler_service_messages_per_s", "value": 19000.0, "messages_per_cpu_s": 20000.0},
        {"metric": "scheduler_service_messages_per_s", "value": 25000.0, "messages_per_cpu_s": 25000.0},
        {"metric": "scheduler_messages_per_s", "value": 60000.0, "messages_per_cpu_s": 60000.0},  # bare: not used
    ]
    one, ten = cs.control_rows(rows, "r")
    assert (one["gpus"], ten["gpus"]) == (1000, 10_000) and one["rate_messages_per_cpu_s"] == 20000.0
    assert one["value"] == pytest.approx((500 + 51.2 + 2000 / 30) / 20000)  # 0.0309 of a core
    assert ten["value"] == pytest.approx((5000 + 51.2 + 20000 / 30) / 20000)  # 0.286
    path = tmp_path / "dp.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert scale_model.read_rows(str(path)) == rows
    with pytest.raises(ValueError, match="no scheduler_service_messages_per_s row"):
        cs.control_rows(rows[2:])


def test_by_kind_the_heartbeats_take_their_own_measured_share():
    """1000 GPUs: 500 heartbeats/s measured alone at 0.10 and 0.12 of a core (the costlier kept) + (51.2 +
    66.67) group and weight messages/s at the lowest mix rate, 4000 per CPU-s: 0.12 + 117.87 / 4000 =
    0.14947. 10,000 GPUs: no heartbeat row within 1 % of 5000/s (4900 is 2 % off): no row."""
    rows = [
        {"metric": "scheduler_service_messages_per_s", "value": 3900.0, "messages_per_cpu_s": 4000.0},
        {"metric": "scheduler_service_heartbeat_core_frac", "value": 0.10, "heartbeats_per_s": 500.2},
        {"metric": "scheduler_service_heartbeat_core_frac", "value": 0.12, "heartbeats_per_s": 499.0},
        {"metric": "scheduler_service_heartbeat_core_frac", "value": 0.20, "heartbeats_per_s": 4900.0},
    ]
    (one,) = cs.control_rows_by_kind(rows, "r")
    assert one["gpus"] == 1000 and one["heartbeat_core_frac"] == 0.12
    assert one["value"] == pytest.approx(0.12 + (51.2 + 2000 / 30) / 4000)  # 0.14947
    assert one["value"] == pytest.approx(0.14947, abs=1e-5)
    assert cs.control_rows_by_kind(rows[:1]) == []  # no heartbeat measured alone: nothing by kind
