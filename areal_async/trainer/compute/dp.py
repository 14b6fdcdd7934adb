"""Data-parallel trainer ranks: FSDP2 sharding, the batch split by tokens, global normalisation.

::

    rank 0 (on the control plane)                 ranks 1..K-1
    BatchPlan -> trajectories ─ broadcast_batch ─> the same trajectories
    every rank: advantages of the whole batch (identical everywhere: same inputs, same code)
    prox logprobs: each rank its share (split_over_ranks), then all_gather_per_seq -> whole batch
    each PPO minibatch (balanced by tokens): split over ranks by tokens, each share into
      micro-batches; every rank runs the same number of micro-batches (padding ones run a
      zero-loss forward/backward: FSDP's all-gathers and reduce-scatters are collectives)
    loss of a micro-batch = sum of its token losses / N, N = the minibatch's tokens on ALL ranks
    gradients: reduce-scatter SUM (divide factor 1), so K ranks take one rank's step

Why the same update: the loss is a sum over tokens divided by one global N, and the gradient of a
sum is the sum of the ranks' gradients; a per-rank N would weight a rank's tokens by N / N_r.

Collectives used (all on gloo in torch 2.13 CPU: checked, ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` included, which FSDP2 needs): broadcast (the batch, commands),
all_gather (per-sequence logprobs, padded to the longest share), all_reduce (loss statistics).

``DataParallel.single()`` is the one-process case: every method is an identity and no process
group exists, so the actor has one code path.

Not covered: tensor/sequence/pipeline parallelism, meta-device initialisation (every rank
builds the full model before ``fully_shard`` keeps its shard; fine up to what one host's memory
holds), HSDP.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from protocols.messages import ProtocolError, build
from protocols.side import TensorHeader
from protocols.tensors import spec_of
from protocols.trajectories import Trajectory, TrajectoryBatch

from areal_async.trainer.algo.loss import LossStats
from areal_async.trainer.compute.micro_batches import allocate_micro_batches, karmarkar_karp
from areal_async.transport.buckets import plan
from areal_async.transport.frames import align, flat_bytes, layout, tensor_views

# commands rank 0 broadcasts to the other ranks before each collective phase
CMD_TRAIN, CMD_PUBLISH, CMD_SAVE, CMD_STOP, CMD_EXPORT = 1, 2, 3, 4, 5
CMD_NAMES = {CMD_TRAIN: "train", CMD_PUBLISH: "publish", CMD_SAVE: "save", CMD_STOP: "stop", CMD_EXPORT: "export"}


# --------------------------------------------------------------------------------------------
# pure planning (identical on every rank: a function of the sequence lengths only)
# --------------------------------------------------------------------------------------------


def split_over_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Sequence indices per rank, token sums balanced (Karmarkar-Karp); a rank may get none
    when there are fewer sequences than ranks. Deterministic: every rank computes the same."""
    if world < 1:
        raise ValueError(f"world={world}: expected an integer >= 1")
    if world == 1:
        return [list(range(len(lengths)))]
    bins = karmarkar_karp(list(lengths), world)
    # heaviest share to rank 0 ... a fixed order, so the split does not depend on heap ties
    return sorted(bins, key=lambda b: (-sum(lengths[i] for i in b), b))


def minibatches_by_tokens(lengths: Sequence[int], k: int) -> list[list[int]]:
    """PPO minibatches: k sets of sequence indices with balanced token sums (each non-empty)."""
    if k > len(lengths):
        raise ValueError(
            f"ppo_n_minibatches={k} but the batch has {len(lengths)} trajectories; expected <= {len(lengths)}"
        )
    if k == 1:
        return [list(range(len(lengths)))]
    return sorted(karmarkar_karp(list(lengths), k), key=lambda b: b[0])


def rank_micro_batches(
    lengths: Sequence[int], shares: list[list[int]], budget: int, oversize: str
) -> tuple[list[list[list[int]]], int]:
    """(per rank: micro-batches of indices into ``lengths``, the common micro-batch count).

    Every rank allocates its own share under the token budget; the count every rank must run is
    the largest of them (the others pad with zero-loss micro-batches)."""
    per_rank = []
    for share in shares:
        mbs = allocate_micro_batches([lengths[i] for i in share], budget, oversize) if share else []
        per_rank.append([[share[j] for j in mb] for mb in mbs])
    return per_rank, max(len(m) for m in per_rank)


# --------------------------------------------------------------------------------------------
# the group
# --------------------------------------------------------------------------------------------


@dataclass
class DataParallel:
    """This process's place among the trainer ranks (``world == 1``: no process group)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def single(cls) -> "DataParallel":
        return cls(0, 1)

    @property
    def active(self) -> bool:
        return self.world > 1

    # ---- the batch ---------------------------------------------------------------------------
    def broadcast_batch(self, trajs: Optional[Sequence[Trajectory]]) -> list[Trajectory]:
        """Rank 0's trajectories on every rank (others pass None)."""
        if not self.active:
            return list(trajs or [])
        import torch.distributed as dist

        buf = encode_batch(trajs) if self.rank == 0 else None
        size = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64)
        dist.broadcast(size, 0)
        if buf is None:
            buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0)
        return decode_batch(buf)

    def all_gather_per_seq(
        self, mine: dict[int, torch.Tensor], shares: list[list[int]], lengths: Sequence[int]
    ) -> list[torch.Tensor]:
        """Per-sequence float tensors computed by their owning rank, on every rank, in batch order.

        ``mine``: this rank's sequences (index -> tensor of ``lengths[index]`` values)."""
        n = len(lengths)
        if not self.active:
            return [mine[i] for i in range(n)]
        import torch.distributed as dist

        totals = [sum(lengths[i] for i in s) for s in shares]
        width = max(max(totals), 1)
        flat = torch.zeros(width, dtype=torch.float32)
        own = shares[self.rank]
        if own:
            flat[: totals[self.rank]] = torch.cat([mine[i].detach().float().cpu() for i in own])
        out = [torch.empty(width, dtype=torch.float32) for _ in range(self.world)]
        dist.all_gather(out, flat)
        full: list[Optional[torch.Tensor]] = [None] * n
        for r, share in enumerate(shares):
            pos = 0
            for i in share:
                full[i] = out[r][pos : pos + lengths[i]]
                pos += lengths[i]
        return full  # type: ignore[return-value]

    # ---- statistics --------------------------------------------------------------------------
    def sum_stats(self, stats: LossStats) -> LossStats:
        """The merge of every rank's statistics (sums added, iw_max the largest)."""
        if not self.active:
            return stats
        import torch.distributed as dist

        names = [f.name for f in fields(LossStats)]
        t = torch.tensor([getattr(stats, k) for k in names], dtype=torch.float64)
        dist.all_reduce(t)
        top = torch.tensor([stats.iw_max], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        out = LossStats(**dict(zip(names, t.tolist())))
        out.iw_max = float(top)
        return out

    # ---- commands (rank 0 -> the others) -----------------------------------------------------
    def command(self, op: int = 0, arg: int = 0, text: str = "") -> tuple[int, int, str]:
        """Rank 0 sends (op, arg, text); the others receive and return it."""
        if not self.active:
            return op, arg, text
        import torch.distributed as dist

        raw = text.encode() if self.rank == 0 else b""
        head = torch.tensor([op, arg, len(raw)], dtype=torch.int64)
        dist.broadcast(head, 0)
        if self.rank == 0:
            buf = torch.tensor(list(raw), dtype=torch.uint8)
        else:
            buf = torch.empty(int(head[2]), dtype=torch.uint8)
        if int(head[2]):
            dist.broadcast(buf, 0)
        return int(head[0]), int(head[1]), bytes(buf.tolist()).decode()

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()


# The trainer group's backend by device. On CUDA a mixed backend: FSDP2's collectives carry CUDA tensors
# (NCCL) while the control collectives of ``DataParallel`` (commands, the batch, per-sequence logprobs,
# loss statistics) and ``broadcast_module`` (the model still on the host) carry CPU tensors (gloo).
# torch 2.13 distributed_c10d.py, ``BackendConfig.__init__``: a bare "nccl" maps only the devices in
# ``Backend.backend_capability["nccl"] == ["cuda"]`` (line 313), so a CPU tensor on it fails with "No backend
# type associated with device type cpu"; "cpu:gloo,cuda:nccl" maps each device type ("device:backend" branch).
TRAINER_BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}


def trainer_backend(device: str | torch.device) -> str:
    """The trainer group's ``init_process_group`` backend for ranks computing on ``device``."""
    kind = torch.device(device).type
    if kind not in TRAINER_BACKENDS:
        raise ValueError(f"trainer device {str(device)!r}: expected one of {sorted(TRAINER_BACKENDS)}")
    return TRAINER_BACKENDS[kind]


def init_data_parallel(rank: int, world: int, store: str, backend: str, timeout_s: float = 3600.0) -> DataParallel:
    """Join the trainer ranks' default process group (``store``: ``tcp://host:port`` or ``ipc://path``, served
    by rank 0 over the run's sockets, ``transport.store``; the gloo pairs bind the host name's address);
    ``backend`` as ``trainer_backend`` gives it.

    Also for one rank: FSDP2 (the mixed-precision path) needs a group. The long timeout is for
    ranks 1..K-1 waiting for rank 0's next command while it waits for a batch."""
    if not 0 <= rank < world:
        raise ValueError(f"trainer rank {rank}: expected an integer in [0, {world})")
    if backend not in TRAINER_BACKENDS.values():
        raise ValueError(f"backend={backend!r}: expected one of {sorted(TRAINER_BACKENDS.values())} (trainer_backend)")
    import torch.distributed as dist

    from areal_async.transport.store import group_store  # pyzmq: here, so the trainer's GPU code imports without it

    dist.init_process_group(
        backend,
        store=group_store(store, rank, timeout_s),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return DataParallel(rank, world)


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """FSDP2 over the policy: each decoder layer and the root are ``fully_shard``-ed over every
    rank of the default group. Parameters (the master weights) and the optimizer state stay
    float32; forward/backward compute in ``compute_dtype``; gradients are reduced in float32 and
    summed (divide factor 1: the loss is already normalised by the global token count). FSDP2's
    default reduction is AVG, or PREMUL_SUM for another factor; gloo supports neither, so the
    reduction is forced to SUM (``set_force_sum_reduction_for_comms``).

    Works for a group of one rank too (the mixed-precision path of a single trainer)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = model.to(device=device, dtype=torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in [*layers, model]:
        # SUM (never AVG / PREMUL_SUM: gloo has neither) and a post-division by 1 (exact)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers; expected a HF decoder-only causal LM")
    return list(layers)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly) sharded parameter: an all-gather for a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def broadcast_module(model: torch.nn.Module, src: int = 0) -> None:
    """Every parameter and buffer of ``src``'s model on every rank (before sharding: e.g. after
    rank 0 alone ran the SFT warm-up)."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src)


# --------------------------------------------------------------------------------------------
# weights published from shards, a bucket at a time
# --------------------------------------------------------------------------------------------


class ShardedWeights(Mapping):
    """A sharded model's state dict as a weight channel reads it, gathered a bucket at a time.

    ``items()`` gives meta tensors (name, publish dtype, global shape: all a channel needs to plan
    its buckets); ``self[name]`` gives the full tensor, gathering (an all-gather per tensor, a
    collective) every tensor of that name's bucket on first access and dropping the previous
    bucket, so no rank ever holds more than one bucket of the full model. Channels pack buckets
    in order (``buckets.pack`` for k = 0, 1, ...); buckets they skip are still gathered, and
    ``finish()`` gathers the rest, so every rank runs the same collectives: the other ranks call
    ``gather_all`` on a view built with the same ``bucket_bytes``.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, state: Optional[dict] = None):
        """``state``: the tensors to publish by name (a LoRA adapter's), instead of ``model.state_dict()``."""
        self._params = dict(model.state_dict() if state is None else state)
        self._dtype = dtype
        self._meta = {
            k: torch.empty(tuple(v.shape), dtype=self._out_dtype(v), device="meta") for k, v in self._params.items()
        }
        self.layout = plan(self._meta, bucket_bytes)
        self._bucket_of = {s.name: s.bucket for s in self.layout.slots}
        self._k = -1
        self._cache: dict[str, torch.Tensor] = {}
        self.peak_bytes = 0  # the most bytes of full tensors held at once (for tests and benchmarks)

    def _out_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self._dtype if t.is_floating_point() else t.dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        k = self._bucket_of[name]
        if k < self._k:
            raise RuntimeError(
                f"weight {name!r} of bucket {k} asked after bucket {self._k}: buckets are gathered once, in order"
            )
        while self._k < k:
            self._next()
        return self._cache[name]

    def __iter__(self):
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)

    def items(self):  # type: ignore[override]
        return self._meta.items()

    def _next(self) -> None:
        self._cache = {}  # the previous bucket goes first
        self._k += 1
        for s in self.layout.slots_in(self._k):
            self._cache[s.name] = full_tensor(self._params[s.name]).detach().to(self._out_dtype(self._params[s.name]))
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in self._cache.values()))

    def finish(self) -> None:
        """Gather whatever buckets the channel did not read (every rank gathers every bucket)."""
        while self._k < len(self.layout.bucket_sizes) - 1:
            self._next()
        self._cache = {}

    def gather_all(self) -> None:
        """What the ranks other than the publisher do: the same gathers, results dropped."""
        self.finish()


# --------------------------------------------------------------------------------------------
# the batch on the wire between ranks: the trajectory type's own encode, in one uint8 buffer
# --------------------------------------------------------------------------------------------

_LEN = 8  # the header's length, little-endian, in the buffer's first bytes


def encode_batch(trajs: Sequence[Trajectory]) -> torch.Tensor:
    """The step's rows as one host uint8 buffer: ``[header length | header | payload]``, the header the
    tensor channels' (``TensorHeader``: key, the batch's meta, one spec a column), the payload each
    column of ``TrajectoryBatch.of_samples(trajs).encode()`` at a 64-byte aligned offset. Sample ids,
    group ids, scores and every optional column travel as on the rollouts' wire. Rows on a device are
    laid out there and copied to the host once (gloo sends host tensors).

    The header's fields are serialised as JSON, not msgpack: trainer ranks exchange nothing else through
    msgpack, and a bare GPU image has none (``scripts/gpu_check.sh``'s rank checks run without it).
    ``decode_batch`` applies the same field and type checks as ``parse_header`` (``protocols.messages.build``)."""
    key, tensors, meta = TrajectoryBatch.of_samples(trajs).encode()
    specs = [spec_of(n, t) for n, t in tensors.items()]
    header = json.dumps(TensorHeader(key=key, meta=meta, specs=specs).to_body(), separators=(",", ":")).encode()
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    offsets, total = layout(sizes)
    start = align(_LEN + len(header))
    head = torch.zeros(start, dtype=torch.uint8)
    head[:_LEN] = torch.frombuffer(bytearray(len(header).to_bytes(_LEN, "little")), dtype=torch.uint8)
    head[_LEN : _LEN + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    body = torch.zeros(total, dtype=torch.uint8, device=trajs[0].output_ids.device)
    for t, off, n in zip(tensors.values(), offsets, sizes):
        body[off : off + n] = flat_bytes(t.to(body.device))
    return torch.cat([head, body.cpu()])


def decode_batch(buf: torch.Tensor) -> list[Trajectory]:
    """``encode_batch``'s buffer back as rows (views of ``buf``), every field checked
    (``ProtocolError`` naming the first mismatch)."""
    raw = buf.numpy()
    n = int.from_bytes(raw[:_LEN].tobytes(), "little")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not 0 < n <= min(buf.numel() - _LEN, TensorHeader.MAX_BYTES):
        raise ProtocolError(f"rank batch: {buf.dtype}[{buf.numel()}] with header length {n}; expected encode_batch's")
    try:
        body = json.loads(raw[_LEN : _LEN + n].tobytes())
    except ValueError as e:
        raise ProtocolError(f"rank batch: its header is not JSON ({e})") from None
    header = build(TensorHeader, body)  # the fields, their types and validate(), as parse_header
    sizes = [s.get("nbytes", -1) if isinstance(s, dict) else -1 for s in header.specs]
    offsets, _ = layout(sizes)
    tensors = tensor_views(header, buf[align(_LEN + n) :], offsets, sizes)
    return [row.scored(row.score) for row in TrajectoryBatch.decode(header.key, header.meta, tensors).samples()]
