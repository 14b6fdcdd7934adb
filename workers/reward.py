"""Entry point of the reward worker process (started by the supervisor); see workers/_main.py.

python -m workers.reward --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]
"""

import sys

from areal_async.app.workers.worker import run_worker
from workers._main import worker_args


def main(argv=None) -> int:
    a = worker_args("reward", argv)
    from areal_async.app.workers.reward_worker import build_reward  # after pinning: see workers/_main.py

    return run_worker(a.worker_id, lambda: build_reward(a.run_dir, a.worker_id, a.index))


if __name__ == "__main__":
    sys.exit(main())
