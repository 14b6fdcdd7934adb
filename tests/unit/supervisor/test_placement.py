"""Device placement: which GPUs each process of a run gets, for the boba presets' cluster shapes."""

import sys

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
    assert p["trainer-2"].env() == {"CUDA_VISIBLE_DEVICES": "6", "LOCAL_RANK": "0"}  # its one GPU is cuda:0
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


# ---- issue 23 (items 2, 6, 7): layouts NCCL, the servers or CUDA IPC refuse --------------------------------
def gpu_cfg(name="boba_grpo.yaml", *over):
    from areal_async.config import load_config

    return load_config(f"configs/{name}", list(over))


def test_a_parent_cuda_visible_devices_list_is_where_workers_and_servers_go(tmp_path):
    """Under CUDA_VISIBLE_DEVICES=4,5,6,7 (Slurm) node-local GPU k is physical 4+k for workers AND servers;
    on main the workers got 0..3 while SGLang's --base-gpu-id j, read inside the parent's list, meant 4+j."""
    from areal_async.supervisor.placement import shape_of
    from areal_async.supervisor.servers import server_commands

    cfg = gpu_cfg(
        "gsm8k_grpo.yaml",
        "cluster.n_gpus_per_node=4",
        "rollout.backend=sglang:d2",
        "cluster.n_rollout_workers=2",
        "cluster.n_trainer_ranks=2",
    )
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    p = place(shape_of(cfg, env))
    got = {w: s.env()["CUDA_VISIBLE_DEVICES"] for w, s in p.items() if s.gpus}
    assert got == {
        "sglang-0": "4",
        "sglang-1": "5",
        "rollout-0": "4",
        "rollout-1": "5",
        "trainer": "6",
        "trainer-1": "7",
    }
    cmds = dict(server_commands(cfg, tmp_path, ["http://127.0.0.1:1", "http://127.0.0.1:2"]))
    assert all(c[c.index("--base-gpu-id") + 1] == "0" for c in cmds.values())  # inside its own one-GPU list
    # SGLang does not ask to end with the supervisor itself: each server starts through the wrapper that asks first
    wrapped = ["-m", "areal_async.base.parent", sys.executable, "-m", "sglang.launch_server"]
    assert all(c[1:6] == wrapped for c in cmds.values())
    with pytest.raises(PlacementError, match="n_gpus_per_node=8 but the supervisor's CUDA_VISIBLE_DEVICES=4,5,6,7"):
        place(shape_of(gpu_cfg(), env))
    with pytest.raises(PlacementError, match="UUID"):
        place(shape_of(cfg, {"CUDA_VISIBLE_DEVICES": "GPU-8a1b,GPU-99"}))


def test_vllm_servers_beyond_the_worker_count_keep_their_gpus_from_the_trainer():
    """vllm:d4 over 2 workers: four servers on GPUs 0-3 (vllm-j), trainer ranks on 4-7; main gave the
    rollout fleet 2 GPUs and put trainer ranks on GPUs 2 and 3, under vLLM's gpu_memory_utilization 0.9."""
    from areal_async.supervisor.placement import shape_of

    p = place(shape_of(gpu_cfg("boba_grpo.yaml", "rollout.backend=vllm:d4", "cluster.n_rollout_workers=2"), {}))
    assert [p[f"vllm-{j}"].physical for j in range(4)] == [(0,), (1,), (2,), (3,)]
    assert p["rollout-0"].physical == (0, 2) and p["rollout-1"].physical == (1, 3)  # its servers j = i mod 2
    assert [p[t].physical[0] for t in ("trainer", "trainer-1", "trainer-2", "trainer-3")] == [4, 5, 6, 7]


def test_two_ranks_of_one_nccl_group_on_one_gpu_or_a_trainer_on_a_server_gpu_are_refused():
    from dataclasses import replace

    from areal_async.supervisor.placement import check_layout

    colocated = replace(shape(1, 0, 1, rollout_workers=2), n_gpus_per_node=1, colocate=True)
    with pytest.raises(PlacementError, match="'trajectories-channel'.*Duplicate GPU detected"):
        place(replace(colocated, nccl_channels=("trajectories",)))
    servers = replace(shape(1, 2, 2, rollout_workers=2), servers="sglang")
    bad = dict(place(servers), **{"trainer-1": Slot(0, (1,), 1)})  # a hand-made layout: a rank on sglang-1's GPU
    with pytest.raises(PlacementError, match="trainer-1 would share GPU 1 with sglang-1"):
        check_layout(bad, servers)
    with pytest.raises(PlacementError, match="sglang:d9 starts 9 servers.*on node 0"):
        place(replace(servers, n_nodes=2, rollout_gpus=9, n_rollout_workers=9))


def test_a_one_gpu_box_colocates_the_torch_engine_with_cuda_ipc_weights_or_says_why_not():
    """One GPU: rollout engines on trainer rank 0's GPU (cuda_ipc weights: the receiver opens memory on
    the GPU it sees; trajectories over zmq), else a refusal that names the colocated layout."""
    from areal_async.supervisor.placement import nccl_groups, shape_of

    cfg = gpu_cfg(
        "tiny_arith.yaml",
        "cluster.device=cuda",
        "cluster.n_gpus_per_node=1",
        "tensor_channel.weights=cuda_ipc",
        "tensor_channel.trajectories=zmq",
    )
    shape = shape_of(cfg, {})
    p = place(shape)
    assert p["trainer"].physical == p["rollout-0"].physical == p["rollout-1"].physical == (0,)
    assert nccl_groups(p, shape) == {}
    with pytest.raises(PlacementError, match="the 1-GPU layout colocates: tensor_channel.weights=cuda_ipc"):
        place(shape_of(gpu_cfg("tiny_arith.yaml", "cluster.device=cuda", "cluster.n_gpus_per_node=1"), {}))
    with pytest.raises(PlacementError, match="'trajectories-channel'.*Duplicate GPU"):
        place(
            shape_of(
                gpu_cfg(
                    "tiny_arith.yaml",
                    "cluster.device=cuda",
                    "cluster.n_gpus_per_node=1",
                    "tensor_channel.weights=cuda_ipc",
                    "tensor_channel.trajectories=nccl",
                ),
                {},
            )
        )


def test_the_supervisor_refuses_the_boba_layout_on_a_machine_with_too_few_gpus():
    from areal_async.supervisor.plan import LaunchError, device_placement

    assert len(device_placement(gpu_cfg(), gpus_here=8, environ={})) == 4 + 4 + 4 + 2  # servers, workers, ranks
    with pytest.raises(LaunchError, match="needs 8 GPUs for this placement but this machine has 2"):
        device_placement(gpu_cfg(), gpus_here=2, environ={})


def test_a_shared_gpu_is_asked_of_ray_once():
    """Ray's bundles: boba's servers hold GPUs 0-3, the rollout workers beside them ask for none, the four
    trainer ranks one each: 8 GPUs for an 8-GPU node (counting the workers too would ask for 12)."""
    from areal_async.supervisor.placement import shape_of
    from areal_async.supervisor.ray_launcher import ray_plan

    p = place(shape_of(gpu_cfg(), {}))
    order = [f"sglang-{j}" for j in range(4)] + ["scheduler", "reward-0", "trainer", "trainer-1", "trainer-2"]
    got = ray_plan(p, order + ["trainer-3"] + [f"rollout-{i}" for i in range(4)]).own
    assert sum(got.values()) == 8 and [got[f"rollout-{i}"] for i in range(4)] == [0] * 4
    assert [got[w] for w in ("sglang-0", "trainer-3", "scheduler")] == [1, 1, 0]
