"""A bring-your-own reward worker for tests/e2e/test_external_worker.py that answers its first N groups
with the example score and then holds every later group unanswered (its heartbeats go on), so the
fleet cannot finish on it, however fast the machine: the test then kills it and a second worker
must take over the groups it held.

    python tests/support/byo_reward_stall.py RUN_DIR WORKER_ID N_GROUPS
"""

import asyncio
import sys

from areal_async.base.process import setup_worker_logging
from areal_async.client.reward import RewardWorker
from workers.external_reward import score

if __name__ == "__main__":
    run_dir, worker_id, n_groups = sys.argv[1], sys.argv[2], int(sys.argv[3])
    setup_worker_logging(worker_id)
    worker = RewardWorker(run_dir, score, worker_id=worker_id)
    answered: set = set()
    hold = asyncio.Event()  # never set

    async def stalling(completion: str, solutions: list[str]) -> float:
        task = asyncio.current_task()  # one task answers one group (RewardWorker._answer)
        if task not in answered and len(answered) >= n_groups:
            await hold.wait()
        answered.add(task)
        return score(completion, solutions)

    worker.score = stalling
    sys.exit(worker.run())
