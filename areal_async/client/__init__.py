"""Bring-your-own workers: join a running fleet over its wire protocol from your own process.

(``reward`` imports no torch; ``rollout`` does: import the one you need.)

A worker finds the fleet the way the built-in ones do: from the run directory
(``RUN_DIR/config.yaml`` and ``RUN_DIR/endpoints.json``, written by the supervisor before anyone
starts; being able to read them, and the 0600 keys in ``RUN_DIR/keys``, is the fleet's only
admission, for built-in workers too). It takes the run's CURVE keys (its ``tcp://`` sockets are
authenticated like the built-in ones), puts its worker id on the run's roster (``join``: an id the
supervisor launched cannot be taken), and registers on the scheduler's control socket with that
id and the token ``join`` returned, heart-beats, and
speaks the same typed msgpack messages (``protocols.messages``), validated the same way: a bad
frame is logged and dropped, and the scheduler refuses what a worker of that role may not send.

- ``areal_async.client.reward.RewardWorker(run_dir, score, slot=0)``: serves reward slot ``slot`` (one of the
  ``cluster.n_external_reward_workers`` endpoints the supervisor keeps free): every group of the
  ``RewardRequest`` (alone or in a ``Batch``) a rollout worker sends it is scored with ``score(completion, solutions)``
  (a plain or async function returning a float in [0, 1]) and one ``RewardResult`` per group
  goes to the scheduler. A score that raises, or is not a finite number in [0, 1], counts as 0
  with status ``error`` and the reason in ``details``. ``run()`` blocks until the run's
  ``Shutdown``; ``arun()`` is the coroutine.
- ``areal_async.client.rollout.RolloutWorker(run_dir, engine, decode, worker_id)``: a rollout worker
  around your own ``RolloutEngine`` (the seam of ``areal_async.rollout.engines.engine``, e.g. a wrapper of an
  existing generator) behind the built-in rollout service: it gets generate requests and weights
  like the built-in workers. Its tensor channels are the run's (``tensor_channel.*``: zmq or shm;
  a gloo/NCCL group has no seat for it).

If a bring-your-own worker dies, the scheduler declares it lost (no heartbeat for
``cluster.worker_timeout_s``, or at once when a worker registers again under the same id) and
re-issues what it held, as for a built-in worker; the supervisor does not restart it.
"""

from __future__ import annotations

from pathlib import Path

import zmq.asyncio

from areal_async.base.control import ControlClient
from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import add_external_worker, install_run_keys
from areal_async.config import ExperimentConfig, load_config


def load_run(run_dir: str | Path) -> tuple[ExperimentConfig, RunManifest]:
    """The fleet's config and endpoints, as every worker reads them (``FileNotFoundError`` names the file)."""
    run_dir = Path(run_dir)
    for name in ("config.yaml", "endpoints.json"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} does not exist: is a fleet running in {run_dir}?")
    cfg = load_config(run_dir / "config.yaml")
    if cfg.cluster.curve:
        install_run_keys(run_dir)
    return cfg, RunManifest.load(run_dir)


def join(run_dir: str | Path, role: str, worker_id: str) -> str:
    """Put ``worker_id`` (as a ``role`` worker) on the fleet's roster; returns the token to register with.
    ``ValueError`` when the id belongs to a worker the supervisor launched, or to another role."""
    return add_external_worker(run_dir, worker_id, role)


def connect(
    ctx: zmq.asyncio.Context, cfg: ExperimentConfig, ep: RunManifest, role: str, worker_id: str, token: str = ""
) -> ControlClient:
    """A control link to the fleet's scheduler (``register()`` it, then ``recv()`` / ``send()``);
    ``token`` from ``join``."""
    return ControlClient(ctx, ep.control, role, worker_id, cfg.cluster.heartbeat_s, token=token)
