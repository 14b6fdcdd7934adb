"""One short real fleet on the reasoning-gym mixture preset (configs/gym_mix.yaml): scheduler, trainer, two
rollout workers and a reward worker whose pool runs reasoning-gym's scorers, started by the real CLI.

The per-task columns are checked against the run's other books: the tasks' samples add up to the step's
trained samples, their rewards average (weighted by samples) to the step's reward_mean, which the
scheduler computes from the same records without knowing the tasks; and every scored sample went through
a scorer without error (trajectories.jsonl).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TASKS = ("chain_sum", "products", "spell_backward")


def test_the_mixture_preset_books_reward_per_task_per_step(tmp_path):
    pytest.importorskip("reasoning_gym")
    run_dir = tmp_path / "run"
    args = ["total_train_steps=4", "sft_warmup.steps=5", "train_dataset.batch_size=8", "reward.n_procs=1"]
    cmd = [sys.executable, "-m", "areal_async.cli", "run", "configs/gym_mix.yaml", "--run-dir", str(run_dir)]
    proc = subprocess.run([*cmd, "--no-progress", *args], capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kind" not in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for r in steps:
        n = [r[f"task/{t}/samples"] for t in TASKS]
        assert sum(n) == r["samples_trained"] == 8 * 4, r
        total = sum(r.get(f"task/{t}/reward_mean", 0.0) * k for t, k in zip(TASKS, n))
        assert total / sum(n) == pytest.approx(r["reward_mean"]), r
        assert r["task/chain_sum/level"] == 0 and "task/products/level" not in r
    last = steps[-1]
    assert sum(last[f"task/{t}/samples_total"] for t in TASKS) == last["samples_trained_total"]
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    scored = [t for t in trajs if t["reward"] is not None]
    assert scored and all(t["reward_status"] == "ok" for t in scored)
