"""cluster.launcher=slurm: the rendered batch script and srun steps (always), and the tiny fleet
through a real single-node Slurm (slurmctld + slurmd + munged on localhost, started here) where
Debian's slurm-wlm is installed (``apt-get install slurmctld slurmd slurm-client munge``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_async.config import from_dict
from areal_async.supervisor.slurm import SlurmError, SlurmLauncher, render_sbatch, srun_command, with_allocation_hosts
from protocols.sockets import free_tcp_port
from tests.support.fleet import ROOT, check_books, cli

SLURM_BINS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol")


def test_rendered_script_asks_for_the_fleet_and_reruns_itself_inside(tmp_path):
    cfg = from_dict(
        {},
        [
            "cluster.n_nodes=2",
            "cluster.device=cuda",
            "cluster.n_gpus_per_node=4",
            "cluster.slurm.partition=gpu",
            "cluster.slurm.time_limit=1-00:00:00",
            "cluster.slurm.sbatch_args=['--qos=high']",
            "cluster.slurm.cpus_per_node=16",
            "experiment_name=my run",
        ],
    )
    text = render_sbatch(
        cfg,
        "configs/x y.yaml",
        tmp_path / "r",
        ["total_train_steps=5", "gconfig.top_p=0.9"],
        python="/opt/py/bin/python",
        workdir="/src",
    )
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    sb = [ln for ln in lines if ln.startswith("#SBATCH")]
    assert sb == [
        "#SBATCH --job-name=my-run",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={(tmp_path / 'r').resolve()}/logs/slurm-%j.out",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --qos=high",
    ]
    assert "cd /src" in lines
    last = lines[-1]
    assert last.startswith("exec /opt/py/bin/python -m areal_async.cli run ")
    assert f"'{(ROOT / 'configs/x y.yaml').resolve()}'" in last or "'" in last  # a path with a space is quoted
    assert last.endswith("--no-progress total_train_steps=5 gconfig.top_p=0.9 cluster.launcher=slurm")
    # a CPU run asks for no GPUs; no partition line when none is set
    plain = render_sbatch(from_dict({}, []), "c.yaml", tmp_path, [])
    assert "--gpus-per-node" not in plain and "--partition" not in plain and "#SBATCH --nodes=1" in plain


def test_srun_steps_name_the_node_and_keep_the_token_off_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "workers.rollout", "--run-dir", "/r", "--worker-id", "rollout-1"]
    step = srun_command("node7", "rollout-1", cmd, ["--mpi=none"])
    assert step[:1] == ["srun"] and "--overlap" in step and "--nodelist=node7" in step and "--export=ALL" in step
    assert step[-len(cmd) - 1 :] == ["--mpi=none", *cmd]
    launcher = SlurmLauncher(["n0", "n1"])
    with pytest.raises(RuntimeError, match="placed on node 2, but the allocation has 2"):
        launcher.start("rollout-0", cmd, {}, tmp_path / "x.log", node=2)


def test_bad_slurm_options_are_refused():
    from areal_async.config import ConfigError

    with pytest.raises(ConfigError, match="sbatch_args"):
        from_dict({}, ["cluster.slurm.sbatch_args=['qos=high']"])


# ---- a real single-node Slurm --------------------------------------------------------------

CONF = """ClusterName=areal
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged + slurmctld + slurmd on localhost with a private config; yields the environment to use it."""
    missing = [b for b in SLURM_BINS if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing or os.geteuid() != 0 or not Path("/etc/munge/munge.key").exists():
        pytest.skip(
            f"no single-node Slurm here (missing {missing or 'root / munge key'}): "
            "apt-get install slurmctld slurmd slurm-client munge"
        )
    d = Path(str(tmp_path_factory.mktemp("slurm"))).resolve()
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    conf = d / "slurm.conf"
    conf.write_text(
        CONF.format(host=host, user="root", ctld_port=free_tcp_port(), d_port=free_tcp_port(), d=d, cpus=os.cpu_count())
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    sbin = lambda b: shutil.which(b) or f"/usr/sbin/{b}"  # noqa: E731
    t0 = time.monotonic()
    subprocess.run(
        [
            sbin("munged"),
            "--force",
            "-S",
            f"{d}/munge.sock",
            f"--pid-file={d}/munged.pid",
            f"--log-file={d}/munged.log",
            f"--seed-file={d}/munge.seed",
        ],
        check=True,
        env=env,
    )
    subprocess.run([sbin("slurmctld"), "-f", str(conf)], check=True, env=env)
    subprocess.run([sbin("slurmd"), "-f", str(conf)], check=True, env=env)
    try:
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout:
            assert time.monotonic() - t0 < 60, (d / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.2)
        print(f"single-node Slurm ready in {time.monotonic() - t0:.1f}s")
        yield env
    finally:
        for name in ("slurmd.pid", "slurmctld.pid", "munged.pid"):  # only the daemons this fixture started
            pid = _pid(d / name)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


@pytest.mark.slow
def test_tiny_fleet_runs_as_srun_steps_of_a_real_slurm_job(slurm, tmp_path):
    run_dir = tmp_path / "run"
    cmd = cli(run_dir, "cluster.launcher=slurm")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=slurm, timeout=60)
    assert out.returncode == 0, out.stderr
    job = out.stdout.split("Slurm job ")[1].split(";")[0].split()[0]
    deadline = time.monotonic() + 300
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=slurm).stdout.strip():
        assert time.monotonic() < deadline, "the Slurm job did not finish in time"
        time.sleep(1.0)
    log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "[areal-async] done" in log, log[-3000:]
    check_books(run_dir, eta=1)
    # every worker ran as a step of this job (the supervisor started them through srun): slurmd launched 5
    pids = json.loads((run_dir / "pids.json").read_text())
    workers = {"scheduler", "trainer", "reward-0", "rollout-0", "rollout-1"}
    assert workers | {"supervisor"} <= set(pids)
    slurmd_log = (Path(slurm["SLURM_CONF"]).parent / "slurmd.log").read_text()
    assert slurmd_log.count(f"launch task StepId={job}.") == len(workers), slurmd_log[-2000:]


def test_a_multi_node_allocation_gives_each_node_its_address():
    cfg = from_dict({}, ["cluster.n_nodes=2", "cluster.control=tcp", "tensor_channel.weights=zmq"])
    assert with_allocation_hosts(cfg, ["localhost", "127.0.0.2"]).cluster.node_hosts == ["127.0.0.1", "127.0.0.2"]
    one = from_dict({}, [])
    assert with_allocation_hosts(one, ["localhost"]) is one  # one node: cluster.host as before
    with pytest.raises(SlurmError, match="cluster.control=tcp"):
        with_allocation_hosts(from_dict({}, ["cluster.n_nodes=2"]), ["localhost", "127.0.0.2"])
    with pytest.raises(SlurmError, match="cannot resolve"):
        with_allocation_hosts(cfg, ["no-such-node.invalid", "localhost"])
