"""Entry point of the rollout worker process (started by the supervisor); see workers/_main.py.

    python -m workers.rollout --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]
"""

import sys

from workers._main import worker_main


def main(argv=None) -> int:
    return worker_main("rollout", argv)


if __name__ == "__main__":
    sys.exit(main())
