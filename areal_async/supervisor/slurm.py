"""``cluster.launcher=slurm``: one allocation, one ``srun`` step per worker process.

Outside an allocation, ``areal-async run CONFIG cluster.launcher=slurm`` renders
``RUN_DIR/sbatch.sh`` (``render_sbatch``) and submits it with ``sbatch`` (``cluster.slurm.submit``).
The script asks for ``cluster.n_nodes`` nodes (GPUs per node on a GPU run) and runs the same
command inside the allocation, where the supervisor runs as the batch step on the first node and
starts every worker as an ``srun --overlap`` step on the node its placement names
(``SlurmLauncher``): the steps share the allocation's CPUs and GPUs, each is one task. Every
worker finds the scheduler's address and the run's keys in the run directory (``endpoints.json``,
``keys/``), which must be on a filesystem every node mounts; its launch token travels in the
step's environment (``srun --export=ALL``), never on the command line.

The supervisor's rules carry over unchanged: a step that ends non-zero is a dead worker
(restarted with a new step, or the run fails); stopping signals the local ``srun``, which
forwards the signal to its step (SIGKILL ends ``srun`` and Slurm then kills the step).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

from areal_async.base.private import private_dir
from areal_async.config import ExperimentConfig
from areal_async.supervisor.fleet import run_fleet
from areal_async.supervisor.launchers import Launched, Launcher, LocalProcess, popen_logged


class SlurmError(RuntimeError):
    """Slurm refused or is missing; the message names the command and what it said."""


def inside_allocation(env: Optional[dict] = None) -> bool:
    return bool((env if env is not None else os.environ).get("SLURM_JOB_ID"))


def allocation_nodes(env: Optional[dict] = None) -> list[str]:
    """Hostnames of the allocation, in Slurm's order (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    env = env if env is not None else os.environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("SLURM_JOB_NODELIST is not set: cluster.launcher=slurm runs its steps inside an allocation")
    out = _run(["scontrol", "show", "hostnames", nodelist])
    return out.split()


def srun_command(node: str, name: str, cmd: list[str], extra: list[str] = ()) -> list[str]:
    """The ``srun`` step that runs ``cmd`` as worker ``name`` on ``node`` (one task, sharing the allocation)."""
    return [
        "srun",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--job-name={name}",
        "--export=ALL",
        "--kill-on-bad-exit=1",
        "--quiet",
        *extra,
        *cmd,
    ]


class SlurmLauncher(Launcher):
    """Workers as ``srun`` steps of the current allocation; node ``k`` of the placement is the
    allocation's ``k``-th node."""

    name = "slurm"

    def __init__(self, nodes: list[str], srun_args: list[str] = ()):
        if not nodes:
            raise SlurmError("the allocation has no nodes")
        self.nodes, self.srun_args = list(nodes), list(srun_args)

    @classmethod
    def from_env(cls, cfg: ExperimentConfig) -> "SlurmLauncher":
        nodes = allocation_nodes()
        if len(nodes) < cfg.cluster.n_nodes:
            raise SlurmError(
                f"cluster.n_nodes={cfg.cluster.n_nodes} but the allocation has {len(nodes)} node(s): {', '.join(nodes)}"
            )
        return cls(nodes, cfg.cluster.slurm.srun_args)

    def start(self, name: str, cmd: list[str], env: dict, log_path: Path, node: int = 0) -> Launched:
        if not 0 <= node < len(self.nodes):
            raise SlurmError(f"worker {name} is placed on node {node}, but the allocation has {len(self.nodes)}")
        return LocalProcess(popen_logged(srun_command(self.nodes[node], name, cmd, self.srun_args), env, log_path))


def render_sbatch(
    cfg: ExperimentConfig,
    config_path: str | Path,
    run_dir: str | Path,
    overrides: list[str],
    python: str = sys.executable,
    workdir: str | Path | None = None,
) -> str:
    """The batch script that runs this fleet in one allocation (see the module docstring)."""
    s = cfg.cluster.slurm
    run_dir = Path(run_dir).resolve()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={_safe(cfg.experiment_name)}",
        f"#SBATCH --nodes={cfg.cluster.n_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={run_dir}/logs/slurm-%j.out",
    ]
    if s.cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={s.cpus_per_node}")
    if cfg.cluster.device == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={cfg.cluster.n_gpus_per_node}")
    for flag, value in (("partition", s.partition), ("account", s.account), ("time", s.time_limit)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [f"#SBATCH {a}" for a in s.sbatch_args]
    cmd = [
        python,
        "-m",
        "areal_async.cli",
        "run",
        str(Path(config_path).resolve()),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *overrides,
        "cluster.launcher=slurm",
    ]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path(workdir or os.getcwd()).resolve()))}",
        "# the supervisor: every worker becomes an srun step of this allocation",
        "exec " + " ".join(shlex.quote(c) for c in cmd),
        "",
    ]
    return "\n".join(lines)


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT`` -> the job id."""
    if shutil.which("sbatch") is None:
        raise SlurmError(f"sbatch is not on PATH: submit {script} on a Slurm login node (sbatch {script})")
    return _run(["sbatch", "--parsable", str(script)]).strip().split(";")[0]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "areal-async"


def _run(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{' '.join(cmd)}: {e}") from None
    if p.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def with_allocation_hosts(cfg: ExperimentConfig, nodes: list[str]) -> ExperimentConfig:
    """A multi-node run without ``cluster.node_hosts``: the allocation's nodes' addresses, node k the
    allocation's k-th node (so each worker binds and advertises its own node's address)."""
    cl = cfg.cluster
    if cl.n_nodes == 1 or cl.node_hosts:
        return cfg
    try:
        hosts = [socket.gethostbyname(n) for n in nodes[: cl.n_nodes]]
    except OSError as e:
        raise SlurmError(f"cannot resolve the allocation's nodes {nodes[: cl.n_nodes]}: {e}") from None
    try:
        return dataclasses.replace(cfg, cluster=dataclasses.replace(cl, node_hosts=hosts))
    except ValueError as e:  # ConfigError: e.g. ipc control across nodes
        raise SlurmError(f"cluster.n_nodes={cl.n_nodes} in this allocation: {e}") from None


def run_slurm(
    cfg: ExperimentConfig,
    config_path: str | Path,
    run_dir: str | Path,
    overrides: list[str],
    progress: Optional[bool],
) -> int:
    """Inside an allocation: the supervisor with srun steps (``fleet.run_fleet`` with a ``SlurmLauncher``).
    Outside: write RUN_DIR/sbatch.sh and submit it (or say how, with cluster.slurm.submit=false)."""
    try:
        if inside_allocation():
            launcher = SlurmLauncher.from_env(cfg)
            return run_fleet(with_allocation_hosts(cfg, launcher.nodes), run_dir, progress, launcher)
        run_dir = Path(run_dir)
        private_dir(run_dir)  # 0700, as the local launcher makes it
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        script = run_dir / "sbatch.sh"
        script.write_text(render_sbatch(cfg, config_path, run_dir, overrides))
        if not cfg.cluster.slurm.submit:
            print(f"[areal-async] wrote {script}; submit it with: sbatch {script}")
            return 0
        job = submit(script)
        print(
            f"[areal-async] submitted {script} as Slurm job {job}; logs in {run_dir.resolve()}/logs "
            f"(slurm-{job}.out: the supervisor)"
        )
        return 0
    except SlurmError as e:
        print(f"areal-async: {e}", file=sys.stderr)
        return 2
