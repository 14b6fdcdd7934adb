"""Entry point of the scheduler worker process (started by the supervisor); see workers/_main.py.

    python -m workers.scheduler --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]
"""

import sys

from workers._main import worker_main


def main(argv=None) -> int:
    return worker_main("scheduler", argv)


if __name__ == "__main__":
    sys.exit(main())
