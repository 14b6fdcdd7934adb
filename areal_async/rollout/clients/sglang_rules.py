"""What SGLang 0.5.23 refuses around a weight update, as data: the CPU server (``servers/sglang_server.py``)
refuses the same things with the same words and HTTP status, and the client (``sglang_client.py``)
is built so that it never triggers them.

Read from the sglang 0.5.23 wheel (``pip download sglang==0.5.23``):

- ``srt/managers/scheduler_components/weight_updater.py``
  ``update_weights_from_distributed`` (and ``_from_tensor``) answer ``success=False`` with
  ``OUTSIDE_SESSION`` when no ``begin_weight_update`` session is open, *before* joining the
  broadcast: a sender already inside ``dist.broadcast`` then waits for a peer that never comes.
  ``begin_weight_update`` refuses a second session (``BEGIN_TWICE``), ``end_weight_update`` refuses
  without one (``END_WITHOUT``): a session a failed update never ended blocks every later update.
  ``flush_cache_after_weight_update``: with ``flush_cache`` true and requests still running, the
  weights ARE loaded and the version recorded, but the call answers ``FLUSH_REFUSED``.
- ``srt/managers/scheduler.py`` ``flush_cache``: refuses unless ``is_fully_idle(ignore_waiting=
  engine paused)``: a paused ``retract`` server (requests moved to the waiting queue) flushes,
  a paused ``in_place`` one (requests kept in the running batch, io_struct.py
  ``PauseGenerationReqInput``: "In 'inplace' mode, flush_cache will fail if there are any requests
  in the running_batch") does not, nor does a running one with requests.
- ``srt/entrypoints/http_server.py``: ``/begin_weight_update``, ``/end_weight_update``,
  ``/update_weights_from_distributed`` answer ``{"success", "message"}`` with 200 or 400
  (``HTTPStatus.BAD_REQUEST``); ``/flush_cache`` answers text, 200 ``FLUSHED`` or 400 ``FLUSH_FAILED``
  (``FlushCacheReqOutput.message`` is empty, so the endpoint's default text).
- ``srt/model_executor/model_runner_components/weight_updater.py`` ``init_weights_update_group``:
  each TP rank joins as ``rank_offset + tp_rank``, so the group has ``1 + tp_size`` ranks
  (``tp_size`` from ``GET /server_info``, ``server_args.resolved_dict()``).
"""

from __future__ import annotations

OUTSIDE_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
BEGIN_TWICE = "a weight-update session is already open; call end_weight_update() first"
END_WITHOUT = "no weight-update session is open; call begin_weight_update() first"
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
BAD_REQUEST = 400  # http.HTTPStatus.BAD_REQUEST, every refusal above
TP_SIZE = 1  # the CPU server is one rank (no tensor parallelism); its /server_info says so


class BadRequest(ValueError):
    """Answered 400 with the message (SGLang answers a contract violation the same way)."""


class Unavailable(RuntimeError):
    """Answered 503: the server cannot serve now (weights unusable after a failed update)."""


def flush_allowed(has_requests: bool, pause_mode: str | None) -> bool:
    """Scheduler.flush_cache: idle, or paused with the requests out of the running batch (retract;
    abort ended them). A running server with requests, or an in_place pause, refuses."""
    return not has_requests or pause_mode in ("retract", "abort")


def flush_after_update(pause_mode: str) -> bool:
    """The ``flush_cache`` a client sends with an update: never under in_place (the requests stay in the
    running batch, so 0.5.23 fails the update); the other modes empty the running batch first."""
    return pause_mode != "in_place"


def group_world_size(server_info: dict) -> int:
    """Ranks of a server's weight-update group: the sender plus one per TP rank of the server."""
    tp = server_info.get("tp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"/server_info tp_size={tp!r}: expected an integer >= 1")
    return 1 + tp
