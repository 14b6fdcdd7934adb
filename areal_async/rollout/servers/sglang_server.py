"""An SGLang-compatible HTTP server on CPU: SGLang's native endpoints over the embedded ``TorchEngine``.

SGLang 0.5.x has no CPU build on PyPI, so CI cannot start ``python -m sglang.launch_server``.
This server speaks the part of SGLang's HTTP contract the rollout backend uses (read from
sglang 0.5.23: ``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``api/v1/api_types.py``), and takes weight updates over a torch.distributed **gloo** group
exactly as SGLang takes them over NCCL::

    POST /generate                          input_ids, sampling_params, return_logprob, rid
         -> text, output_ids, meta_info{finish_reason{type}, output_token_logprobs
            [[logprob, token_id, text]], weight_version, weight_versions[{version,start,end}]}
    POST /pause_generation {mode}           abort | retract | in_place; /generate waits while paused
    POST /continue_generation
    POST /init_weights_update_group         joins the group (weight_group.init_custom_group)
    POST /update_weights_from_distributed   names, dtypes, shapes, group_name, weight_version,
                                            load_format ("flattened_bucket" or per tensor)
    POST /begin_weight_update, /end_weight_update, /destroy_weights_update_group
    POST /update_weights_from_disk          model_path (an HF directory with safetensors)
    POST /load_lora_adapter, /unload_lora_adapter, /update_weight_version   LoRA (``clients/sglang_lora.py``)
    GET  /health, /model_info, /server_info;  GET|POST /flush_cache;  POST /abort_request {rid | abort_all}

Refusals, with SGLang 0.5.23's own words and status (``clients/sglang_rules.py`` cites the lines): a
distributed update outside a ``/begin_weight_update`` ... ``/end_weight_update`` session (400,
before joining the broadcast, as the real one does), a second begin, an end without begin, a
flush while requests are in the running batch (``/flush_cache`` 400, and an update with
``flush_cache: true`` answers 400 after loading), a group whose world size is not
``rank_offset + tp_size`` (the real server would wait out its rendezvous timeout instead).

Pause modes, as SGLang defines them: ``abort`` returns every running request now with
finish_reason abort and the tokens it has (the client resubmits prompt + tokens); ``retract``
keeps the requests, and their KV cache is recomputed under the weights loaded meanwhile;
``in_place`` keeps the requests *and their KV cache*: tokens after ``continue`` attend to keys
computed by the old weights (SGLang's semantics; the client's default is ``abort``). Outside of
``in_place`` no KV entry computed under old weights is read after an update.

Weight versions are SGLang's strings ("default" until an update names one); every token records
the version that produced it and a response reports them as ``weight_versions`` spans.

Not covered: streaming, text prompts (``input_ids`` only), batched requests, ``n > 1``, top-k /
min-p / penalties / grammars, ``ignore_eos`` true (refused with 400 naming the key), a radix cache across requests
(``/flush_cache`` has nothing to flush), tensor/data parallelism, CUDA.

    python -m areal_async.rollout.servers.sglang_server --config RUN_DIR/config.yaml --port 30000
    python -m areal_async.rollout.servers.sglang_server --model-path HF_DIR --port 30000
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from areal_async.base.affinity import pin_self
from areal_async.base.parent import die_with_parent
from areal_async.base.process import BUILD_ERRORS, BUILD_FAILED_EXIT_CODE, BUILD_FAILED_MARK
from areal_async.config import load_config
from areal_async.models.context_limit import sglang_context, sglang_rule
from areal_async.models.tiny import build_model, load_model
from areal_async.models.policy_tokenizer import policy_tokenizer
from areal_async.models.tokenizer import load_tokenizer
from areal_async.rollout.clients import sglang_rules as R
from areal_async.rollout.servers.sglang_http import make_http_server
from areal_async.rollout.clients.sglang_lora import TwinLora
from areal_async.rollout.clients.sglang_rules import TP_SIZE, BadRequest, Unavailable
from areal_async.rollout.clients import weight_group as W
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.server_auth import server_key
from areal_async.rollout.engines.torch_engine import TorchEngine, _check_state_dict

log = logging.getLogger("areal_async.sglang_server")

DEFAULT_VERSION = "default"  # SGLang's weight_version before any update names one
# sampling_params keys SGLang knows (api_types.SamplingParams) that this server runs; the
# remaining SGLang keys are answered 400 "not supported", anything else 400 "unknown field".
SUPPORTED_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "stop_token_ids",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "sampling_seed",
}
PAUSE_MODES = ("abort", "retract", "in_place")


class _RequestsFirst(threading.Condition):
    """The server's lock (a ``threading.Condition``) with request threads ahead of the engine thread's next step.

    SGLang's scheduler takes every request that arrived (``/pause_generation``, ``/generate``, aborts, updates)
    before each batch it runs (``sglang/srt/managers/scheduler.py``, ``Scheduler.event_loop_normal``:
    ``recv_requests`` and ``process_input_requests``, then ``get_next_batch_to_run``). Python's lock is not fair:
    the engine thread let go of it after a decode step and took it back at once, so a request waited until the
    engine had nothing left to run: a pause never landed mid-generation (``abort`` and ``retract`` then never
    interrupted a sample) and new requests joined between waves only. ``waiting``: threads blocked entering;
    the engine thread waits while there are any, and each exit wakes it."""

    def __init__(self):
        super().__init__()
        self._count = threading.Lock()
        self.waiting = 0

    def __enter__(self):
        with self._count:
            self.waiting += 1
        try:
            return super().__enter__()
        finally:
            with self._count:
                self.waiting -= 1

    def __exit__(self, *exc):
        self.notify_all()
        return super().__exit__(*exc)


@dataclass
class _Waiter:
    rid: str
    prompt_len: int
    return_logprob: bool
    t0: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    result: Optional[dict] = None


class CpuSGLangServer(TwinLora):
    """The state behind the endpoints: one TorchEngine stepped by one thread, under one lock.
    ``lora_rank``: --max-lora-rank of a server launched with --enable-lora (``clients/sglang_lora.py``); 0 = off."""

    def __init__(
        self,
        engine: TorchEngine,
        decode,
        model_path: str = "",
        served_model_name: str = "areal-tiny",
        lora_rank: int = 0,
    ):
        self.engine, self.decode = engine, decode
        self.lora_rank, self.lora_loaded = lora_rank, {}
        self.model_path, self.served_model_name = model_path, served_model_name
        self.labels = [DEFAULT_VERSION]  # engine.version indexes this list
        self.engine.version = 0
        self.mu = _RequestsFirst()
        self.waiters: dict[str, _Waiter] = {}
        self.paused: Optional[str] = None  # the pause mode while paused
        self.broken: Optional[str] = None  # why the weights are unusable (a failed update)
        self.groups: dict[str, Any] = {}
        self.session = False  # a /begin_weight_update session is open
        self.info_version = DEFAULT_VERSION  # /model_info's: moves only on a successful update (tokenizer side)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.api_key = server_key()  # the run's key (AREAL_SERVER_API_KEY): sglang_http refuses requests without it

    # ---- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping.is_set():
            with self.mu:
                while not self.stopping.is_set() and (self.paused or self.mu.waiting or not self.engine.has_work()):
                    self.mu.wait(0.5)  # a request's exit wakes it
                if self.stopping.is_set():
                    return
                with torch.inference_mode():
                    self._deliver(self.engine.step())

    def _deliver(self, groups: list) -> None:
        """Answer the waiters of the finished groups (``TrajectoryBatch``, one sample each)."""
        for g in groups:
            w = self.waiters.pop(g.group_id, None)
            if w is not None:  # None: cancelled by /abort_request, already answered
                w.result = self._response(w, g.samples()[0])
                w.done.set()

    def _response(self, w: _Waiter, s) -> dict:
        ids, logps, versions = (_as_list(x) for x in (s.output_ids, s.logprobs, s.versions))
        n = len(ids)
        reason: dict = {"type": s.finish_reason}
        if s.finish_reason == "stop" and n:
            reason["matched"] = ids[-1]
        elif s.finish_reason == "length":
            reason["length"] = n
        elif s.finish_reason == "abort":
            reason["message"] = "Abort before or during generation (pause_generation or abort_request)."
        meta = {
            "id": w.rid,
            "prompt_tokens": w.prompt_len,
            "completion_tokens": n,
            "finish_reason": reason,
            "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - w.t0,
            "weight_version": self.labels[self.engine.version],
            "weight_versions": self._spans(versions),
        }
        if w.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, ids)]
        return {"text": self.decode(ids), "output_ids": ids, "meta_info": meta}

    def _spans(self, versions: list[int]) -> list[dict]:
        spans: list[dict] = []
        for i, v in enumerate(versions):
            label = self.labels[v] if v >= 0 else DEFAULT_VERSION
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": label, "start": i, "end": i + 1})
        return spans or [{"version": self.labels[self.engine.version], "start": 0, "end": 0}]

    # ---- /generate ---------------------------------------------------------------------
    def generate(self, body: dict, timeout_s: float = 3600.0) -> dict:
        req, w = self._parse_generate(body)
        with self.mu:
            self.check_lora_path(body)
            while self.paused and not self.stopping.is_set():  # SGLang holds new requests while paused
                self.mu.wait(0.5)
            if self.broken:
                raise Unavailable(f"weights unusable after a failed update ({self.broken}); update them again")
            if req.group_id in self.waiters:
                raise BadRequest(f"rid {req.group_id!r} is already generating")
            self.engine.add_request(req)
            self.waiters[req.group_id] = w
            self.mu.notify_all()
        if not w.done.wait(timeout_s):
            raise TimeoutError(f"rid {w.rid!r} did not finish in {timeout_s}s")
        return w.result

    def _parse_generate(self, body: dict) -> tuple[GenRequest, _Waiter]:
        ids = body.get("input_ids")
        if (
            body.get("text") is not None
            or not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise BadRequest(
                f"input_ids={ids!r}: this server takes one non-empty list of token ids (no text, no batch)"
            )
        if body.get("stream"):
            raise BadRequest("stream=true: this server answers whole responses only")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest(f"sampling_params={sp!r}: expected one object")
        for key in sp:
            if key not in SUPPORTED_SAMPLING:
                raise BadRequest(
                    f"sampling_params key {key!r} is not supported by the CPU server "
                    f"(supported: {sorted(SUPPORTED_SAMPLING)})"
                )
        if sp.get("ignore_eos"):  # SGLang runs past eos; the engine always stops there: refused, not ignored
            raise BadRequest("sampling_params.ignore_eos=true is not supported by the CPU server (it stops at eos)")
        if sp.get("n", 1) != 1:
            raise BadRequest(f"sampling_params.n={sp['n']!r}: the CPU server generates one sample per request")
        rid = body.get("rid") or f"req-{time.monotonic_ns()}"
        temp = float(sp.get("temperature", 1.0))
        stops = tuple(int(t) for t in sp.get("stop_token_ids") or ())
        req = GenRequest(
            group_id=str(rid),
            prompt_ids=list(ids),
            n=1,
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=temp if temp > 0 else 1.0,
            top_p=float(sp.get("top_p", 1.0)),
            greedy=temp == 0,
            stop_token_ids=stops,
        )
        try:
            req.validate()
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return req, _Waiter(str(rid), len(ids), bool(body.get("return_logprob")))

    # ---- pause / continue / abort ------------------------------------------------------
    def pause(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: expected one of {PAUSE_MODES}")
        with self.mu:
            self.paused = mode
            if mode == "abort":
                self._deliver(self.engine.abort_all())
            self.mu.notify_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict) -> dict:
        with self.mu:
            self.paused = None
            self.mu.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def abort_request(self, body: dict) -> None:
        with self.mu:
            if body.get("abort_all"):
                self._deliver(self.engine.abort_all())
                return
            rid = str(body.get("rid", ""))
            w = self.waiters.pop(rid, None)  # the caller is answered now
            self.engine.abort_groups([rid])  # and its compute stops (an unknown rid: nothing)
            if w is not None:
                w.result = self._response(w, _Aborted())
                w.done.set()

    # ---- weights -----------------------------------------------------------------------
    def init_group(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            return {"success": False, "message": f"backend={backend!r}: the CPU server joins 'gloo' groups only"}
        try:
            rank = int(body["rank_offset"])  # + tp_rank 0
            if int(body["world_size"]) != rank + TP_SIZE:
                raise ValueError(
                    f"world_size={body['world_size']} but this server's ranks are rank_offset + tp_rank = "
                    f"{rank}..{rank + TP_SIZE - 1} (tp_size={TP_SIZE}): the rendezvous would wait for absent ranks"
                )
            pg = W.init_custom_group(
                "gloo",
                body["master_address"],
                int(body["master_port"]),
                rank,
                int(body["world_size"]),
                name,
                timeout_s=float(body.get("timeout_s", 120)),
            )
        except Exception as e:  # reported as SGLang does: success false, 400
            return {"success": False, "message": f"Failed to initialize custom process group: {e}."}
        self.groups[name] = pg
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> dict:
        pg = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        W.destroy_group(pg)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def begin_update(self, body: dict) -> dict:
        with self.mu:
            if self.session:
                return {"success": False, "message": R.BEGIN_TWICE}
            self.session = True
        return {"success": True, "message": "Success"}

    def end_update(self, body: dict) -> dict:
        with self.mu:
            if not self.session:
                return {"success": False, "message": R.END_WITHOUT}
            self.session = False
        return {"success": True, "message": "Success"}

    def flush(self) -> bool:
        with self.mu:
            return R.flush_allowed(self.engine.has_work(), self.paused)

    def update_from_distributed(self, body: dict) -> dict:
        import torch.distributed as dist

        if not self.session:  # checked before the group and the broadcast, as 0.5.23 does
            return {"success": False, "message": R.OUTSIDE_SESSION}
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return {
                "success": False,
                "message": f"Group {name} not in {list(self.groups)}. Please call `init_weights_update_group` first.",
            }
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if why := _beyond_model(self.engine.model, names, dtypes, shapes):  # before allocating what the body declares
            return {"success": False, "message": f"Failed to update parameter online: {why}"}
        t0 = time.perf_counter()
        try:
            if body.get("load_format") == "flattened_bucket":
                flat = torch.empty(W.bucket_size(dtypes, shapes), dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=self.groups[name])
                sd = W.unflatten(names, dtypes, shapes, flat)
            else:
                sd = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in zip(names, dtypes, shapes, strict=True)}
                for t in sd.values():
                    dist.broadcast(t, src=0, group=self.groups[name])
        except Exception as e:
            return self._failed(f"receiving the broadcast failed: {e}")
        recv_s = time.perf_counter() - t0  # from joining the broadcast to its last byte (and the views over it)
        out = self._load(sd, body)
        return out | ({"twin_timing": out["twin_timing"] | {"recv_s": recv_s}} if "twin_timing" in out else {})

    def update_from_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return {
                "success": False,
                "message": f"model_path={body['model_path']!r} holds no *.safetensors",
                "num_paused_requests": 0,
            }
        sd = {k: v for f in files for k, v in load_file(str(f)).items()}
        out = self._load(sd, body)
        if out["success"]:
            self.model_path = str(body["model_path"])
        return out | {"num_paused_requests": 0}

    def _load(self, sd: dict[str, torch.Tensor], body: dict) -> dict:
        """Load ``sd`` (a whole state dict or one bucket of it). A successful answer carries, beyond SGLang's
        ``success`` and ``message``, this server's own timing (``twin_timing``, seconds: ``load_s`` from the
        bytes in hand to the parameters holding them (lock, checks, copy), ``recompute_s`` the running requests'
        KV caches, and for a broadcast ``recv_s``, its receive): sglang 0.5.23 builds this answer as a plain
        dict (``http_server.py``, ``{"success", "message"}``) and its readers take keys by name."""
        t0 = time.perf_counter()
        with self.mu:
            self.drop_lora()  # full weights replace the base the adapter was merged into
            if body.get("abort_all_requests"):
                self._deliver(self.engine.abort_all())
            merged = _rest(self.engine, sd) | sd
            try:
                params = _check_state_dict(self.engine.model, merged)
            except ValueError as e:
                return self._failed(str(e))
            version = body.get("weight_version")
            if version is not None:
                self.labels.append(str(version))
                self.broken = None
            index = len(self.labels) - 1
            if self.paused == "in_place":  # SGLang keeps the running requests' old KV cache
                with torch.no_grad():
                    for k, v in sd.items():
                        params[k].copy_(v)
                self.engine.version = index
            else:  # loads, then recomputes every running request's KV under the new weights
                self.engine.update_weights(index, merged)
            self.mu.notify_all()
            if body.get("flush_cache", True) and not R.flush_allowed(self.engine.has_work(), self.paused):
                return {"success": False, "message": R.FLUSH_REFUSED}  # loaded, version recorded, 400
            self.info_version = self.labels[index]
            recompute_s = self.engine.update_split.get("recompute_s", 0.0) if self.paused != "in_place" else 0.0
        timing = {"load_s": time.perf_counter() - t0 - recompute_s, "recompute_s": recompute_s}
        msg = "Succeeded to update model weights." + (f" Weight version updated to {version}." if version else "")
        return {"success": True, "message": msg, "twin_timing": timing}

    def _failed(self, why: str) -> dict:
        """A failed update leaves the weights unusable: /generate answers 400 until a full update
        names a weight_version again (SGLang: 'Please discard the whole weights')."""
        self.broken = why
        log.error("weight update failed: %s", why)
        return {"success": False, "message": f"Failed to update parameter online: {why}"}

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.info_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
        }


class _Aborted:
    output_ids: list = []
    logprobs: list = []
    versions: list = []
    finish_reason = "abort"


def _as_list(x) -> list:
    """A row's per-token field (a 1D tensor, or a list) as plain Python numbers for JSON."""
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _beyond_model(model: torch.nn.Module, names: list, dtypes: list, shapes: list) -> Optional[str]:
    """Why a declared update cannot be this model's weights by size, or None; checked before any buffer is
    allocated. sglang 0.5.23's ``update_weights_from_distributed`` allocates ``torch.empty(shape, dtype)`` for
    whatever the request declares, receives, and only then fails on a wrong name or shape: a client could
    make it allocate any amount. Here a declaration fits the model (each tensor at most its largest
    parameter, all of them at most all its parameters, floating-point dtypes) or is refused without joining
    the broadcast (the sender then times out: a well-formed update never gets here). A wrong name or shape
    within those bounds is received and refused at load, as SGLang does (the group stays in step)."""
    if not (isinstance(names, list) and len(names) == len(dtypes) == len(shapes)):
        lens = f"{len(names)}/{len(dtypes)}/{len(shapes)}"
        return f"names, dtypes, shapes: expected three lists of one length, got lengths {lens}"
    sizes = [p.numel() for p in model.state_dict().values()]
    declared = [int(torch.Size(s).numel()) for s in shapes]
    for name, dtype, n in zip(names, dtypes, declared):
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype) or not getattr(torch, dtype).is_floating_point:
            return f"{name!r} declared with dtype {dtype!r}: expected a floating-point torch dtype name"
        if n > max(sizes):
            return f"{name!r} declared with {n} elements, more than the model's largest parameter ({max(sizes)})"
    if sum(declared) > sum(sizes):
        return f"the update declares {sum(declared)} elements, more than the model's {sum(sizes)} in all"
    return None


def _rest(engine: TorchEngine, sd: dict) -> dict:
    """The model's other tensors, so one bucket checks against the whole state dict."""
    return {k: v for k, v in engine.model.state_dict().items() if k not in sd}


def build_state(args) -> CpuSGLangServer:
    """The checkpoint at --model-path (as sglang.launch_server serves it), or with --config the run's policy:
    model.path's checkpoint when the config sets one, else its built tiny model (random init: the weights
    arrive by update before any request)."""
    if args.config and not args.model_path:
        cfg = load_config(args.config)
        args.model_path, args.dtype = cfg.model.path or "", cfg.model.dtype
        if not args.model_path:
            tok = policy_tokenizer(cfg.model)
            model = build_model(cfg.model, len(tok), cfg.seed)
    if args.model_path:
        check_context_length(sglang_context(args.model_path)[0], args.context_length)
        model = load_model(args.model_path, args.dtype)
        tok = load_tokenizer(args.model_path)
    else:
        check_context_length(sglang_rule(model.config.to_dict())[0], args.context_length)
    engine = TorchEngine(model, tok, seed=args.random_seed, max_batch_groups=args.max_running_requests)
    return CpuSGLangServer(
        engine,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        model_path=args.model_path or "",
        served_model_name=args.served_model_name,
        lora_rank=args.max_lora_rank if args.enable_lora else 0,
    )


def check_context_length(derived: int, context_length: Optional[int]) -> None:
    """--context-length longer than the one SGLang derives from the model's config is refused at start, in
    SGLang 0.5.23's words (``srt/configs/model_config.py`` ``_derive_context_length``; its override variable,
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN, is not mirrored: the twin never serves past the model's
    positions)."""
    if context_length is not None and context_length > derived:
        raise ValueError(
            f"Warning: User-specified context_length ({context_length}) is greater than the derived context_length "
            f"({derived}). This may lead to incorrect model outputs or CUDA errors. Note that the derived "
            "context_length may differ from max_position_embeddings in the model's config. To allow overriding "
            "this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="areal_async.rollout.servers.sglang_server", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", default="", help="HF model directory (as sglang.launch_server takes it)")
    src.add_argument(
        "--config",
        default="",
        help="areal-async config YAML: model.path's checkpoint, else its tiny model (random init)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context-length", type=int, default=None, help="as SGLang: at most the model's (checked)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--max-running-requests", type=int, default=64, help="requests decoded in one batch")
    p.add_argument("--served-model-name", default="areal-tiny")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--cpus", default="", help="pin this process to these CPUs (cpu-list syntax)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)")
    p.add_argument("--max-lora-rank", type=int, default=0, help="the largest adapter rank loaded")
    p.add_argument("--max-loras-per-batch", type=int, default=1, choices=[1], help="the twin serves one adapter")
    p.add_argument("--lora-target-modules", nargs="*", default=[], help="accepted as SGLang takes it")
    args = p.parse_args(argv)
    die_with_parent()  # started by the supervisor: it ends with it (base/parent.py)
    if args.cpus:
        pin_self(args.cpus)
    logging.basicConfig(level="INFO", format="%(asctime)s sglang-cpu %(levelname)s %(message)s")
    torch.set_num_threads(args.torch_threads)
    try:
        state = build_state(args)
    except BUILD_ERRORS as e:  # as a worker's build: the supervisor fails the run at once, no restart
        log.error("%s%s: %s", BUILD_FAILED_MARK, type(e).__name__, e)
        return BUILD_FAILED_EXIT_CODE
    srv = make_http_server(state, args.host, args.port)
    state.thread.start()
    log.info("serving on http://%s:%d", args.host, args.port)
    try:
        srv.serve_forever(poll_interval=0.2)
    finally:
        state.stopping.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
