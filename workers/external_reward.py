"""An external reward worker: joins a running fleet over the wire protocol and scores its groups.

    python -m workers.external_reward RUN_DIR [--slot 0] [--worker-id ID]

Start the fleet with a slot for it (``cluster.n_external_reward_workers=1``; with
``cluster.n_reward_workers=0`` it scores everything). Score: 1 if the last \\boxed{...} of the
completion equals a solution as a number, else 0.
"""

import argparse
import re
import sys

from areal_async.base.process import setup_worker_logging
from areal_async.client.reward import RewardWorker

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def score(completion: str, solutions: list[str]) -> float:
    found = BOXED.findall(completion)
    try:
        return float(bool(found) and any(float(found[-1]) == float(s) for s in solutions))
    except ValueError:  # not a number: wrong
        return 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="workers.external_reward")
    p.add_argument("run_dir")
    p.add_argument("--slot", type=int, default=0)
    p.add_argument("--worker-id", default=None)
    a = p.parse_args(argv)
    setup_worker_logging(a.worker_id or "external-reward")
    return RewardWorker(a.run_dir, score, slot=a.slot, worker_id=a.worker_id).run()


if __name__ == "__main__":
    sys.exit(main())
