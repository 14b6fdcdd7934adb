"""The fleet's weight updates: from the trainer's optimizer step end to every rollout generating with them.

``weight_update_s`` of version v = the latest ``loaded`` time among the rollout workers minus the
``t_ready`` of v (the end of the optimizer step that made v; ``WeightsPublished.t_ready``). Its
phases are those of the worker that loaded last (they add up to the total, but for the engine's
few microseconds outside its own split):

- ``publish_s``: trainer, t_ready -> WeightsPublished sent (gather, pack, checksum; for zmq, and shm
  states under 4 MiB, the bytes are in place by then; for larger shm states the pack goes on after it,
  overlapped with the workers' verification, and for gloo/nccl the bytes move after it: both then
  count in the receive phase);
- ``notify_s``: the message's hop through the scheduler to the worker;
- ``receive_s``: the worker's channel ``receive`` (wire, checksums verified);
- ``queue_s``: waiting for the engine thread to reach a step boundary; under ``rollout.on_weights=finish``
  it holds ``drain_s`` too, the running sequences ending under the old weights (a column of its own);
- ``load_s`` / ``recompute_s``: the engine's copy into its parameters and its KV-cache recompute
  (one ``engine_s`` when the engine does not split them).

Wall times (``time.time``) from several processes: exact on one host; across hosts the clocks'
skew adds to ``notify_s``. Updates without ``t_ready`` (the initial weights) are not timed.
"""

from __future__ import annotations

from typing import Collection, Optional

PHASES = ("publish_s", "notify_s", "receive_s", "queue_s", "load_s", "recompute_s")
_KEEP = 8  # versions whose loads are still being collected (older ones are forgotten)


class WeightUpdates:
    def __init__(self):
        self._pending: dict[int, dict] = {}  # version -> {"t_ready", "t_sent", "loads": {wid: times}}
        self.last: dict = {}  # the last complete update: version, weight_update_s, phases, workers

    def published(self, version: int, t_ready: float, t_sent: float) -> None:
        if t_ready > 0:
            self._pending[version] = {"t_ready": t_ready, "t_sent": t_sent, "loads": {}}
            for v in sorted(self._pending)[:-_KEEP]:
                del self._pending[v]

    def loaded(self, wid: str, version: int, times: dict, rollouts: Collection[str]) -> Optional[dict]:
        """Book one worker's load; the update's row once every rollout in ``rollouts`` (distinct ids) has it, else
        None. Counted first: the ids are compared only once as many loads as rollouts are in (O(1) a load
        before that, not O(rollouts): at 1000 workers a version's loads would cost O(workers^2))."""
        p = self._pending.get(version)
        if p is None or not _complete(times):
            return None
        loads = p["loads"]
        loads[wid] = times
        if len(loads) < len(rollouts) or not all(map(loads.__contains__, rollouts)):
            return None
        del self._pending[version]
        self.last = _row(version, p)
        return self.last


def _complete(times: dict) -> bool:
    return all(isinstance(times.get(k), (int, float)) for k in ("manifest", "received", "load_start", "loaded"))


def _row(version: int, p: dict) -> dict:
    wid, t = max(p["loads"].items(), key=lambda kv: kv[1]["loaded"])
    engine = {"load_s": t.get("load_s"), "recompute_s": t.get("recompute_s")}
    if not all(isinstance(v, (int, float)) for v in engine.values()):
        engine = {"load_s": t["loaded"] - t["load_start"], "recompute_s": 0.0}  # no split: all of it is load
    return {
        "weight_update_version": version,
        "weight_update_s": t["loaded"] - p["t_ready"],
        "publish_s": p["t_sent"] - p["t_ready"],
        "notify_s": t["manifest"] - p["t_sent"],
        "receive_s": t["received"] - t["manifest"],
        "queue_s": t["load_start"] - t["received"],
        **engine,
        "drain_s": t.get("drain_s", 0.0),  # part of queue_s (on_weights=finish)
        "slowest_worker": wid,
        "workers": len(p["loads"]),
    }


def metrics_columns(last: dict) -> dict:
    """The step row's columns: ``weight_update_s`` and ``weight_update_<phase>`` of the last complete update."""
    if not last:
        return {}
    out = {"weight_update_s": last["weight_update_s"], "weight_update_version": last["weight_update_version"]}
    out.update({f"weight_update_{k}": last[k] for k in PHASES})
    out["weight_update_drain_s"] = last.get("drain_s", 0.0)
    return out
