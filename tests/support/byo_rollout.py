"""A bring-your-own rollout worker process for tests/e2e/test_external_worker.py: the embedded engine,
built by the test's own code, behind areal_async.client.rollout.RolloutWorker."""

import sys
import time
from pathlib import Path

from areal_async.app.workers.rollout_worker import torch_engine
from areal_async.base.process import setup_worker_logging
from areal_async.client import load_run
from areal_async.client.rollout import RolloutWorker
from areal_async.models.policy_tokenizer import policy_tokenizer

if __name__ == "__main__":
    run_dir, worker_id = sys.argv[1], sys.argv[2]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir).parent / "byo-imported").touch()  # the test starts the fleet now
    while not (Path(run_dir) / "endpoints.json").exists():  # started before the fleet: the imports are done by now
        time.sleep(0.1)
    setup_worker_logging(worker_id)
    cfg, _ = load_run(run_dir)
    tok = policy_tokenizer(cfg.model)
    engine = torch_engine(cfg, tok, index=7, run_dir=run_dir)
    sys.exit(RolloutWorker(run_dir, engine, lambda ids: tok.decode(ids, skip_special_tokens=True), worker_id).run())
