"""benchmarks.common.heartbeat_load: lone heartbeats at a paced rate through the real SchedulerService."""

from benchmarks.common.heartbeat_load import measure_heartbeats


def test_two_hundred_heartbeats_a_second_reach_the_service_at_about_that_rate():
    m = measure_heartbeats("configs/tiny_arith.yaml", rate=200, seconds=1.5)
    # the fleet paces 200 a second and runs past the window: the service took about 200 a second of the window it
    # measured (half to one and a half times that: a stall on a loaded runner is caught up on either side)
    assert 100 <= m["heartbeats_per_s"] <= 300 and m["heartbeats"] <= m["fleet_sent"]
    assert 0 < m["value"] < 1.0 and m["cpu_us_per_heartbeat"] > 0
