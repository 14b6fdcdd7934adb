"""Entry point of the scheduler worker process (started by the supervisor); see workers/_main.py.

python -m workers.scheduler --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]
"""

import sys

from areal_async.app.workers.worker import run_worker
from workers._main import worker_args


def main(argv=None) -> int:
    a = worker_args("scheduler", argv)
    from areal_async.app.workers.scheduler_worker import build_scheduler  # after pinning: see workers/_main.py

    return run_worker(a.worker_id, lambda: build_scheduler(a.run_dir))


if __name__ == "__main__":
    sys.exit(main())
