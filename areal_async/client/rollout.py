"""A bring-your-own rollout worker (see ``areal_async.client``): your engine behind the rollout service."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import zmq.asyncio

from protocols.sockets import run_async

from areal_async.client import connect, join, load_run
from areal_async.rollout.engines.engine import RolloutEngine
from areal_async.rollout.record import RolloutRecord
from areal_async.rollout.service import RolloutService, message_bytes
from areal_async.transport import make_tensor_channel, make_weight_channel

__all__ = ["RolloutWorker"]


class RolloutWorker:
    """An external rollout worker: your ``RolloutEngine`` behind the built-in rollout service."""

    def __init__(
        self,
        run_dir: str | Path,
        engine: RolloutEngine,
        decode: Callable[[list[int]], str],
        worker_id: str,
        max_active_groups: int = 8,
    ):
        cfg, ep = load_run(run_dir)
        blocked = sorted({cfg.tensor_channel.trajectories, cfg.tensor_channel.weights} - {"zmq", "shm"})
        if blocked:
            raise ValueError(
                f"tensor_channel {', '.join(blocked)}: a fixed process group has no seat for a "
                "bring-your-own rollout worker; use zmq or shm"
            )
        self.ctx = ctx = zmq.asyncio.Context()
        shm = {"run_id": ep.run_id}
        traj = make_tensor_channel(
            cfg.tensor_channel.trajectories,
            role="sender",
            endpoint=ep.trajectories,
            **(shm if cfg.tensor_channel.trajectories == "shm" else {}),
        )
        weights = make_weight_channel(
            cfg.tensor_channel.weights,
            role="receiver",
            delta=cfg.tensor_channel.weight_delta,
            **(shm if cfg.tensor_channel.weights == "shm" else {}),
        )
        token = join(run_dir, "rollout", worker_id)
        self.service = RolloutService(
            worker_id,
            connect(ctx, cfg, ep, "rollout", worker_id, token=token),
            ctx,
            engine,
            lambda batch: [decode(ids) for ids in batch],
            traj,
            weights,
            ep.rewards,
            max_active_groups,
            message_bytes=message_bytes(cfg.tensor_channel.max_message_mb),
            record=RolloutRecord(run_dir, worker_id),
        )

    def run(self) -> int:
        """Serve until the run ends (0) or this worker fails (1); its sockets are closed on return."""
        return run_async(self.arun())

    async def arun(self) -> int:
        try:
            return await self.service.run()
        finally:
            self.close()

    def close(self) -> None:
        """Close the control socket and the context made for it (idempotent). Left to the garbage
        collector, the context could hang the process at exit: a collection that finds the
        context and its sockets unreachable runs ``Context.__del__`` -> ``term()`` after the
        sockets' weak references are cleared but before their finalizers close them, and
        ``zmq_ctx_term`` waits for open sockets forever (seen: py-spy, main thread in
        ``zmq_ctx_term`` under ``gc_collect_main``, from an atexit handler of torch's)."""
        if not self.ctx.closed:
            self.service.control.close()
            self.ctx.destroy(linger=0)
