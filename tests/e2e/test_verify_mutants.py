"""``areal-async verify`` on a real fleet with a bug injected in each role: every bug is named, and nothing else.

One tiny fleet runs with ``tests/support/mutants/sitecustomize.py`` first on every process's path: the
scheduler drops one sample's line from its books, the trainer trains one sample twice and another with a
token cut off, the reward worker sends one group's scores rotated by one after recording them, a rollout
engine stamps one group one version above what it loaded. Each bug logs the ids it hurt (``applied.jsonl``,
written by the bug itself, not by verify); the test holds verify's report against that log: each bug named
with its kind and ids, and every problem verify reports explained by one of them. The run's reward is
``length_parity`` (mixed scores from an untrained policy; the reward worker scores it as any plug-in).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from areal_async.app.commands.verify import verify_run
from tests.support.fleet import ROOT, cli, finish_ok

pytestmark = pytest.mark.slow

MUTANTS = ROOT / "tests" / "support" / "mutants"
KIND = {  # the problem verify must report for each bug, naming each id it hurt
    "dropped": "lost",
    "duplicated": "trained_twice",
    "truncated": "token_count",
    "misaligned": "score_mismatch",
    "mislabeled": "version_unloaded",
}


def test_verify_names_each_bug_injected_into_a_real_fleet(tmp_path):
    log = tmp_path / "mutants"
    log.mkdir()
    env = dict(os.environ, AREAL_MUTANTS=str(log), PYTHONPATH=os.pathsep.join([str(MUTANTS), str(ROOT)]))
    cmd = cli(tmp_path / "run", "reward.fn=tests.support.reward_fixtures:length_parity")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    finish_ok(proc)
    bugs = [json.loads(x) for x in (log / "applied.jsonl").read_text().splitlines()]
    assert sorted(b["mutation"] for b in bugs) == sorted(KIND), bugs  # each injected once
    rep = verify_run(tmp_path / "run")
    for b in bugs:
        named = [
            str(p)
            for p in rep.problems
            if p.kind == KIND[b["mutation"]] and any(repr(i) in p.message for i in b["ids"])
        ]
        print(f"{b['mutation']} ({b['role']}, ids {b['ids']}, step {b['step']}):", *named, sep="\n  ")
        for sid in b["ids"]:
            assert any(repr(sid) in line for line in named), (b, rep.lines())
    print(f"verify: {rep.summary()}")
    assert not [str(p) for p in rep.problems if not _explained(p, bugs)], rep.lines()


def _explained(p, bugs: list[dict]) -> bool:
    """A problem names an id a bug hurt, the step a duplicate was added to, or the count a dropped line left."""
    if any(repr(i) in p.message for b in bugs for i in b["ids"]):
        return True
    dup = next(b for b in bugs if b["mutation"] == "duplicated")
    return (p.kind == "step_count" and p.message.startswith(f"step {dup['step']}:")) or (
        p.kind == "lost" and p.message == "summary.json: samples_lost = 1 (issued minus lines written)"
    )
