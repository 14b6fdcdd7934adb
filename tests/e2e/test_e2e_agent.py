"""End-to-end: an agent written only against ``openai.AsyncOpenAI`` trains in a fleet (agent_calculator.yaml).

One short fleet (3 steps): the books are exact (``verify``), every trained sample's episode is found in the
rollout workers' agent traces, and turn by turn its prompt and completion ids, versions and behaviour
log-probs equal what the trainer recorded that it trained (``rollout.dump_tensors``); no drift (the
completions agent's next prompt continues the previous one's text, so the endpoint reads back the sampled ids)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from areal_async.api import run_command
from areal_async.app.commands.verify import verify_run
from tests.support.agent_checks import match, trained_samples

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_an_openai_client_agent_trains_with_exact_tokens(tmp_path):
    run_dir = tmp_path / "run"
    fast = ["total_train_steps=3", "sft_warmup.steps=40", "train_dataset.batch_size=4", "gconfig.n_samples=4",
            "cluster.heartbeat_s=0.5", "rollout.dump_tensors=true"]  # fmt: skip
    out = subprocess.run(
        run_command(ROOT / "configs/agent_calculator.yaml", run_dir, fast),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rep = verify_run(run_dir)
    assert rep.ok, "\n".join(rep.lines(20))
    assert rep.counts["trained"] == rep.counts["booked_trained"] == 3 * 4 * 4
    samples = trained_samples(run_dir)
    found = match(run_dir)
    assert len(samples) == 48 and len(found) == 48  # every trained sample's episode, turn by turn
    for _, trace, rows in found:
        assert trace["drifts"] == []
        for r in rows:
            assert r["completion_ids"] == r["trained_ids"] and r["mask_all_1"] and r["versions_equal"]
            assert r["logprob_max_abs_diff"] < 1e-5  # float32 on the wire, 6 decimals in the trace
    trajs = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    turns = {t["id"]: t.get("turns", 1) for t in trajs if t["status"] == "trained"}
    assert all(turns[sid] == len(rows) for sid, _, rows in found)  # the books count the agent's requests
    logs = (run_dir / "logs").glob("rollout-*.log")
    assert sum("OpenAI-compatible endpoint on http://127.0.0.1:" in p.read_text() for p in logs) == 2
