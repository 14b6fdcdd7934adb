"""benchmarks.scheduler_cpu: the real SchedulerService driven in-process by the null fleet's logic keeps
its books (every planned sample trained, one TrainStepDone a step, no fleet error) and reports the
service's CPU with the fleet's taken out."""

import asyncio
import time

from benchmarks import scheduler_cpu as bench
from benchmarks.data_path import DEFAULT_MIX


def test_twenty_steps_train_every_planned_sample_and_cost_the_service_cpu():
    t0 = time.thread_time()
    m = asyncio.run(bench.measure(DEFAULT_MIX, steps=20, warmup=2))
    whole = time.thread_time() - t0  # building the service and the fleet, warm-up, both sides' work
    # configs/tiny_arith.yaml: 32 groups a step (train_dataset.batch_size) of 4 samples (rollout.n_samples)
    assert m["steps"] == 20 and m["samples_trained"] == 20 * 32 * 4
    assert m["received_total"]["train_step_done"] == 22 and m["received_total"]["register"] == 4
    assert m["fleet_errors"] == []
    assert 0 < m["service_cpu_s"] < whole
    # 20 steps of 1 WeightsPublished, 2 WeightsLoaded, 1 TrainStepDone, >= 3 + 3 batched group messages (32
    # groups, <= 11 and <= 12 a message) and 1.39 heartbeats: at least 10 a step
    assert m["messages"] >= 20 * 10


def test_the_heartbeats_flag_changes_only_the_mix_heartbeats(tmp_path):
    (row,) = bench.main(["--steps", "3", "--warmup", "1", "--heartbeats", "20", "--json", str(tmp_path / "r.json")])
    assert row["mix"]["heartbeats"] == 20 and row["mix"]["traj_groups"] == DEFAULT_MIX.traj_groups
    # 20 a step from the fleet's 4 workers, round-robin, after each of the 4 plans answered: at least 3 * 20
    assert row["received_total"]["heartbeat"] >= 60
    assert (tmp_path / "r.json").exists()


def test_its_rows_are_recognised_and_rendered_as_its_own():
    from benchmarks import results

    row = {"metric": "scheduler_service_cpu_ms_per_step", "value": 2.2, "unit": "ms", "steps": 1500}
    row |= {"messages": 17085, "messages_per_service_cpu_s": 5177.27}
    assert results.recognise([row]) == "benchmarks.scheduler_cpu"
    assert results.scheduler_cpu([row])[-1] == (
        "| scheduler_service_cpu_ms_per_step | 2.200 | ms | 1500 steps, 17085 messages: 5177 per service CPU-s "
        "(in-process, no sockets) |"
    )
