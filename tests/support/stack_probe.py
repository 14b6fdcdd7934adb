"""A worker stand-in for the hang capture: registers its stack dump as every worker does
(``workers/_main.py``), says so in RUN_DIR/ready, then sleeps in ``wait_here`` until killed.

    python -m tests.support.stack_probe RUN_DIR WORKER_ID
"""

import sys
import time
from pathlib import Path

from areal_async.base.stacks import register_stack_dump


def wait_here() -> None:
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    register_stack_dump(sys.argv[1], sys.argv[2])
    (Path(sys.argv[1]) / "ready").write_text("1")
    wait_here()
