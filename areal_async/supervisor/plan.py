"""The fleet's plan, from the config alone: which processes, with which command, on which devices,
and which of them may be restarted. Pure: nothing here starts a process or writes a file, so every
launcher (``fleet.py`` with the local, Slurm and Ray launchers; ``ray_launcher.py`` to size its
bundles) and the preflight read the same plan.

- ``worker_specs``: every worker process in start order (scheduler, reward, trainer ranks, rollout),
  and ``worker_command``: the ``python -m workers.<role> --run-dir ...`` line that starts one;
- ``device_placement`` / ``device_env``: each process's devices (``placement.py``), refused with a
  ``LaunchError`` before anything starts when the cluster or this machine cannot hold them;
- ``check_placement``: pinned CPUs (``cluster.cpu_affinity``) this machine allows;
- the restart rules: ``RESTARTABLE`` roles, ``restart_blocker`` (a config that allows none) and
  ``why_no_restart`` (one dead worker); the recovery budget, ``recovery_verdict``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import NamedTuple, Optional

from areal_async.base.affinity import check_available
from areal_async.config import ExperimentConfig
from areal_async.supervisor.placement import (
    PlacementError,
    Slot,
    check_gpus_present,
    local_gpu_count,
    place,
    shape_of,
    trainer_names,
)
from areal_async.supervisor.servers import SERVER_ROLES

RESTARTABLE = ("rollout", "reward", *SERVER_ROLES)  # the trainer resumes from a checkpoint instead (recover.mode)


class LaunchError(RuntimeError):
    """The run cannot start as asked (the run dir holds another run or no checkpoint; CPUs not available)."""


class WorkerSpec(NamedTuple):
    wid: str  # worker id: "scheduler", "reward-0", "trainer" / "trainer-1", "rollout-0"
    module: str  # "workers.<role>", run with python -m
    index: int  # its index among the workers of its role (the trainer's rank)

    @property
    def role(self) -> str:
        return self.module.rsplit(".", 1)[-1]


def worker_specs(cfg: ExperimentConfig) -> list[WorkerSpec]:
    """Every worker process, in start order."""
    specs = [WorkerSpec("scheduler", "workers.scheduler", 0)]
    specs += [WorkerSpec(f"reward-{i}", "workers.reward", i) for i in range(cfg.cluster.n_reward_workers)]
    specs += [WorkerSpec(w, "workers.trainer", r) for r, w in enumerate(trainer_names(cfg.cluster.n_trainer_ranks))]
    specs += [WorkerSpec(f"rollout-{i}", "workers.rollout", i) for i in range(cfg.cluster.n_rollout_workers)]
    return specs


def worker_command(cfg: ExperimentConfig, run_dir: Path, spec: WorkerSpec) -> list[str]:
    """The command line of one worker process (pinned to ``cluster.cpu_affinity.<role>`` when set)."""
    cmd = [sys.executable, "-m", spec.module, "--run-dir", str(run_dir), "--worker-id", spec.wid]
    cmd += ["--index", str(spec.index)]
    if cpus := getattr(cfg.cluster.cpu_affinity, spec.role):
        cmd += ["--cpus", cpus]
    return cmd


def check_placement(cfg: ExperimentConfig) -> None:
    """LaunchError (before anything starts) if a pinned role names CPUs this machine does not allow."""
    for role, spec in dataclasses.asdict(cfg.cluster.cpu_affinity).items():
        if spec:
            try:
                check_available(spec, f"cluster.cpu_affinity.{role}")
            except ValueError as e:
                raise LaunchError(str(e)) from None


def device_placement(
    cfg: ExperimentConfig, gpus_here: Optional[int] = None, environ: Optional[dict] = None
) -> dict[str, Slot]:
    """Every process's devices (supervisor/placement.py), mapped through this process's
    CUDA_VISIBLE_DEVICES; LaunchError before anything starts when the cluster or this machine (node 0,
    the local launcher's) has fewer GPUs than asked or the layout is one NCCL or the servers refuse."""
    try:
        placement = place(shape_of(cfg, environ))
        if cfg.cluster.device == "cuda":
            check_gpus_present(placement, 0, local_gpu_count(environ) if gpus_here is None else gpus_here)
    except PlacementError as e:
        raise LaunchError(str(e)) from None
    return placement


def device_env(cfg: ExperimentConfig, slot: Optional[Slot]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES / LOCAL_RANK of a process on GPU runs; nothing on CPU runs."""
    return slot.env() if slot is not None and cfg.cluster.device == "cuda" else {}


def restart_blocker(cfg: ExperimentConfig) -> Optional[str]:
    """Why a dead worker of this config cannot be restarted, or None."""
    if cfg.cluster.max_restarts == 0:
        return "cluster.max_restarts=0"
    fixed = sorted({cfg.tensor_channel.trajectories, cfg.tensor_channel.weights} - {"zmq", "shm"})
    if fixed:
        return f"tensor channel(s) {', '.join(fixed)} form a fixed process group that a new process cannot join"
    return None


def why_no_restart(cfg: ExperimentConfig, role: str, restarts: int, run_ended: bool) -> Optional[str]:
    """Why a dead process of ``role`` (restarted ``restarts`` times) is not restarted, or None if it is.
    (A worker that failed to build, BUILD_FAILED_EXIT_CODE, is never restarted: the fleet reads why in its log.)"""
    if role not in RESTARTABLE:
        return f"a {role} worker is never restarted"
    if run_ended:
        return "the run had ended"
    if role not in SERVER_ROLES and (blocker := restart_blocker(cfg)):
        return blocker
    if restarts >= cfg.cluster.max_restarts:
        return f"{restarts} restart(s) used"
    return None


def recovery_verdict(in_a_row: int, recoveries: int, retries: int, build_failed: bool) -> tuple[bool, str]:
    """(recover?, what the supervisor says it does) after a failure, with ``in_a_row`` recoveries so far
    without a newer complete checkpoint, ``recoveries`` in all and ``recover.retries`` allowed in a row.
    A worker that failed to build is never recovered: the same build fails again."""
    if build_failed:
        return False, "the run failed at once"
    if in_a_row < retries:
        return True, (
            f"recovering the run ({in_a_row + 1}/{retries} in a row, {recoveries + 1} in all) "
            "from the newest complete checkpoint"
        )
    why = f" ({in_a_row} recoveries in a row without a newer checkpoint)" if retries else ""
    return False, "the run failed" + why
