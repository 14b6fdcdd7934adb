"""Device placement: which GPUs each process of a run gets, for the boba presets' cluster shapes."""

import pytest

from areal_async.supervisor.placement import (
    ClusterShape,
    PlacementError,
    Slot,
    check_gpus_present,
    gpus_needed_on,
    place,
)

EXTRA = ("scheduler", "reward-0")


def shape(nodes, rollout_gpus, ranks, rollout_workers=4, device="cuda"):
    return ClusterShape(
        n_nodes=nodes,
        n_gpus_per_node=8,
        device=device,
        n_trainer_ranks=ranks,
        n_rollout_workers=rollout_workers,
        rollout_gpus=rollout_gpus,
        extra_workers=EXTRA,
    )


def test_one_node_of_eight_boba_1_5b():
    # boba_grpo.yaml: sglang:d4 over 4 rollout workers, 4 trainer ranks on the other half of the node
    p = place(shape(1, 4, 4))
    assert [p[f"rollout-{i}"] for i in range(4)] == [Slot(0, (i,)) for i in range(4)]
    assert [p[w] for w in ("trainer", "trainer-1", "trainer-2", "trainer-3")] == [
        Slot(0, (4,), 0),
        Slot(0, (5,), 1),
        Slot(0, (6,), 2),
        Slot(0, (7,), 3),
    ]
    assert p["scheduler"] == Slot(0) and p["reward-0"] == Slot(0)
    assert p["trainer-2"].env() == {"CUDA_VISIBLE_DEVICES": "6", "LOCAL_RANK": "2"}
    assert p["reward-0"].env() == {"CUDA_VISIBLE_DEVICES": ""}
    assert gpus_needed_on(p, 0) == 8


def test_two_nodes_of_eight():
    # d8 over 4 rollout workers (2 GPUs each) fills node 0; 8 trainer ranks fill node 1
    p = place(shape(2, 8, 8))
    assert p["rollout-0"] == Slot(0, (0, 1)) and p["rollout-3"] == Slot(0, (6, 7))
    assert p["trainer"] == Slot(1, (0,), 0) and p["trainer-7"] == Slot(1, (7,), 7)
    assert p["rollout-1"].env() == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert all(len(s.gpus) == 1 for w, s in p.items() if w.startswith("trainer"))


def test_sixteen_nodes_of_eight():
    # d64 over 64 rollout workers on nodes 0-7, 64 trainer ranks on nodes 8-15
    p = place(shape(16, 64, 64, rollout_workers=64))
    assert p["rollout-0"] == Slot(0, (0,)) and p["rollout-9"] == Slot(1, (1,)) and p["rollout-63"] == Slot(7, (7,))
    assert p["trainer"] == Slot(8, (0,), 0) and p["trainer-8"] == Slot(9, (0,), 0)
    assert p["trainer-13"] == Slot(9, (5,), 5) and p["trainer-63"] == Slot(15, (7,), 7)
    pairs = [(s.node, g) for s in p.values() for g in s.gpus]
    assert len(pairs) == len(set(pairs)) == 128  # every GPU used exactly once
    assert sorted({s.local_rank for w, s in p.items() if w.startswith("trainer")}) == list(range(8))


def test_refuses_more_gpus_than_the_cluster_has():
    with pytest.raises(PlacementError, match=r"needs 9 GPUs \(4 rollout \+ 5 trainer ranks\).* = 8"):
        place(shape(1, 4, 5))


def test_refuses_a_process_spanning_nodes_and_uneven_rollout_gpus():
    with pytest.raises(PlacementError, match="spanning nodes 0 and 1"):
        place(shape(2, 12, 1, rollout_workers=2))  # 6 GPUs each: rollout-1 gets globals 6..11
    with pytest.raises(PlacementError, match="6 rollout GPUs do not divide over cluster.n_rollout_workers=4"):
        place(shape(1, 6, 1))


def test_refuses_when_the_machine_has_fewer_gpus_than_asked():
    p = place(shape(1, 4, 4))
    check_gpus_present(p, 0, 8)
    with pytest.raises(PlacementError, match="node 0 needs 8 GPUs for this placement but this machine has 2"):
        check_gpus_present(p, 0, 2)
    with pytest.raises(PlacementError, match="this machine has 0"):
        check_gpus_present(p, 0, 0)


def test_cpu_runs_get_no_gpus():
    p = place(shape(1, 0, 2, device="cpu"))
    assert p["trainer-1"] == Slot(0, (), 1) and p["rollout-0"] == Slot(0) and gpus_needed_on(p, 0) == 0
    check_gpus_present(p, 0, 0)
    with pytest.raises(PlacementError, match="n_trainer_ranks=0"):
        place(shape(1, 0, 0, device="cpu"))


@pytest.mark.parametrize("nodes, dp, ranks", [(1, 4, 4), (2, 8, 8), (16, 64, 64)])
def test_boba_preset_layouts(nodes, dp, ranks):
    """configs/boba_grpo.yaml as shipped (1x8: sglang:d4 + 4 ranks) and scaled to 2x8 and 16x8;
    the supervisor refuses each before starting anything on a machine with 2 GPUs."""
    from areal_async.config import load_config
    from areal_async.supervisor.local import LaunchError, device_placement

    cfg = load_config(
        "configs/boba_grpo.yaml",
        [
            f"cluster.n_nodes={nodes}",
            f"rollout.backend=sglang:d{dp}",
            f"cluster.n_rollout_workers={dp}",
            f"cluster.n_trainer_ranks={ranks}",
        ],
    )
    p = device_placement(cfg, gpus_here=8)
    trainers = [s for w, s in p.items() if w.startswith("trainer")]
    assert len(trainers) == ranks and all(len(s.gpus) == 1 for s in trainers)
    assert sorted((s.node, g) for s in p.values() for g in s.gpus) == [(n, g) for n in range(nodes) for g in range(8)]
    with pytest.raises(LaunchError, match="needs 8 GPUs for this placement but this machine has 2"):
        device_placement(cfg, gpus_here=2)


def test_local_gpu_count_reads_visible_devices_or_device_nodes(tmp_path):
    from areal_async.supervisor.placement import local_gpu_count

    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert local_gpu_count({}, tmp_path) == 3
    assert local_gpu_count({"CUDA_VISIBLE_DEVICES": "4,5"}, tmp_path) == 2
    assert local_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == 0


def test_a_cpu_run_deals_its_processes_over_the_nodes_in_start_order():
    p = place(shape(2, 0, 2, rollout_workers=3, device="cpu"))
    # start order: scheduler, reward-0, trainer, trainer-1, rollout-0, rollout-1, rollout-2
    assert [p[w].node for w in ("scheduler", "reward-0", "trainer", "trainer-1")] == [0, 1, 0, 1]
    assert [p[f"rollout-{i}"].node for i in range(3)] == [0, 1, 0]
    assert p["trainer"].local_rank == 0 and p["trainer-1"].local_rank == 0  # first trainer rank of its node
    assert all(s.gpus == () for s in p.values())
    assert {s.node for s in place(shape(1, 0, 2, device="cpu")).values()} == {0}
