"""What every worker builder reads first: the run directory's config and endpoints, the supervisor's
clock, and its control link to the scheduler.

Every builder reads ``RUN_DIR/config.yaml`` and ``RUN_DIR/endpoints.json`` (written by the
supervisor) and returns an object whose ``run()`` coroutine is the worker's life.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq.asyncio

from areal_async.base.control import ControlClient
from areal_async.base.endpoints import NODE_HOST_ENV
from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import install_run_keys, launch_token
from areal_async.config import ExperimentConfig, load_config
from protocols.sockets import use_source_host


def load_run(run_dir: str | Path) -> tuple[ExperimentConfig, RunManifest]:
    """The run's config and endpoints; from here on this process's ``tcp://`` sockets use the run's keys."""
    cfg = load_config(Path(run_dir) / "config.yaml")
    if cfg.cluster.curve:
        install_run_keys(run_dir)
    use_source_host(os.environ.get(NODE_HOST_ENV))  # a worker of node k connects from node k's address
    return cfg, RunManifest.load(run_dir)


def control_client(
    ctx: zmq.asyncio.Context, cfg: ExperimentConfig, ep: RunManifest, role: str, worker_id: str
) -> ControlClient:
    return ControlClient(ctx, ep.control, role, worker_id, cfg.cluster.heartbeat_s, token=launch_token())


def supervisor_t0() -> float:
    return float(os.environ.get("AREAL_T0", time.time()))
