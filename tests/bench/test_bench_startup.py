"""benchmarks/startup.py's reading of a run: log stamps, the first marked line across logs, the rows."""

from datetime import datetime

from benchmarks.startup import first_line_time, log_time, rows_of


def test_log_time_reads_the_worker_log_stamp():
    t = log_time("2026-12-06 06:40:29,710 rollout-0 INFO areal_async.rollout: first tokens generated (weights v0)")
    assert t == datetime(2026, 12, 6, 6, 40, 29, 710000).timestamp()
    assert log_time("Traceback (most recent call last):") is None


def test_the_first_marked_line_across_logs(tmp_path):
    a, b = tmp_path / "rollout-0.log", tmp_path / "rollout-1.log"
    a.write_text(
        "2026-12-06 06:40:29,710 rollout-0 INFO x: rollout-0 started\n"
        "2026-12-06 06:40:31,500 rollout-0 INFO x: first tokens generated (weights v0)\n"
        "2026-12-06 06:40:32,000 rollout-0 INFO x: first tokens generated (weights v1)\n"
    )
    b.write_text("2026-12-06 06:40:31,250 rollout-1 INFO x: first tokens generated (weights v0)\n")
    assert first_line_time([a, b], "first tokens generated") == datetime(2026, 12, 6, 6, 40, 31, 250000).timestamp()
    assert first_line_time([a], "trainer ready") is None


def test_rows_hold_each_run_and_the_median():
    ev = ("spawned", "trainer_ready", "first_token", "first_step", "total")
    runs = [
        {"events": dict(zip(ev, [1.0, 4.0, 4.5, 6.0, 8.0])), "ready": {"trainer": 3.9}, "cpu_s": 10.0, "load": 1.0,
         "cpu_by_role": {"trainer": 2.5}},
        {"events": dict(zip(ev, [1.0, 5.0, 5.5, 7.0, 9.0])), "ready": {}, "cpu_s": 11.0, "load": 2.0},
        {"events": dict(zip(ev, [2.0, 3.0, None, 5.0, 7.5])), "ready": {}, "cpu_s": 9.0, "load": 3.0},
    ]  # fmt: skip
    rows = rows_of(runs)
    median = {r["metric"]: r["value"] for r in rows if r["rep"] == "median"}
    assert median == {
        "startup_spawned_s": 1.0, "startup_trainer_ready_s": 4.0, "startup_first_token_s": 5.0,
        "startup_first_step_s": 6.0, "startup_total_s": 8.0,
    }  # fmt: skip
    first = [(r["metric"], r["value"]) for r in rows if r["rep"] == 0]
    assert ("startup_ready_trainer_s", 3.9) in first and ("startup_cpu_trainer_s", 2.5) in first
    assert ("startup_cpu_s", 10.0) in first and all(r["unit"] == "s" for r in rows)
