"""An error no restart can fix is never retried: a worker whose build fails on an import, a config
value or a missing file exits BUILD_FAILED_EXIT_CODE with the reason as its last log line, and the
supervisor stops the run at once (no restart, no in-run recovery) and says why. Real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_async.base.process import BUILD_FAILED_EXIT_CODE, BUILD_FAILED_MARK
from areal_async.config import load_config
from areal_async.supervisor.fleet import Supervisor
from areal_async.supervisor.report import server_config_error

ROOT = Path(__file__).resolve().parents[3]
WORKER = (
    "from areal_async.app.workers.worker import run_worker\ndef build():\n    raise {exc}\nrun_worker('w', build)\n"
)


@pytest.mark.parametrize(
    "exc, code",
    [
        ("ValueError('reward.fn: no such module')", BUILD_FAILED_EXIT_CODE),
        ("FileNotFoundError('/data/x.jsonl')", BUILD_FAILED_EXIT_CODE),
        ("ModuleNotFoundError('nomodule')", BUILD_FAILED_EXIT_CODE),
        ("ConnectionRefusedError('scheduler not up yet')", 70),  # may pass on a retry: restartable as before
    ],
)
def test_a_build_error_exits_with_its_own_code_and_says_why_last(exc, code):
    proc = subprocess.run(
        [sys.executable, "-c", WORKER.format(exc=exc)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == code, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    if code == BUILD_FAILED_EXIT_CODE:
        assert last.endswith(BUILD_FAILED_MARK + exc.replace("('", ": ").replace("')", "")), last
    else:
        assert BUILD_FAILED_MARK not in proc.stderr


def test_the_supervisor_neither_restarts_nor_recovers_a_worker_that_failed_to_build(tmp_path, capsys):
    """reward.fn names a module that does not exist (the preflight would refuse it; here the fleet is
    started directly): with restarts and a recovery allowed, the reward worker still runs only once
    and the run fails at once with the worker's one-line reason."""
    cfg = load_config(
        ROOT / "configs/tiny_arith.yaml",
        ["reward.fn=nomodule:f", "cluster.max_restarts=2", "recover.retries=1", "cluster.n_rollout_workers=1"],
    )
    sup = Supervisor(cfg, tmp_path / "run", progress=False)
    t = time.monotonic()
    try:
        sup.prepare()
        sup.start_all()
        code = sup.watch(poll_s=0.1)
    finally:
        sup.stop_all()
        sup.cleanup()
    took = time.monotonic() - t
    reward = next(c for c in sup.children if c.name == "reward-0")
    assert code == 1 and reward.proc.returncode == BUILD_FAILED_EXIT_CODE
    assert (reward.restarts, sup.restarts_total, sup.recoveries) == (0, 0, 0)
    err = capsys.readouterr().err
    assert "restarting it" not in err and "recovering the run" not in err
    assert (
        "worker reward-0" in err
        and "the run failed at once (no restart: it failed to build (ValueError: plug-in 'nomodule:f': cannot import "
        "module 'nomodule'"
        in err
        and "which no restart can fix" in err
    ), err
    assert took < 90, took  # the fleet's start on a busy machine; no restart delay is added


def test_a_vllm_servers_refused_configuration_is_read_from_its_log(tmp_path):
    """A real vLLM 0.32.0 server's log (tests/support/data/vllm-0.32.0/SOURCE.md) of the issue's failure: vLLM
    refused --max-model-len 32768 on a model of 8192 positions with a pydantic ValidationError. That is a
    configuration error no restart fixes; the log of a server that died otherwise (killed, crashed mid-run) is not."""
    log = ROOT / "tests/support/data/vllm-0.32.0/max_model_len_refused.log"
    assert server_config_error(log) == (
        "it refused its configuration at start (Value error, User-specified max_model_len (32768) is greater than "
        "the derived max_model_len (max_position_embeddings=8192.0 or model_max_length=None in model's config.json).)"
        ", which no restart can fix"
    )
    crashed = tmp_path / "crashed.log"
    lines = log.read_text().splitlines()
    crashed.write_text("\n".join(lines[:30] + ["RuntimeError: EngineCore encountered an issue.", "Killed"]) + "\n")
    assert server_config_error(crashed) is None
    argparse = tmp_path / "argparse.log"
    argparse.write_text("usage: api_server.py [-h] ...\napi_server.py: error: argument --dtype: invalid choice: 'f8'\n")
    served = tmp_path / "served.log"  # a request's validation error logged long before the server was killed
    served.write_text("\n".join(lines[40:] + ["INFO: 127.0.0.1 POST /v1/completions 200 OK"] * 5 + ["Killed"]) + "\n")
    assert server_config_error(served) is None
    assert server_config_error(argparse) == (
        "it refused its configuration at start (api_server.py: error: argument --dtype: invalid choice: 'f8'), "
        "which no restart can fix"
    )
