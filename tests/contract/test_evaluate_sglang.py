"""``areal-async eval`` with rollout.backend=sglang against the project's SGLang-compatible CPU server (a real
process over HTTP): the evaluator speaks the server's API (moved from tests/unit/app/test_evaluate.py: it starts a
server, so it is a contract test, not a unit test)."""

import json
import subprocess
import sys
from pathlib import Path

from areal_async.app.workers.evaluate import run_eval
from areal_async.config import from_dict
from areal_async.models.tiny import build_model, save_policy
from areal_async.models.tokenizer import build_char_tokenizer
from protocols.sockets import free_tcp_port
from tests.support.sglang_fixtures import stop

ROOT = Path(__file__).resolve().parents[2]


def test_eval_through_an_sglang_server_serving_the_model(tmp_path):
    """rollout.backend=sglang: eval attaches to a running server (the project's SGLang-compatible CPU
    server, a real process over HTTP) that serves --model; k samples per problem come back scored."""
    cfg_args = [
        "evaluator.n_samples=3",
        "evaluator.greedy=false",
        "evaluator.max_problems=4",
        "gconfig.max_new_tokens=6",
        "reward.n_procs=1",
        "rollout.backend=sglang",
        "cluster.device=cpu",
        "cluster.n_rollout_workers=1",
    ]
    tok = build_char_tokenizer()
    base = from_dict({}, cfg_args)
    save_policy(build_model(base.model, len(tok), seed=7), tok, tmp_path / "model")
    port = free_tcp_port("127.0.0.1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.rollout.servers.sglang_server",
            "--model-path",
            str(tmp_path / "model"),
            "--port",
            str(port),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        cfg = from_dict({}, cfg_args + [f"sglang.addresses=[{url}]"])
        assert run_eval(cfg, str(tmp_path / "model"), None, tmp_path / "ev") == 0
    finally:
        stop(proc)
    rows = [json.loads(line) for line in (tmp_path / "ev" / "eval.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "ev" / "eval_summary.json").read_text())
    assert len(rows) == 4 and all(len(r["completions"]) == len(r["scores"]) == 3 for r in rows)
    assert summary["backend"] == "sglang" and summary["k"] == 3 and 0 <= summary["pass1"] <= 1
    no_servers = from_dict({}, cfg_args)
    assert run_eval(no_servers, str(tmp_path / "model"), None, tmp_path / "ev2") == 2  # names sglang.addresses
