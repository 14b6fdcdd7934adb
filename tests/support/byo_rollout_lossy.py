"""A bring-your-own rollout worker that dies the way a SIGKILL between its two sends makes one die:
the tensors of its first engine step's groups never leave the process (the sender drops them), their
``TrajectoryReady`` batch and reward requests do, and the process exits 9 two seconds later without a
word. The ids dropped are written to ``<run_dir>/../dropped.json`` first. For
tests/e2e/test_external_worker.py: the scheduler must learn from the trainer that those tensors
never came (HeldQuery), abort the groups and revise the plan that named them."""

import json
import os
import sys
import threading
import time
from pathlib import Path

from protocols.trajectories import TrajectoryBatch

from areal_async.app.workers.rollout_worker import torch_engine
from areal_async.base.process import setup_worker_logging
from areal_async.client import load_run
from areal_async.client.rollout import RolloutWorker
from areal_async.models.policy_tokenizer import policy_tokenizer

EXIT_AFTER_S = 2.0


class DropFirstMessage:
    """The rollout's trajectory channel, but its first message is dropped (and the process exits soon)."""

    def __init__(self, channel, record: Path):
        self.channel, self.record, self.dropped = channel, record, False

    def send(self, key, tensors, meta=None):
        if self.dropped:
            return self.channel.send(key, tensors, meta)
        self.dropped = True
        ids = [s.sample_id for s in TrajectoryBatch.decode(key, meta, tensors).samples()]
        self.record.write_text(json.dumps(ids))
        threading.Timer(EXIT_AFTER_S, os._exit, (9,)).start()

    def __getattr__(self, name):
        return getattr(self.channel, name)


if __name__ == "__main__":
    run_dir, worker_id = sys.argv[1], sys.argv[2]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir).parent / "byo-imported").touch()  # the test starts the fleet now
    while not (Path(run_dir) / "endpoints.json").exists():
        time.sleep(0.1)
    setup_worker_logging(worker_id)
    cfg, _ = load_run(run_dir)
    tok = policy_tokenizer(cfg.model)
    worker = RolloutWorker(
        run_dir, torch_engine(cfg, tok, index=7, run_dir=run_dir), lambda ids: tok.decode(ids), worker_id
    )
    worker.service.traj = DropFirstMessage(worker.service.traj, Path(run_dir).parent / "dropped.json")
    sys.exit(worker.run())
