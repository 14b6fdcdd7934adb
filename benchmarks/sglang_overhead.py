"""Generation speed of the torch engine embedded vs behind the SGLang-compatible CPU server.

    python -m benchmarks.sglang_overhead --json out.json [--rounds 3] [--groups 32] [--quick]

Both sides run the same ``TorchEngine`` with the same weights on the tiny task's prompts
(``configs/tiny_arith.yaml``: groups of ``gconfig.n_samples`` samples, ``gconfig.max_new_tokens``
tokens each, all groups at once as a rollout worker holds them). Embedded: the engine in this
process. Server: ``python -m areal_async.rollout.servers.sglang_server`` in its own process, driven by
``RemoteEngine`` + ``SGLangClient`` over HTTP (one request per sample), weights pushed over a
gloo group. The ratio embedded / server is the cost of the HTTP hop (JSON, one request and one
server thread per sample, the client's request threads). Also measured: one weight update
(embedded ``update_weights`` vs pause + gloo broadcast + ``/model_info`` check + resume).

Each JSON row: metric, value, unit, backend, rounds, groups, n_samples, max_new_tokens.
Timings on a shared machine vary; the rows carry the median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from areal_async.config import load_config
from areal_async.data.prompts import load_problems, prompt_encoder
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.remote import RemoteEngine
from areal_async.rollout.clients.sglang_client import SGLangClient
from areal_async.rollout.engines.torch_engine import TorchEngine
from protocols.sockets import free_tcp_port

from benchmarks.common import Col, print_table, write_rows

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_arith.yaml"


def requests(cfg, tok, groups: int, tag: str) -> list[GenRequest]:
    enc = prompt_encoder(tok, cfg.train_dataset.template)
    problems = load_problems(cfg.train_dataset, cfg.seed)
    g = cfg.gconfig
    return [
        GenRequest(
            f"{tag}-{i}",
            enc(problems[i % len(problems)].prompt),
            g.n_samples,
            g.max_new_tokens,
            temperature=g.temperature,
        )
        for i in range(groups)
    ]


def generate(engine, reqs: list[GenRequest]) -> tuple[int, float]:
    """(tokens generated, seconds) for every request added at once and run to the end."""
    t = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    tokens = 0
    while engine.has_work():
        for g in engine.step():
            tokens += sum(len(s.output_ids) for s in g.samples())
    return tokens, time.perf_counter() - t


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(rounds: int, groups: int) -> list[dict]:
    cfg = load_config(CONFIG)
    tok = load_tokenizer(cfg.model.path)
    model = build_model(cfg.model, len(tok), cfg.seed)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = cfg.rollout.max_batch_groups * cfg.gconfig.n_samples  # rows per batch: the same on both sides
    embedded = TorchEngine(model, tok, seed=1, max_batch_groups=batch // cfg.gconfig.n_samples)
    port = free_tcp_port("127.0.0.1")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.rollout.servers.sglang_server",
            "--config",
            str(CONFIG),
            "--port",
            str(port),
            "--max-running-requests",
            str(batch),
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
    )
    try:
        remote = RemoteEngine(
            [SGLangClient(f"http://127.0.0.1:{port}", name="bench")], max_in_flight=groups * cfg.gconfig.n_samples
        )
        remote.update_weights(0, sd)  # group set-up outside the timed rounds
        out = {"embedded": [], "server": []}
        upd = {"embedded": [], "server": []}
        for r in range(rounds + 1):  # round 0 warms both up and is dropped
            for name, eng in (("embedded", embedded), ("server", remote)):
                tokens, secs = generate(eng, requests(cfg, tok, groups, f"{name}{r}"))
                dt = timed(lambda e=eng, v=r + 1: e.update_weights(v, sd))
                if r:
                    out[name].append(tokens / secs)
                    upd[name].append(dt)
        remote.close()
    finally:
        server.kill()
        server.wait()
    return rows(out, upd, rounds, groups, cfg)


def rows(out: dict, upd: dict, rounds: int, groups: int, cfg) -> list[dict]:
    common = {
        "rounds": rounds,
        "groups": groups,
        "n_samples": cfg.gconfig.n_samples,
        "max_new_tokens": cfg.gconfig.max_new_tokens,
    }
    med = {k: statistics.median(v) for k, v in out.items()}
    res = [{"metric": "tokens_per_s", "value": med[k], "unit": "tokens/s", "backend": k, **common} for k in med]
    res.append(
        {
            "metric": "embedded_over_server",
            "value": med["embedded"] / med["server"],
            "unit": "ratio",
            "backend": "both",
            **common,
        }
    )
    res += [
        {"metric": "weight_update_s", "value": statistics.median(v), "unit": "s", "backend": k, **common}
        for k, v in upd.items()
    ]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--groups", type=int, default=32, help="prompt groups per round (tiny preset: batch_size 32)")
    p.add_argument("--quick", action="store_true", help="1 round of 8 groups")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds, groups = (1, 8) if args.quick else (args.rounds, args.groups)
    res = measure(rounds, groups)
    print_table(
        res,
        [
            Col("metric", 22, lambda r: r["metric"], left=True),
            Col("backend", 9, lambda r: r["backend"]),
            Col("value", 12, lambda r: r["value"], ".3f"),
            Col("unit", 9, lambda r: r["unit"]),
        ],
    )
    if args.json:
        write_rows(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
