"""Entry point of the reward worker process (started by the supervisor).

    python -m workers.reward --run-dir RUN_DIR --worker-id ID --index I
"""

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="workers.reward")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--worker-id", default="reward")
    p.add_argument("--index", type=int, default=0)
    args = p.parse_args(argv)
    from areal_async.runtime.entry import run_worker  # heavy imports after parsing

    return run_worker("reward", args.run_dir, args.worker_id, args.index)


if __name__ == "__main__":
    sys.exit(main())
