"""Entry point of the rollout worker process (started by the supervisor); see workers/_main.py.

python -m workers.rollout --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]
"""

import sys

from areal_async.app.workers.worker import run_worker
from workers._main import worker_args


def main(argv=None) -> int:
    a = worker_args("rollout", argv)
    from areal_async.app.workers.rollout_worker import build_rollout  # after pinning: see workers/_main.py

    return run_worker(a.worker_id, lambda: build_rollout(a.run_dir, a.worker_id, a.index))


if __name__ == "__main__":
    sys.exit(main())
