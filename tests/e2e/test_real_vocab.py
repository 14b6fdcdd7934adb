"""A fleet at a real vocabulary: configs/real_shape.yaml (151,936 embedding rows, the local BPE, the R1
template, math-verify on \\boxed{} answers, the chunked head) narrowed to a width and length that fit a
CI minute. The full shape is measured by hand (its step takes minutes on 2 cores): docs and the note."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_async.app.commands.verify import verify_run

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NARROW = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.num_hidden_layers=1",
    "gconfig.max_new_tokens=48",
    "actor.logits_chunk_tokens=64",  # a micro-batch of ~2 x 4 x 100 tokens goes through the chunked head
    "total_train_steps=2",
]


def test_a_real_vocabulary_fleet_keeps_exact_books_and_reports_peak_rss(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "areal_async.cli", "run", str(ROOT / "configs/real_shape.yaml")]
    proc = subprocess.run(
        [*cmd, "--run-dir", str(run_dir), "--no-progress", *NARROW],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    trajs = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert summary["samples_lost"] == 0 and summary["steps"] == 2
    ids = [t["id"] for t in trajs]
    assert len(ids) == len(set(ids)) == summary["samples_issued"]
    trained = [t for t in trajs if t["status"] == "trained"]
    assert len(trained) == 2 * 2 * 4 and all(t["reward"] in (0.0, 1.0) for t in trained)
    rep = verify_run(run_dir)
    assert rep.ok, "\n".join(rep.lines(20))
    # the embedding alone is 151,936 x 64 float32 = 37 MiB; the trainer holds it with grads and Adam (x4)
    rss = summary["peak_rss_mb"]
    assert set(rss) == {"scheduler", "reward-0", "rollout-0", "trainer"}
    assert rss["trainer"] > 4 * 37 and all(v > 30 for v in rss.values())
