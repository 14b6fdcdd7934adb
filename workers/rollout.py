"""Entry point of the rollout worker process (started by the supervisor).

    python -m workers.rollout --run-dir RUN_DIR --worker-id ID --index I
"""

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="workers.rollout")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--worker-id", default="rollout")
    p.add_argument("--index", type=int, default=0)
    args = p.parse_args(argv)
    from areal_async.runtime.entry import run_worker  # heavy imports after parsing

    return run_worker("rollout", args.run_dir, args.worker_id, args.index)


if __name__ == "__main__":
    sys.exit(main())
