"""``SGLangClient``: one SGLang server (or the CPU twin, ``servers/sglang_server.py``) behind ``ServerClient``.

The HTTP contract, as read from sglang 0.5.23 (``api/v1/api_types.py``, ``srt/managers/io_struct.py``,
``srt/entrypoints/http_server.py``); ``tests/contract/test_sglang_contract.py`` checks every body built
here against the pinned release's own schema::

    POST /generate {rid, input_ids, sampling_params{max_new_tokens, temperature, top_p,
                    stop_token_ids}, return_logprob: true}
         -> output_ids, meta_info.output_token_logprobs [[logprob, token_id, text]],
            meta_info.finish_reason {"type": stop|length|abort}, meta_info.weight_version(s)
    POST /pause_generation {mode}  ->  weights  ->  POST /continue_generation {}

Weights (``weight_sync="distributed"``): this process is rank 0 of a group with the server
(``weight_group.init_custom_group``; the server joins through ``POST /init_weights_update_group``
with ``rank_offset`` 1 and world size ``1 + tp_size``, ``tp_size`` read from ``GET /server_info``;
a group name unique per worker, process, server and epoch). ``/begin_weight_update`` opens a
session (0.5.23 refuses a distributed update outside one, see ``sglang_rules.py``), then per
bucket ``POST /update_weights_from_distributed`` (names, dtypes, shapes, ``load_format:
"flattened_bucket"``, ``flush_cache`` false under ``in_place``, whose running batch 0.5.23 will not
flush; ``weight_version`` on the last bucket only, so the server's version moves once the whole set
is in) runs on a helper thread while this thread broadcasts the bucket; ``/end_weight_update``
closes the session, on failure too (a session left open refuses every later begin). Afterwards
``GET /model_info`` must report the new ``weight_version``, or the update counts as failed. Any
failure tears the group down (a new epoch's group is built next time) and raises ``ServerDown``;
the server is left paused (``RemoteEngine`` never resumes a server whose update failed).
``weight_update_session=False`` is for SGLang releases that predate the session endpoints (404).

The group's backend (``group_backend``): NCCL refuses two ranks of one communicator on one GPU
(``init.cc`` "Duplicate GPU detected"), and the placement puts a rollout worker on its servers'
GPUs, so on CUDA the group is ``gloo`` (``supervisor/placement.py`` ``server_group_backend``): the
sender broadcasts a CPU bucket, SGLang receives into a CUDA tensor (gloo handles CUDA tensors);
``nccl`` only when the sender's GPU is none of the server's.

``weight_sync="disk"``: the state dict is written as ``model.safetensors`` under ``disk_dir`` and
loaded with ``POST /update_weights_from_disk``; the simple fallback, no group needed.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from protocols.ports import free_tcp_port

from areal_async.config.experiment import LORA_KEEPS_ADAPTER
from areal_async.models.lora import LoraSpec, save_adapter
from areal_async.rollout.clients import sglang_lora as L
from areal_async.rollout.clients import sglang_rules as R
from areal_async.rollout.clients import weight_group as W
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.http_json import HTTPStatusError
from areal_async.rollout.clients.http_client import HTTPServerClient
from areal_async.rollout.clients.remote import Completion, ServerDown, UpdateRefused
from areal_async.rollout.clients.weights_file import save_state_file

log = logging.getLogger("areal_async.rollout.sglang")

PAUSE_MODES = ("abort", "retract", "in_place")
WEIGHT_SYNCS = ("distributed", "disk")
FINISH_TYPES = ("stop", "length", "abort")
_EPOCHS = itertools.count()
_ABANDONED: list = []  # groups whose last broadcast the server never joined: kept, not destroyed (see _broadcast)


class SGLangClient(HTTPServerClient):
    def __init__(
        self,
        address: str,
        *,
        name: str,
        pause_mode: str = "abort",
        weight_sync: str = "distributed",
        group_backend: str = "gloo",
        group_host: str = "127.0.0.1",
        bucket_mb: float = 64.0,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 60.0,
        update_timeout_s: float = 300.0,
        weight_update_session: bool = True,
        disk_dir: Optional[str] = None,
        lora: Optional[LoraSpec] = None,
        lora_base: Optional[str] = None,
    ):
        """``lora``, ``lora_base``: a LoRA run's adapter spec and its base model directory (``sglang_lora.py``:
        the base loaded from disk once, then each version's adapter through /load_lora_adapter; needs
        ``disk_dir`` for the adapter directories)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r}: expected one of {PAUSE_MODES}")
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync={weight_sync!r}: expected one of {WEIGHT_SYNCS}")
        if lora is not None and pause_mode != "abort":
            raise ValueError(f"pause_mode={pause_mode!r} with LoRA: expected 'abort' ({LORA_KEEPS_ADAPTER})")
        if (weight_sync == "disk" or lora) and not disk_dir:
            raise ValueError("weight_sync='disk' and LoRA need disk_dir (a directory both sides can read)")
        self.address = address.rstrip("/")
        self.name, self.pause_mode, self.weight_sync = name, pause_mode, weight_sync
        self.group_backend, self.group_host = group_backend, group_host
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.request_timeout_s, self.control_timeout_s = request_timeout_s, control_timeout_s
        self.update_timeout_s, self.session = update_timeout_s, weight_update_session
        self.disk_dir = disk_dir
        self.lora, self.lora_base = lora, lora_base
        self.adapter: Optional[str] = None  # the loaded adapter's name; every /generate names it
        self.group = None
        self.group_name = ""
        self._packed: Optional[torch.Tensor] = None  # the bucket buffer (_bucket_buffer), kept across versions

    # ---- generation ----------------------------------------------------------------------
    def generate_body(self, rid: str, input_ids: list[int], max_new_tokens: int, req: GenRequest) -> dict:
        """The /generate body: only keys SGLang's SamplingParams accepts (it answers 400 to others)."""
        sp: dict = {"max_new_tokens": int(max_new_tokens)}
        if req.greedy:
            sp["temperature"] = 0.0
        else:
            sp["temperature"], sp["top_p"] = float(req.temperature), float(req.top_p)
        if req.stop_token_ids:
            sp["stop_token_ids"] = [int(t) for t in req.stop_token_ids]
        body = {"rid": rid, "input_ids": [int(t) for t in input_ids], "sampling_params": sp, "return_logprob": True}
        return body | ({"lora_path": self.adapter} if self.adapter else {})

    def generate(self, rid: str, input_ids: list[int], max_new_tokens: int, req: GenRequest) -> Completion:
        body = self.generate_body(rid, input_ids, max_new_tokens, req)
        return parse_generate(self._call("POST", "/generate", body, self.request_timeout_s), rid)

    def pause(self) -> None:
        self._call("POST", "/pause_generation", {"mode": self.pause_mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", {})

    def abort_all(self) -> None:
        self._call("POST", "/abort_request", {"abort_all": True})

    def abort(self, rid: str) -> None:
        """SGLang's ``/abort_request {rid}`` (io_struct.py ``AbortReq``): the request ends "abort" now."""
        self._call("POST", "/abort_request", {"rid": rid})

    # ---- weights -------------------------------------------------------------------------
    def reset(self) -> None:
        self._drop_group()

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        try:
            if self.lora is not None:
                self._load_adapter(version, state_dict)
            elif self.weight_sync == "disk":
                self._load_from_disk(version, state_dict)
            else:
                self._load_distributed(version, state_dict)
            self._check_version(version)
        except ServerDown:
            self._drop_group()
            raise
        except (HTTPStatusError, ValueError) as e:  # the server's answer refused it: drop the group
            self._drop_group()
            raise UpdateRefused(f"{self.address}: weight update to v{version} refused: {e}") from None
        except RuntimeError as e:  # broken mid-way: drop the group
            self._drop_group()
            raise ServerDown(f"{self.address}: weight update to v{version} failed: {e}") from None

    def _check_version(self, version: int) -> None:
        got = self._call("GET", "/model_info").get("weight_version")
        if got != str(version):
            raise ServerDown(f"{self.address} reports weight_version {got!r} after loading v{version}")

    def _load_distributed(self, version: int, sd: dict[str, torch.Tensor]) -> None:

        if self.group is None:
            self._init_group()
        buckets = W.flattened_buckets(sd, self.bucket_bytes)
        if self.session:
            self._begin_session()
        try:
            for i, b in enumerate(buckets):
                body = self.update_body(b, str(version) if i == len(buckets) - 1 else None)
                flat = b.flat(self._bucket_buffer(b.nbytes))
                post = (self._call, "POST", "/update_weights_from_distributed", body, self.update_timeout_s)
                with _Background(*post) as req:
                    self._broadcast(flat, req)
                req.result()
        except BaseException:
            self._packed = None  # a broadcast left pending in an abandoned group may still read it: never reused
            if self.session:
                self._end_quietly()
            raise
        if self.session:
            self._call("POST", "/end_weight_update", {})

    def _begin_session(self) -> None:
        """Open the update's session. One found open was left by this server's previous owner (a worker that died
        mid-update; a server has one owner, ``remote.servers_of``): 0.5.23 refuses every begin until it is ended
        (``BEGIN_TWICE``), so it is ended here and the begin asked again. A server without the route (404: an
        SGLang release before the sessions, 0.5.20 and older) cannot be updated by this client: ``ServerTooOld``,
        which ends the worker with the reason instead of marking the server down forever."""
        try:
            self._call("POST", "/begin_weight_update", {})
        except HTTPStatusError as e:
            if e.status == 404:
                raise ServerTooOld(
                    f"{self.address} has no /begin_weight_update (404): SGLang before 0.5.21 has no weight-update "
                    "session; upgrade it (the gpu extra pins sglang>=0.5.21) or set sglang.weight_update_session=false"
                ) from None
            if e.status != R.BAD_REQUEST or R.BEGIN_TWICE not in _message(e.body):
                raise
            log.warning(
                "%s: a weight-update session was left open (a previous owner died mid-update); ending it", self.address
            )
            self._call("POST", "/end_weight_update", {})
            self._call("POST", "/begin_weight_update", {})

    def _bucket_buffer(self, nbytes: int) -> torch.Tensor:
        """One buffer, as large as the largest bucket yet, that every bucket of every version is packed into: a
        bucket's broadcast has ended (``_broadcast`` waits for it) before the next one is packed. It lives where the
        group broadcasts from (``group_device``: the host for gloo, this process's GPU for NCCL), whatever device
        the received weights are on: ``Bucket.flat`` copies each tensor across."""
        if self._packed is None or self._packed.numel() < nbytes:
            self._packed = torch.empty(nbytes, dtype=torch.uint8, device=group_device(self.group_backend))
        return self._packed

    def _broadcast(self, flat: torch.Tensor, req: "_Background") -> None:
        """Broadcast one bucket while the server's HTTP call runs; a server that answers without joining (a
        refusal: 0.5.23 checks the session before the broadcast) ends the wait at once instead of after the
        group's timeout. The unjoined group is set aside, never destroyed (its pending op could block that)."""
        import torch.distributed as dist

        work = dist.broadcast(flat, src=0, group=self.group, async_op=True)
        deadline = time.monotonic() + self.update_timeout_s
        while not work.is_completed():
            if req.failed():
                _ABANDONED.append(self.group)
                self.group = None
                req.result()  # raises the server's answer
            if time.monotonic() > deadline:
                raise ServerDown(f"{self.address}: bucket broadcast not joined in {self.update_timeout_s:.0f} s")
            time.sleep(0.002)
        work.wait()

    def _end_quietly(self) -> None:
        """Close the session of a failed update (the update's own error is the one raised)."""
        try:
            self._call("POST", "/end_weight_update", {}, self.control_timeout_s)
        except (ServerDown, HTTPStatusError, RuntimeError) as e:
            log.warning("%s: /end_weight_update after a failed update: %s", self.address, e)

    def update_body(self, b: W.Bucket, weight_version: Optional[str]) -> dict:
        body = {
            "names": b.names,
            "dtypes": b.dtypes,
            "shapes": b.shapes,
            "group_name": self.group_name,
            "flush_cache": R.flush_after_update(self.pause_mode),
            "load_format": "flattened_bucket",
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return body

    def init_body(self, port: int, world_size: int) -> dict:
        return {
            "master_address": self.group_host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": self.group_name,
            "backend": self.group_backend,
        }

    def _init_group(self) -> None:
        """Rank 0 waits in the rendezvous on a helper thread while the server is asked to join: a
        server that refuses or cannot be reached fails this at once (the helper times out alone)."""
        world = R.group_world_size(self._call("GET", "/server_info"))
        port = free_tcp_port(self.group_host)
        # new for each group (a restarted worker's too); the random part keeps a blind joiner of the store off
        # the group's keys (weight_group.bound_store): the name travels only in the key-authenticated request
        self.group_name = f"areal-{self.name}-{os.getpid()}-{next(_EPOCHS)}-{secrets.token_hex(16)}"
        with _Background(
            W.init_custom_group,
            self.group_backend,
            self.group_host,
            port,
            0,
            world,
            self.group_name,
            self.update_timeout_s,
        ) as rank0:
            self._call("POST", "/init_weights_update_group", self.init_body(port, world), self.update_timeout_s)
        try:
            self.group = rank0.result()
        except Exception as e:  # the rendezvous failed although the server said it joined
            raise ServerDown(f"{self.address}: weight group {self.group_name} not formed: {e}") from None

    def _drop_group(self) -> None:
        if self.group is not None:
            W.destroy_group(self.group)
            self.group = None

    def _load_from_disk(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        d = Path(self.disk_dir) / f"v{version}"
        if not (d / "model.safetensors").exists():
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / "model.safetensors.tmp"
            save_state_file(sd, tmp)
            tmp.replace(d / "model.safetensors")
        self._call(
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(d), "weight_version": str(version), "flush_cache": True},
            self.update_timeout_s,
        )

    def _load_adapter(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        """A LoRA run's update (``sglang_lora.py``): the base once, then this version's adapter by name."""
        if self.adapter is None:
            body = {"model_path": str(self.lora_base), "weight_version": str(version), "flush_cache": True}
            self._call("POST", "/update_weights_from_disk", body, self.update_timeout_s)
        path = save_adapter(Path(self.disk_dir) / f"lora-v{version}", sd, self.lora, str(self.lora_base))
        name, old = f"v{version}", self.adapter
        out = self._call("POST", "/load_lora_adapter", L.load_body(name, path), self.update_timeout_s)
        if not out.get("success"):
            raise ValueError(f"/load_lora_adapter {name}: {out.get('error_message')}")
        self.adapter = name
        self._call("POST", "/update_weight_version", L.version_body(version))
        if old is not None and old != name:
            self._call("POST", "/unload_lora_adapter", {"lora_name": old})


class ServerTooOld(Exception):
    """The server lacks a route this client needs; not a ``ServerDown`` (reviving it cannot help)."""


def _message(body) -> str:
    return str(body.get("message", "")) if isinstance(body, dict) else str(body)


def group_device(backend: str) -> torch.device:
    """Where a weight group's broadcast reads its buffer: gloo from host memory (SGLang's side receives into its
    CUDA tensor), NCCL from this process's current GPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Background:
    """Run one call on a helper thread for the duration of a ``with`` block (the HTTP side of a
    collective, while this thread does the collective); ``result()`` re-raises its error."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
        self.out, self.err = None, None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.out = self.fn(*self.args)
        except BaseException as e:  # handed to result()
            self.err = e

    def __enter__(self) -> "_Background":
        self.thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # the collective failed: the peer's call may now wait out its own timeout, so don't wait for it
        self.thread.join(timeout=5.0 if exc_type is not None else None)

    def failed(self) -> bool:
        """The call has returned with an error (the thread is done)."""
        return self.err is not None and not self.thread.is_alive()

    def result(self):
        if self.err is not None:
            raise self.err
        return self.out


def parse_generate(resp: dict, rid: str) -> Completion:
    """output_ids, logprobs, per-token versions and finish reason of one /generate answer."""
    if not isinstance(resp, dict) or not isinstance(resp.get("meta_info"), dict):
        raise ValueError(f"/generate answer for {rid!r} has no meta_info: {str(resp)[:200]}")
    meta = resp["meta_info"]
    ids = resp.get("output_ids")
    triples = meta.get("output_token_logprobs") or []
    if not isinstance(ids, list) or len(triples) != len(ids):
        raise ValueError(f"/generate answer for {rid!r}: {len(triples)} logprobs for output_ids {ids!r}")
    if [int(t[1]) for t in triples] != ids:
        raise ValueError(f"/generate answer for {rid!r}: logprob token ids differ from output_ids")
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in FINISH_TYPES:
        raise ValueError(
            f"/generate answer for {rid!r}: finish_reason {meta.get('finish_reason')!r}, "
            f"expected a type in {FINISH_TYPES}"
        )
    return Completion(list(ids), [float(t[0]) for t in triples], token_versions(meta, len(ids)), reason)


def token_versions(meta: dict, n: int) -> list[int]:
    """Per-token versions from ``weight_versions`` spans (sglang >= 0.5.2x), else ``weight_version``.
    SGLang's "default" (weights the trainer never sent) maps to -1."""
    spans = meta.get("weight_versions") or []
    out = []
    for sp in spans:
        out += [_version(sp["version"])] * (int(sp["end"]) - int(sp["start"]))
    if len(out) != n:
        out = [_version(meta.get("weight_version"))] * n
    return out


def _version(label) -> int:
    if label in (None, "default"):
        return -1
    try:
        return int(label)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version {label!r}: expected the integer version this client sent") from None
