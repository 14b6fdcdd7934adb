"""The run directory, written before any process of a fleet starts (and again for each recovery).

``write_run_dir`` refuses a directory that holds another run (``resume_point``), makes it private
(0700: checkpoints in it are unpickled on resume, ``base/private.py``) and writes, in this order:
``config.yaml`` (the resolved config), ``keys/`` (every worker's CURVE keys and launch token, and
the inference servers' key: before the endpoints, so whoever finds the endpoints finds the keys) and
last ``endpoints.json`` (the ``RunManifest``, ``base/manifest.py``: where every peer listens, the
servers, the resume point, the recovery count), which every worker reads. It returns the manifest
with the launch tokens and the servers' key: what the fleet starts its processes with.

Also here: ``pids.json`` (every started pid and the placement) and ``remove_run_files`` (the run's
socket directory and any shared-memory segment a killed worker left behind).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from areal_async.base.endpoints import NODE_HOST_ENV, plan_endpoints
from areal_async.base.manifest import RunManifest
from areal_async.base.private import private_dir
from areal_async.base.runkeys import TOKEN_ENV, write_run_keys, write_server_key
from areal_async.config import ExperimentConfig, to_yaml
from areal_async.rollout.clients.server_auth import API_KEY_ENV
from areal_async.supervisor.placement import Slot
from areal_async.supervisor.plan import LaunchError, worker_specs
from areal_async.supervisor.servers import plan_server_addresses, server_key_env
from areal_async.trainer.persist.checkpoint_dirs import checkpoint_to_resume

NodeAddress = Callable[[str], Optional[str]]  # the launcher's address for a worker's node, when it places it


@dataclass(frozen=True)
class Nodes:
    """Which address each process binds and advertises: the launcher's when it places workers itself
    (a multi-node Ray or Slurm run), else ``cluster.node_hosts`` by the placement (node 0 by default)."""

    cfg: ExperimentConfig
    placement: dict[str, Slot]
    node_address: NodeAddress

    def host(self, wid: Optional[str]) -> str:
        if wid and (addr := self.node_address(wid)):
            return addr
        slot = self.placement.get(wid) if wid else None
        return self.cfg.cluster.hosts()[slot.node if slot is not None else 0]

    def hosts(self) -> dict[str, str]:
        """Worker id -> the address of its node, for every placed worker."""
        return {wid: self.host(wid) for wid in self.placement}

    def env(self, wid: str) -> dict[str, str]:
        """With cluster.node_hosts (or a launcher that places): the worker's node address, to bind from."""
        placed = self.cfg.cluster.node_hosts or self.node_address(wid)
        return {NODE_HOST_ENV: self.host(wid)} if placed else {}


@dataclass(frozen=True)
class RunDir:
    """What ``write_run_dir`` wrote that the fleet starts its processes with."""

    manifest: RunManifest
    tokens: dict[str, str]  # worker id -> its launch token (the same for its restarts)
    server_env: dict[str, str]  # the servers' per-fleet key: their environment and the rollout workers'

    def token_env(self, wid: str) -> dict[str, str]:
        return {TOKEN_ENV: self.tokens[wid]} if wid in self.tokens else {}

    @property
    def server_key(self) -> str:
        return self.server_env.get(API_KEY_ENV, "")


def resume_point(cfg: ExperimentConfig, run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint to resume from, per recover.mode; refuses to mix runs."""
    books = run_dir / "metrics.jsonl"
    if cfg.recover.mode == "disabled" and books.exists() and books.stat().st_size > 0:
        raise LaunchError(
            f"{run_dir} already holds a run (metrics.jsonl); use a new --run-dir or recover.mode=auto to continue it"
        )
    try:
        return checkpoint_to_resume(run_dir / "checkpoints", cfg.recover.mode)
    except ValueError as e:
        raise LaunchError(str(e)) from None


def write_run_dir(cfg: ExperimentConfig, run_dir: Path, nodes: Nodes, recoveries: int) -> RunDir:
    """Write config.yaml, keys/ and endpoints.json for a fleet about to start (see the module docstring)."""
    resume = resume_point(cfg, run_dir)
    private_dir(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    cl = cfg.cluster  # built-in reward workers bind the first endpoints, bring-your-own ones the rest
    n_reward = cl.n_reward_workers + cl.n_external_reward_workers
    planned = plan_endpoints(n_reward, nodes.host(None), cl.control, nodes.hosts())
    manifest = dataclasses.replace(
        planned, servers=plan_server_addresses(cfg), resume_from=str(resume) if resume else None, recoveries=recoveries
    )
    tokens = write_run_keys(run_dir, {s.wid: s.role for s in worker_specs(cfg)})
    server_env = server_key_env(cfg)
    if server_env:
        write_server_key(run_dir, server_env[API_KEY_ENV])
    manifest.save(run_dir)
    if resume:
        print(f"[areal-async] resuming from {resume}")
    return RunDir(manifest, tokens, server_env)


def write_pids(run_dir: Path, pids: dict[str, int], placement: dict[str, Slot]) -> None:
    """``pids.json``: every process the supervisor started, itself, and the placement."""
    record: dict = pids | {"supervisor": os.getpid()}
    record["placement"] = {name: slot.as_dict() for name, slot in placement.items()}
    tmp = run_dir / "pids.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(run_dir / "pids.json")


def remove_run_files(manifest: RunManifest) -> None:
    """The run's socket directory and any shared-memory segment a killed worker left behind."""
    if manifest.sock_dir:
        shutil.rmtree(manifest.sock_dir, ignore_errors=True)
    run_id = manifest.run_id
    for seg in Path("/dev/shm").glob(f"areal_{run_id}_*") if run_id else []:
        seg.unlink(missing_ok=True)
