"""The supervisor's parts on their own, no processes: the plan (worker specs and commands, the
restart and recovery rules), the run-directory writer, the lost-worker log and the progress line.
Expected values are written out by hand from the config."""

import json
import sys

import pytest

from areal_async.base.manifest import RunManifest
from areal_async.config import from_dict
from areal_async.supervisor.placement import Slot
from areal_async.supervisor.plan import LaunchError, recovery_verdict, why_no_restart, worker_command, worker_specs
from areal_async.supervisor.progress import ProgressLine
from areal_async.supervisor.rundir import Nodes, write_run_dir
from areal_async.supervisor.watchdog import lost_log


def test_worker_specs_in_start_order_with_their_indexes():
    cfg = from_dict({}, ["cluster.n_reward_workers=2", "cluster.n_trainer_ranks=2", "cluster.n_rollout_workers=3"])
    assert [tuple(s) for s in worker_specs(cfg)] == [
        ("scheduler", "workers.scheduler", 0),
        ("reward-0", "workers.reward", 0),
        ("reward-1", "workers.reward", 1),
        ("trainer", "workers.trainer", 0),
        ("trainer-1", "workers.trainer", 1),
        ("rollout-0", "workers.rollout", 0),
        ("rollout-1", "workers.rollout", 1),
        ("rollout-2", "workers.rollout", 2),
    ]


def test_worker_command_pins_only_the_roles_that_ask(tmp_path):
    cfg = from_dict({}, ["cluster.cpu_affinity.trainer=0"])
    trainer, rollout = worker_specs(cfg)[2], worker_specs(cfg)[3]
    head = [sys.executable, "-m"]
    assert worker_command(cfg, tmp_path, trainer) == head + [
        "workers.trainer", "--run-dir", str(tmp_path), "--worker-id", "trainer", "--index", "0", "--cpus", "0",
    ]  # fmt: skip
    assert worker_command(cfg, tmp_path, rollout) == head + [
        "workers.rollout", "--run-dir", str(tmp_path), "--worker-id", "rollout-0", "--index", "0",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, role, restarts, ended, expected",
    [
        ([], "rollout", 0, False, None),
        ([], "reward", 0, False, None),
        ([], "trainer", 0, False, "a trainer worker is never restarted"),
        ([], "scheduler", 0, False, "a scheduler worker is never restarted"),
        ([], "rollout", 0, True, "the run had ended"),
        (["cluster.max_restarts=2"], "rollout", 2, False, "2 restart(s) used"),
        (["cluster.max_restarts=0"], "reward", 0, False, "cluster.max_restarts=0"),
        (
            ["tensor_channel.trajectories=gloo"],
            "rollout",
            0,
            False,
            "tensor channel(s) gloo form a fixed process group that a new process cannot join",
        ),
        (["tensor_channel.trajectories=gloo"], "sglang", 0, False, None),  # a server joins no tensor channel
    ],
)
def test_why_no_restart(overrides, role, restarts, ended, expected):
    assert why_no_restart(from_dict({}, overrides), role, restarts, ended) == expected


def test_recovery_budget_counts_recoveries_in_a_row():
    first = "recovering the run (1/2 in a row, 1 in all) from the newest complete checkpoint"
    assert recovery_verdict(0, 0, 2, False) == (True, first)
    assert recovery_verdict(1, 4, 2, False) == (
        True,
        "recovering the run (2/2 in a row, 5 in all) from the newest complete checkpoint",
    )
    assert recovery_verdict(2, 5, 2, False) == (
        False,
        "the run failed (2 recoveries in a row without a newer checkpoint)",
    )
    assert recovery_verdict(0, 0, 0, False) == (False, "the run failed")
    assert recovery_verdict(0, 0, 2, True) == (False, "the run failed at once")


def test_run_dir_writer_writes_config_keys_and_endpoints(tmp_path):
    cfg = from_dict({}, ["cluster.n_reward_workers=1", "cluster.n_rollout_workers=1"])
    run_dir = tmp_path / "run"
    rd = write_run_dir(cfg, run_dir, Nodes(cfg, {}, lambda wid: None), recoveries=3)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "logs").is_dir()
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert sorted(rd.tokens) == ["reward-0", "rollout-0", "scheduler", "trainer"]
    assert rd.token_env("reward-0") == {"AREAL_LAUNCH_TOKEN": rd.tokens["reward-0"]} and rd.token_env("x") == {}
    saved = RunManifest.load(run_dir)
    assert saved == rd.manifest and len(saved.rewards) == 1
    assert (saved.recoveries, saved.resume_from, saved.servers) == (3, None, [])


def test_run_dir_writer_refuses_a_directory_holding_another_run_and_touches_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    cfg = from_dict({}, [])
    with pytest.raises(LaunchError, match="already holds a run"):
        write_run_dir(cfg, tmp_path, Nodes(cfg, {}, lambda wid: None), recoveries=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_nodes_prefer_the_launchers_address_then_the_placement():
    cfg = from_dict(
        {},
        [
            "cluster.n_nodes=2",
            "cluster.node_hosts=[10.0.0.1,10.0.0.2]",
            "cluster.control=tcp",
            "tensor_channel.trajectories=zmq",
            "tensor_channel.weights=zmq",
        ],
    )
    nodes = Nodes(cfg, {"trainer": Slot(node=1)}, lambda wid: "10.9.9.9" if wid == "rollout-0" else None)
    assert nodes.host("rollout-0") == "10.9.9.9"  # the launcher placed it
    assert nodes.host("trainer") == "10.0.0.2" and nodes.host(None) == "10.0.0.1"
    assert nodes.env("trainer") == {"AREAL_NODE_HOST": "10.0.0.2"}


def test_lost_log_reads_each_complete_line_once(tmp_path):
    path = tmp_path / "lost.jsonl"
    log = lost_log(tmp_path)
    assert log.read() == []  # no file yet
    path.write_text(json.dumps({"worker": "a"}) + "\nnot json\n" + '{"worker": "b"')  # b is half written
    assert log.read() == [{"worker": "a"}]
    with open(path, "a") as f:
        f.write("}\n")
    assert log.read() == [{"worker": "b"}]
    assert log.read() == []


def test_progress_line_from_the_newest_step_row(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    row = {"step": 3, "version": 4, "reward_mean": 0.5, "staleness_max": 1, "samples_trained_total": 120, "wall_s": 60}
    metrics.write_text(json.dumps(row) + "\n" + json.dumps({"kind": "eval", "step": 3}) + "\n")
    line = ProgressLine(metrics, 10, 0.0, enabled=True)
    line.draw()
    line.draw()  # unchanged: not written again
    out = capsys.readouterr().out
    assert out == "[areal-async] step 4/10  v4  reward 0.500  staleness<=1     2.0 samples/s    60.0s\n"
    ProgressLine(metrics, 10, 0.0, enabled=False).draw()
    assert capsys.readouterr().out == ""
