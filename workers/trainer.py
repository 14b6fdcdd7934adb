"""Entry point of the trainer worker process (started by the supervisor); see workers/_main.py.

python -m workers.trainer --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]
"""

import sys

from areal_async.app.workers.worker import run_worker
from workers._main import worker_args


def main(argv=None) -> int:
    a = worker_args("trainer", argv)
    from areal_async.app.workers.trainer_worker import build_trainer  # after pinning: see workers/_main.py

    return run_worker(a.worker_id, lambda: build_trainer(a.run_dir, a.worker_id, a.index))


if __name__ == "__main__":
    sys.exit(main())
