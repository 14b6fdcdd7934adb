"""LoRA through SGLang's API: the launch flags, the client's request bodies, and the CPU twin's endpoints.

As read from sglang 0.5.23 (``tests/data/sglang-0.5.23``): ``srt/entrypoints/http_server.py`` routes
``POST /load_lora_adapter`` (line 1652, body ``LoadLoRAAdapterReqInput``), ``/unload_lora_adapter``
(line 1676, ``UnloadLoRAAdapterReqInput``) and ``/update_weight_version`` (line 1527,
``UpdateWeightVersionReqInput``); ``srt/managers/io_struct.py`` defines them (``LoadLoRAAdapterReqInput``
at line 2516: ``lora_name: str``, ``lora_path: str``, ``pinned: bool = False``, ``lora_id``) and their answer
``LoRAUpdateOutput`` (line 2572: ``success``, ``error_message``, ``loaded_adapters``; 400 when not
``success``); ``api/v1/api_types.py``'s ``GenerateRequest.lora_path`` names the adapter a request runs
with. The server must be launched with ``--enable-lora --max-lora-rank R --lora-target-modules ...``
(SGLang's LoRA serving docs; ``supervisor/servers.py`` ``sglang_lora_args``).

A LoRA run's weight update (``SGLangClient`` with ``lora``): the base once (``/update_weights_from_disk``
of the run's ``lora_base`` directory), then per version the adapter written as a PEFT directory,
``/load_lora_adapter`` under the name ``v<version>``, ``/update_weight_version`` (the tokens' version
label; the base weights did not change), ``/unload_lora_adapter`` of the previous one; every /generate
names the current adapter in ``lora_path``.

The CPU twin (``TwinLora``, mixed into ``CpuSGLangServer``) serves ONE adapter at a time, the last
loaded, merged into its weights (``models.lora.EngineAdapter``): a request must name it in
``lora_path`` (another name, or none while an adapter is served, is refused with 400; SGLang would
serve several adapters, and the base, in one batch); older names stay listed until unloaded; a full
weight update drops the adapter. Never run against a
real SGLang server here (no CPU build): the bodies are checked against the pinned schema
(``tests/test_sglang_contract.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from areal_async.models import lora
from areal_async.rollout.clients.sglang_rules import BadRequest

LOAD_FIELDS = ("lora_name", "lora_path", "pinned", "lora_id")  # io_struct.py LoadLoRAAdapterReqInput (line 2516)
UNLOAD_FIELDS = ("lora_name", "lora_id")  # UnloadLoRAAdapterReqInput (line 2535)
VERSION_FIELDS = ("new_version", "abort_all_requests")  # UpdateWeightVersionReqInput (line 2155)


def load_body(name: str, path: str | Path) -> dict:
    return {"lora_name": name, "lora_path": str(path)}


def version_body(version: int) -> dict:
    return {"new_version": str(version), "abort_all_requests": False}


def _fields(body: dict, allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(body) - set(allowed) - {"rid", "http_worker_ipc"})  # BaseReq's own fields
    if unknown or not isinstance(body.get(allowed[0]), str):
        raise BadRequest(f"{what}: fields {sorted(body)}; expected {list(allowed)} with {allowed[0]} a string")


def _answer(ok: bool, loaded: dict, error: Optional[str] = None) -> dict:
    return {"success": ok, "error_message": error, "loaded_adapters": dict(loaded)}


class TwinLora:
    """The CPU twin's LoRA endpoints (see the module docstring); ``lora_rank`` 0: started without LoRA."""

    lora_rank = 0
    lora_loaded: dict[str, str]
    lora_current: Optional[str] = None

    def load_lora(self, body: dict) -> dict:
        _fields(body, LOAD_FIELDS, "/load_lora_adapter")
        name, path = body["lora_name"], str(body.get("lora_path"))
        if not self.lora_rank:
            return _answer(False, {}, "LoRA is not enabled: launch the server with --enable-lora")
        try:
            sd, spec = lora.load_adapter(path)
        except (OSError, ValueError, KeyError) as e:
            return _answer(False, self.lora_loaded, f"adapter {name!r} at {path!r} does not load: {e}")
        if spec.rank > self.lora_rank:
            return _answer(False, self.lora_loaded, f"adapter rank {spec.rank} > --max-lora-rank {self.lora_rank}")
        with self.mu:
            if self.engine.adapter is None or self.engine.adapter.spec != spec:
                self.drop_lora()
                self.engine.adapter = lora.EngineAdapter(self.engine.model, spec, merged=True)
            try:
                self.engine.update_weights(self.engine.version, sd)  # running requests' KV recomputed
            except ValueError as e:
                return _answer(False, self.lora_loaded, str(e))
            self.lora_loaded[name], self.lora_current = path, name  # the one served; the others only listed
        return _answer(True, self.lora_loaded)

    def unload_lora(self, body: dict) -> dict:
        _fields(body, UNLOAD_FIELDS, "/unload_lora_adapter")
        name = body["lora_name"]
        if name not in self.lora_loaded:
            return _answer(False, self.lora_loaded, f"LoRA adapter {name!r} is not loaded")
        with self.mu:
            if name == self.lora_current:
                self.drop_lora()
            self.lora_loaded.pop(name, None)
        return _answer(True, self.lora_loaded)

    def update_weight_version(self, body: dict) -> dict:
        _fields(body, VERSION_FIELDS, "/update_weight_version")
        with self.mu:
            if body.get("abort_all_requests", True):
                self._deliver(self.engine.abort_all())
            self.labels.append(body["new_version"])
            self.engine.version = len(self.labels) - 1
            self.info_version = body["new_version"]
        return {"success": True, "message": f"weight version updated to {body['new_version']}"}

    def drop_lora(self) -> None:
        """Back to the base weights (the lock held): the merged adapter taken out, no adapter loaded."""
        adapter = self.engine.adapter
        if adapter is not None:
            adapter.load({k: torch.zeros(s) for k, s in adapter.shapes.items()})
        self.engine.adapter, self.lora_current = None, None

    def check_lora_path(self, body: dict) -> None:
        """A /generate must name the loaded adapter, and only it (the twin serves one at a time)."""
        asked = body.get("lora_path")
        if asked != self.lora_current:
            raise BadRequest(
                f"lora_path={asked!r}: the CPU server serves {self.lora_current!r} only "
                "(one adapter at a time, named in every request while it is loaded)"
            )
