"""Entry point of the reward worker process (started by the supervisor); see workers/_main.py.

    python -m workers.reward --run-dir RUN_DIR --worker-id ID --index I [--cpus LIST]
"""

import sys

from workers._main import worker_main


def main(argv=None) -> int:
    return worker_main("reward", argv)


if __name__ == "__main__":
    sys.exit(main())
