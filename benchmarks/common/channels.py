"""Timing messages over a tensor or weight channel whose receiving end lives in a ``Peer``.

Peer side, ``CHANNEL_OPS`` (give them to ``Peer(device, CHANNEL_OPS)``):

- ``open``: build the receiver of a tensor (``what="traj"``) or weight channel (``"weights"``);
- ``expect``: receive ``n`` messages whose meta carries the sender's ``t0``, reply each latency
  (``ack="each"``) and finally the first-send-to-last-receive latency;
- ``weights``: receive one weight version by its manifest (on the channel ``what``, default
  "weights"), reply the receive time, params, phases and (delta channels) how it came;
- ``close``: close a channel end.

This side: ``open_pair`` builds both ends concurrently (collective channels rendezvous in their
constructors); ``endpoints`` / ``weight_kwargs`` give the two ends' keyword arguments per kind;
``time_each`` / ``time_stream`` / ``time_weights`` take the samples with the bound's samples
between them (``timing.BoundSamples``). Timestamps are ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for
all processes of a Linux host); a receive counts once tensors are usable there (device synced).
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional

import torch

from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.transport import make_tensor_channel, make_weight_channel
from areal_async.transport.nccl import require_nccl
from benchmarks.common.payloads import engine_model
from benchmarks.common.peers import Op, Peer, reply
from benchmarks.common.timing import MIN_BOUND_SAMPLES, BoundSamples, Copier, sync
from protocols.sockets import free_tcp_port

GPU_KINDS = ("cuda_ipc", "nccl")


def _open(state: dict, cmd: dict) -> dict:
    if cmd["kwargs"].get("device") is not None:
        torch.cuda.set_device(cmd["kwargs"]["device"])
    make = make_tensor_channel if cmd["what"] == "traj" else make_weight_channel
    state[cmd["what"]] = make(cmd["kind"], role="receiver", **cmd["kwargs"])
    return {"ok": True}


def _expect(state: dict, cmd: dict) -> dict:
    """Receive ``n`` messages; ack each one's latency ('each') or first-send-to-last-receive ('last')."""
    ch, first_t0, t1 = state["traj"], None, 0.0
    for _ in range(cmd["n"]):
        key, meta, tensors = ch.recv(timeout_s=300)
        sync(state["device"])
        t1 = time.perf_counter()
        first_t0 = meta["t0"] if first_t0 is None else first_t0
        del tensors  # frees the shm slab for the next message
        if cmd["ack"] == "each":
            reply(state, {"lat": t1 - meta["t0"]})
    return {"lat": t1 - first_t0}


def _weights(state: dict, cmd: dict) -> dict:
    ch = state[cmd.get("what", "weights")]
    sd = ch.receive(cmd["manifest"])
    sync(state["device"])
    t1 = time.perf_counter()
    return {"t1": t1, "params": sum(t.numel() for t in sd.values()), "phases": getattr(ch, "phases", {}),
            "path": getattr(ch, "path", "")}  # fmt: skip


def _engine(state: dict, cmd: dict) -> dict:
    """An embedded engine (``TorchEngine``) of the model's shape, with ``groups`` groups mid-generation
    (so a weight update recomputes their KV caches, as in a fleet at eta >= 1)."""
    if state.get("engine_shape") == cmd["shape"]:  # one engine per shape, across transports
        return {"ok": True, "params": sum(p.numel() for p in state["engine"].model.parameters())}
    state.pop("engine", None)
    model = engine_model(cmd["shape"], dtype=torch.bfloat16)
    eng = TorchEngine(model, 0, device=state["device"], max_batch_groups=cmd["groups"], version=0)
    for g in range(cmd["groups"]):
        prompt = [(7 * g + i) % 97 + 1 for i in range(cmd["prompt_len"])]
        eng.add_request(GenRequest(f"g{g}", prompt, n=cmd["samples"], max_new_tokens=1000, temperature=1.0))
    for _ in range(cmd["steps"]):
        eng.step()
    state["engine"], state["engine_shape"] = eng, cmd["shape"]
    return {"ok": True, "params": sum(p.numel() for p in model.parameters())}


def _weights_e2e(state: dict, cmd: dict) -> dict:
    """Receive a version and load it into the engine (its KV caches recomputed): the update's end."""
    sd = state["weights"].receive(cmd["manifest"])
    t_recv = time.perf_counter()
    state["engine"].update_weights(cmd["manifest"]["version"], sd)
    del sd
    sync(state["device"])
    t1 = time.perf_counter()
    return {"t1": t1, "t_recv": t_recv, "phases": getattr(state["weights"], "phases", {}),
            **state["engine"].update_split}  # fmt: skip


def _close(state: dict, cmd: dict) -> dict:
    ch = state.pop(cmd["what"], None)
    if ch is not None:
        ch.close()
    return {"ok": True}


CHANNEL_OPS: dict[str, Op] = {
    "open": _open,
    "expect": _expect,
    "weights": _weights,
    "engine": _engine,
    "weights_e2e": _weights_e2e,
    "close": _close,
}


def endpoints(kind: str) -> tuple[dict, dict]:
    """(peer kwargs, my kwargs) for a trajectory channel: the peer receives (trainer, rank 0)."""
    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    if kind in ("shm", "zmq"):
        return {"endpoint": ep}, {"endpoint": ep}
    if kind == "cuda_ipc":
        return {"endpoint": ep, "device": 0}, {"endpoint": ep, "device": 0}
    group = {"world_size": 2, "store": f"127.0.0.1:{free_tcp_port()}", "endpoint": ep}
    dev = ({"device": 0}, {"device": 1}) if kind == "nccl" else ({}, {})
    return {**group, "rank": 0, **dev[0]}, {**group, "rank": 1, **dev[1]}


def weight_kwargs(kind: str) -> tuple[dict, dict]:
    """(peer kwargs, my kwargs) for a weight channel: this process publishes (rank 0)."""
    if kind in ("shm", "zmq"):
        return {}, {}
    if kind == "cuda_ipc":
        return {"device": 0}, {"device": 0}
    group = {"world_size": 2, "store": f"127.0.0.1:{free_tcp_port()}"}
    dev = ({"device": 1}, {"device": 0}) if kind == "nccl" else ({}, {})
    return {**group, "rank": 1, **dev[0]}, {**group, "rank": 0, **dev[1]}


def open_pair(peer: Peer, kind: str, what: str, mine: dict, theirs: dict):
    """This side's end (sender / publisher) of a channel whose receiving end the peer builds at once."""
    peer.ask("open", what=what, kind=kind, kwargs=theirs)
    if what == "traj":
        ch = make_tensor_channel(kind, role="sender", **mine)
    else:
        ch = make_weight_channel(kind, role="publisher", **mine)
    peer.answer()
    return ch


def unavailable(kind: str, device: str) -> Optional[str]:
    """None when channel ``kind`` can run here, else why not."""
    if kind in GPU_KINDS and device != "cuda":
        return f"{kind} needs --device cuda"
    if kind == "nccl":
        try:
            require_nccl()
        except RuntimeError as e:
            return str(e)
        if torch.cuda.device_count() < 2:
            return "nccl needs 2 GPUs (NCCL refuses two ranks on one device)"
    if kind == "shm" and not os.path.isdir("/dev/shm"):
        return "shm needs /dev/shm"
    return None


def time_each(peer: Peer, ch, payload: dict, repeats: int, bound: Copier) -> tuple[list[float], BoundSamples]:
    """Latency of ``repeats`` messages, one in flight at a time, after one warm-up; the bound's samples,
    taken before each timed message (``BoundSamples``: at least ``MIN_BOUND_SAMPLES`` in all)."""
    peer.ask("expect", n=repeats + 1, ack="each")
    out, b = [], BoundSamples(bound, slots=repeats)
    for i in range(repeats + 1):
        if i:
            b.take()
        ch.send(f"m{i}", payload, {"t0": time.perf_counter()})
        lat = peer.answer()["lat"]
        if i:
            out.append(lat)
    peer.answer()
    return out, b


def time_stream(peer: Peer, ch, seqs: list[dict], repeats: int, bound: Copier) -> tuple[list[float], BoundSamples]:
    """First send to last receive for the sequences sent back to back; the bound's samples before each."""
    out, b = [], BoundSamples(bound, slots=repeats)
    for i in range(repeats + 1):
        if i:
            b.take()
        peer.ask("expect", n=len(seqs), ack="last")
        for j, s in enumerate(seqs):
            ch.send(f"s{i}/{j}", s, {"t0": time.perf_counter()})
        lat = peer.answer()["lat"]
        if i:
            out.append(lat)
    return out, b


def time_weights(
    peer: Peer,
    ch,
    sd: dict,
    version: int,
    repeats: int,
    bound: Copier,
    op: str = "weights",
    what: str = "weights",
    change: Optional[Callable[[int], None]] = None,
    between: Optional[Callable[[], None]] = None,
):
    """(latencies, publisher-side times, the bound's samples, the last answer with the publisher's phases)
        of ``repeats`` versions after a warm-up: from ``publish_begin`` to the peer's ``op`` returning
        (``weights``: ``receive`` on its channel ``what``; ``weights_e2e``: its engine loaded them, KV
        caches recomputed). The bound (``BoundSamples``) is sampled before each timed version and after the
        last, and ``between()`` (another reference, e.g. the wire) called there as often (at least
    ``MIN_BOUND_SAMPLES`` calls in all): interleaved with the
        transfers, never during one. ``change(i)``: called before version i > 0 is published (it may alter ``sd``)."""
    lat, pub, last = [], [], {}
    b = BoundSamples(bound, slots=repeats + 1)

    def references() -> None:
        b.take()
        for _ in range(math.ceil(MIN_BOUND_SAMPLES / b.slots) if between is not None else 0):
            between()

    for i in range(repeats + 1):
        if i and change is not None:
            change(i)
        if i:
            references()
        sync(str(next(iter(sd.values())).device))
        c0, t0 = time.process_time(), time.perf_counter()
        manifest = ch.publish_begin(version + i, sd)
        peer.ask(op, manifest=manifest, **({"what": what} if what != "weights" else {}))  # WeightsPublished
        ch.publish_end()
        t_pub = time.perf_counter() - t0
        last = {**peer.answer(), "pub_phases": dict(getattr(ch, "phases", {})), "pub_cpu_s": time.process_time() - c0}
        ch.release(version + i)
        if i:
            lat.append(last["t1"] - t0)
            pub.append(t_pub)
    references()
    return lat, pub, b, last
