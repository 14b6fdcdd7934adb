"""``TorchEngine``: the embedded rollout engine, plain PyTorch, CPU or one GPU.

How it works::

    step(): for each running cohort one forward of one token per row ──> sample ──> finished rows
            leave; then the pending groups: prefill each prompt once, sample the first token of
            the group's n rows from its last logits ──> new cohort, merged into a running one
            while they hold <= max_batch_groups groups; a group is returned once its n samples
            have all finished

A *cohort* is a batch of rows (samples) that share one left-padded KV cache. Each row keeps the
token it will feed next (the last sampled one), so every step advances every row by exactly one
token: running rows by one single-token forward per cohort, new rows by their prefill (no extra
forward for the last prompt token). Cohorts are merged by left-padding the shorter cache
(padding is masked), so requests arriving between steps join the running batch instead of
waiting for it.

Weight updates (AReaL's interrupt-and-resume): ``update_weights`` loads the new tensors, then
throws away every cohort's KV cache and recomputes it by prefilling prompt + tokens generated so
far under the NEW weights; decoding then continues. Tokens sampled before the update keep their
old version and old logprobs, tokens after it carry the new version. No KV entry computed by old
weights is ever read by new ones (invariant 4). ``on_weights="keep"`` (PipelineRL's in-flight update,
opted into by the run) loads and keeps every cache: the next tokens attend to keys and values the old
weights computed, and carry the new version. ``on_weights="finish"``: the rollout worker holds new
groups (``hold_new``) and steps until nothing is ``in_flight`` before it calls ``update_weights``, so
the running sequences end under the old weights and there is no cache left to recompute.
``abort_groups`` drops groups (queued or running) and says how many tokens each had generated.

The forward passes run on a preallocated KV cache (``kv_decoder.KVCache``: a decode step writes
one column in place) through ``kv_decoder.LeanLlama`` for Llama/Qwen2 (the HF modules' weights,
no HF forward machinery) or the model's own HF forward for other architectures. A finished row
stays in its cohort, decoded and ignored, until a quarter of the cohort has finished: then the
cohort is compacted (rows and cache re-indexed once, not at every finished row).

Covered: temperature, top-p, greedy, eos/stop tokens, max_new_tokens, abort, seeded sampling
(``torch.Generator``). Not covered: paged memory, a radix tree across groups (only the prompt of
one group is shared), sliding-window or hybrid-cache models, speculative decoding. After a
weight update each row is re-prefilled on its own (prompt sharing is not redone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from protocols.trajectories import COLUMNS, TrajectoryBatch

from areal_async.models.lora import EngineAdapter
from areal_async.rollout.engines.engine import (
    ON_WEIGHTS,
    GenRequest,
    RolloutEngine,
    group_output,
    group_rows,
    sample_row,
)
from areal_async.rollout.engines.kv_budget import KVBudget, bytes_per_position
from areal_async.rollout.engines.kv_cache import LAYOUTS, KVCache, default_layout
from areal_async.rollout.engines.kv_decoder import make_decoder
from areal_async.rollout.engines.sampling import SamplingMode, sample_tokens, token_entropy

# Per-row tensors of a cohort and how each is padded when two cohorts merge:
# "_B" no padding; "_BW" right-padded along dim 1 (generated-token buffers, stop sets);
# "mask_BT" left-padded along dim 1 like the KV cache it describes.
_ROW_PAD = {"out_BW": 0, "logp_BW": 0.0, "ver_BW": -1, "stop_BW": -1, "ent_BW": 0.0}


@dataclass
class _Group:
    req: GenRequest
    # per sample index: its row (``engine.sample_row``) once its finished row left the batch before the group
    # ended (compaction, weight update), else None (the row is still in its cohort)
    samples: list
    reasons: list  # finish reason per sample index, None while it runs
    left: int  # samples not finished yet


def _pad_dim(x: torch.Tensor, dim: int, size: int, value: float, left: bool) -> torch.Tensor:
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    fill = torch.full(shape, value, dtype=x.dtype, device=x.device)
    return torch.cat([fill, x] if left else [x, fill], dim=dim)


class _Cohort:
    """Rows decoded together: ``rows[i]`` = (group, sample index) of batch row i."""

    def __init__(self, rows: list[tuple[_Group, int]], t: dict[str, torch.Tensor], cache: KVCache, mode: SamplingMode):
        self.rows, self.t, self.cache, self.mode = rows, t, cache, mode

    @property
    def n_groups(self) -> int:
        return len({id(g) for g, _ in self.rows if g.left})

    def compact(self) -> None:
        """Drop the finished rows still in the batch (those with ``live_B`` False)."""
        if not bool(self.t["live_B"].all()):
            self.select(self.t["live_B"].nonzero().squeeze(1))

    def select(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` (in that order) and drop cache columns no kept row attends to."""
        keep = idx.tolist()
        self.rows = [self.rows[i] for i in keep]
        self.t = {k: v.index_select(0, idx) for k, v in self.t.items()}
        live_T = self.t["mask_BT"].any(0).nonzero()
        start = int(live_T[0]) if len(live_T) else self.t["mask_BT"].shape[1]
        self.t["mask_BT"] = self.t["mask_BT"][:, start:]
        self.cache = self.cache.select(idx, start)

    def merge(self, other: "_Cohort") -> None:
        """Append ``other``'s rows; the shorter cache is left-padded with masked zeros."""
        T = max(self.t["mask_BT"].shape[1], other.t["mask_BT"].shape[1])
        W = max(self.t["out_BW"].shape[1], other.t["out_BW"].shape[1])
        S = max(self.t["stop_BW"].shape[1], other.t["stop_BW"].shape[1])
        self.t = {k: torch.cat([_pad_row(k, v, T, W, S), _pad_row(k, other.t[k], T, W, S)]) for k, v in self.t.items()}
        self.cache = self.cache.merge(other.cache)
        self.rows = self.rows + other.rows
        self.mode = self.mode.merge(other.mode)


def _more(parts: list) -> dict:
    """The optional per-token columns after ids, logprobs and versions (``_rows_flat``'s order)."""
    return {"entropy": parts[3]} if len(parts) > 3 else {}


def _pad_row(name: str, x: torch.Tensor, T: int, W: int, S: int) -> torch.Tensor:
    if name == "mask_BT":
        return _pad_dim(x, 1, T, 0, left=True)
    if name in _ROW_PAD:
        return _pad_dim(x, 1, S if name == "stop_BW" else W, _ROW_PAD[name], left=False)
    return x


class TorchEngine(RolloutEngine):
    """KV-cached batched sampling with a shared prefill per group; see the module docstring.

    ``tokenizer_or_eos_id``: a tokenizer (its ``eos_token_id`` is used) or the eos id itself; an id
    outside the vocabulary (e.g. -1) means no eos (samples end by stop tokens or length only).
    ``version``: version of the weights ``model`` already holds; the default -1 means "not loaded
    from the trainer yet" (tokens generated before the first ``update_weights`` carry -1).
    ``lean``: compute Llama/Qwen2 models with ``kv_decoder.LeanLlama`` (False: always through the
    model's own HF ``forward``, ``kv_decoder.HFDecoder``; other architectures always use that).
    ``kv_cache_bytes``: the KV cache budget (``kv_budget``; 0 = no bound).
    ``kv_layout``: the KV cache's layout (``kv_cache.LAYOUTS``; None: ``kv_cache.default_layout``, by the
    model's head dim and device).
    ``adapter``: a LoRA run's ``models.lora.EngineAdapter`` on ``model`` (built on it before this engine):
    ``update_weights`` then takes the adapter's tensors alone and applies them through it.
    ``token_entropy``: also give each token's sampling entropy (the ``entropy`` column; ``rollout.token_entropy``).
    ``linears``: the layers' matmuls (``kv_decoder.LINEAR_KERNELS``; ``rollout.engine_linears``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer_or_eos_id,
        device: str = "cpu",
        seed: int = 0,
        max_batch_groups: int = 16,
        version: int = -1,
        lean: bool = True,
        kv_cache_bytes: int = 0,
        adapter: Optional[EngineAdapter] = None,
        kv_layout: Optional[str] = None,
        on_weights: str = "recompute",
        token_entropy: bool = False,
        linears: str = "auto",
    ):
        if on_weights not in ON_WEIGHTS:
            raise ValueError(f"on_weights={on_weights!r}: expected one of {ON_WEIGHTS}")
        if max_batch_groups < 1:
            raise ValueError(f"max_batch_groups={max_batch_groups!r}: expected an integer >= 1")
        if kv_layout is not None and kv_layout not in LAYOUTS:
            raise ValueError(f"kv_layout={kv_layout!r}: expected one of {sorted(LAYOUTS)} or None (by the model)")
        if kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes!r}: expected >= 0 (0: no bound)")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.eos_id = _eos_id(tokenizer_or_eos_id)
        self.pad_id = 0  # any valid id: padded positions are masked out
        self.max_batch_groups = max_batch_groups
        self.version = version
        self.adapter = adapter
        self.gen = torch.Generator(self.device).manual_seed(seed)
        self.pending: list[_Group] = []
        self.live_ids: set[str] = set()  # group ids queued or generating
        self.cohorts: list[_Cohort] = []
        self.decoder = make_decoder(self.model, lean, linears)
        self.kv_layout = kv_layout or default_layout(self.model)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_positions = model.config.max_position_embeddings
        dtype_size = next(self.model.parameters()).element_size()
        self.kv_budget = KVBudget(bytes_per_position(model.config, dtype_size), kv_cache_bytes)
        self.kv_peak_bytes = 0  # the most bytes the live KV caches held between two steps
        self.update_split: dict[str, float] = {}  # the last update_weights: load_s (copy), recompute_s (KV)
        self.on_weights, self._hold = on_weights, False
        self.token_entropy = token_entropy

    # ---- the seam ------------------------------------------------------------------------------

    def add_request(self, req: GenRequest) -> None:
        req.validate()
        self._check_request(req)
        self.pending.append(_Group(req, [None] * req.n, [None] * req.n, req.n))
        self.live_ids.add(req.group_id)

    def has_work(self) -> bool:
        return bool(self.pending or self.cohorts)

    @torch.inference_mode()
    def step(self) -> list[TrajectoryBatch]:
        finished: list[TrajectoryBatch] = []
        for cohort in self.cohorts:
            finished += self._decode(cohort)
        self.cohorts = [c for c in self.cohorts if c.rows]
        if self._hold:  # on_weights=finish: the running rows drain under the old weights
            return finished
        return finished + self._admit_pending()  # new rows get their first token from the prefill

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Load ``state_dict`` as ``version``; recompute every running KV cache under it (``on_weights``
        "keep": keep the caches).

        The state dict is checked in full first (names and shapes); on a mismatch a ``ValueError``
        names the first bad key and nothing is loaded, so the engine keeps the old weights. With an
        ``adapter`` the state dict is the LoRA adapter's tensors (checked the same way)."""
        t0 = time.perf_counter()
        if self.adapter is not None:
            self.adapter.load(state_dict)
        else:
            params = _check_state_dict(self.model, state_dict)
            t0 = time.perf_counter()
            with torch.no_grad():
                _load(params, state_dict)
        self.version = version
        t1, stale = time.perf_counter(), self.cohorts if self.on_weights != "keep" else []
        with torch.inference_mode():
            for cohort in stale:
                self._recompute(cohort)
        self.update_split = {"load_s": t1 - t0, "recompute_s": time.perf_counter() - t1 if stale else 0.0}

    def in_flight(self) -> bool:
        return bool(self.cohorts)

    def hold_new(self, hold: bool) -> None:
        self._hold = hold

    def abort_groups(self, group_ids: list[str]) -> dict[str, int]:
        """Drop the groups ``group_ids`` (queued or running; unknown ids are ignored): {group id: output
        tokens its samples had generated}. The other rows of their cohorts go on undisturbed."""
        gone = set(group_ids) & self.live_ids
        if not gone:
            return {}
        out = {g.req.group_id: 0 for g in self.pending if g.req.group_id in gone}
        self.pending = [g for g in self.pending if g.req.group_id not in gone]
        for c in self.cohorts:
            out |= self._drop_rows(c, gone)
        self.cohorts = [c for c in self.cohorts if c.rows]
        self.live_ids -= gone
        return out

    def _drop_rows(self, c: _Cohort, gone: set[str]) -> dict[str, int]:
        """Remove the rows of the groups ``gone`` from ``c``; their tokens (rows in it, and samples already
        set aside) by group."""
        n_gen, out, keep = c.t["n_gen_B"].tolist(), {}, []
        for i, (g, s) in enumerate(c.rows):
            gid = g.req.group_id
            if gid not in gone:
                keep.append(i)
                continue
            if gid not in out:  # the group's finished samples that left the batch
                out[gid] = sum(x.output_ids.numel() for x in g.samples if x is not None)
            out[gid] += n_gen[i] if g.samples[s] is None else 0
        if len(keep) < len(c.rows):
            if keep:
                c.select(torch.tensor(keep, dtype=torch.long, device=self.device))
            else:
                c.rows = []
        return out

    def abort_all(self) -> list[TrajectoryBatch]:
        out: list[TrajectoryBatch] = []
        for cohort in self.cohorts:
            self._compact(cohort)  # every row left is running now
            out += self._finish_rows(cohort, list(range(len(cohort.rows))), ["abort"] * len(cohort.rows))
        for g in self.pending:
            out.append(group_output(g.req, [0] * g.req.n, [], [], [], ["abort"] * g.req.n))
        self.pending, self.cohorts = [], []
        self.live_ids.clear()
        return out

    # ---- admission and prefill -----------------------------------------------------------------

    def _check_request(self, req: GenRequest) -> None:
        if req.group_id in self.live_ids:
            raise ValueError(f"group_id {req.group_id!r} is already generating: expected a new id")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"GenRequest {req.group_id!r}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
            )
        limit = self.max_positions
        if len(req.prompt_ids) + req.max_new_tokens > limit:
            raise ValueError(
                f"GenRequest {req.group_id!r}: prompt ({len(req.prompt_ids)}) + max_new_tokens "
                f"({req.max_new_tokens}) > the model's max_position_embeddings={limit}"
            )
        self.kv_budget.check_group(req.group_id, len(req.prompt_ids), req.n, req.max_new_tokens)

    def kv_bytes(self) -> int:
        """Bytes the running cohorts' KV caches hold."""
        return sum(c.cache.nbytes for c in self.cohorts)

    def _admit_pending(self) -> list[TrajectoryBatch]:
        """Prefill queued groups in chunks of max_batch_groups (each row's first token is sampled
        from the prefill), then merge what still runs into running cohorts. With a KV budget, a
        chunk is cut to what fits beside the live caches; the rest waits for rows to finish."""
        cap, pending, self.pending = self.max_batch_groups, self.pending, []
        finished: list[TrajectoryBatch] = []
        while pending:
            chunk = pending[: self._admissible(pending[:cap])]
            if not chunk:
                break
            pending = pending[len(chunk) :]
            new, done = self._new_cohort(chunk)
            finished += done
            if new.rows:
                self._place(new, cap)
        self.pending = pending + self.pending
        self.kv_peak_bytes = max(self.kv_peak_bytes, self.kv_bytes())
        return finished

    def _admissible(self, groups: list[_Group]) -> int:
        shapes = [(len(g.req.prompt_ids), g.req.n, g.req.max_new_tokens) for g in groups]
        return self.kv_budget.admissible(self.kv_bytes(), shapes)

    def _place(self, new: _Cohort, cap: int) -> None:
        """Into a running cohort with room for its groups (when the merged copy fits the budget), else alone."""
        used = self.kv_bytes() + new.cache.nbytes
        host = next((c for c in self.cohorts if c.n_groups + new.n_groups <= cap), None)
        if host is not None and self.kv_budget.can_merge(used, host.cache.merged_nbytes(new.cache)):
            host.merge(new)
        else:
            self.cohorts.append(new)

    def _new_cohort(self, groups: list[_Group]) -> tuple[_Cohort, list[TrajectoryBatch]]:
        """Prefill each group's prompt once, repeat that cache row for its n samples and sample
        every row's first token from the prompt's last logits."""
        room = max(g.req.max_new_tokens for g in groups)
        cache, mask_GT, logits_GV = self._prefill([g.req.prompt_ids for g in groups], room, with_logits=True)
        n_G = torch.tensor([g.req.n for g in groups], device=self.device)
        rows_G = torch.repeat_interleave(torch.arange(len(groups), device=self.device), n_G)
        cache = cache.repeat_rows(rows_G)
        t = self._row_tensors(groups, rows_G)
        t["mask_BT"] = mask_GT.index_select(0, rows_G)
        mode = SamplingMode.of_requests([g.req for g in groups])
        cohort = _Cohort([(g, i) for g in groups for i in range(g.req.n)], t, cache, mode)
        return cohort, self._emit(cohort, logits_GV.index_select(0, rows_G))

    def _row_tensors(self, groups: list[_Group], rows_G: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row state: the token to feed next, its position, sampling params, output buffers."""
        dev, reqs = self.device, [g.req for g in groups]
        stops = [(self.eos_id, *r.stop_token_ids) for r in reqs]
        # one column more than the longest output: a finished row (still decoded, ignored) writes
        # its unused token at its frozen length, which is at most max_new_tokens
        S, W = max(map(len, stops)), max(r.max_new_tokens for r in reqs) + 1
        ints = [
            [r.prompt_ids[-1] for r in reqs],  # next_B: replaced by the first token
            [len(r.prompt_ids) for r in reqs],  # pos_B: where that token goes
            [r.max_new_tokens for r in reqs],  # max_new_B
        ]
        floats = [[float(r.temperature) for r in reqs], [float(r.top_p) for r in reqs]]
        # one tensor per dtype, its rows repeated for the samples at once; each field a row of it
        next_B, pos_B, max_new_B = torch.tensor(ints, device=dev).index_select(1, rows_G)
        temp_B, top_p_B = torch.tensor(floats, device=dev).index_select(1, rows_G)
        t = {
            "next_B": next_B,
            "pos_B": pos_B,
            "max_new_B": max_new_B,
            "temp_B": temp_B,
            "top_p_B": top_p_B,
            "greedy_B": torch.tensor([r.greedy for r in reqs], device=dev).index_select(0, rows_G),
            "stop_BW": torch.tensor([s + (-1,) * (S - len(s)) for s in stops], device=dev).index_select(0, rows_G),
        }
        B = len(rows_G)
        t["n_gen_B"] = torch.zeros(B, dtype=torch.long, device=dev)
        t["live_B"] = torch.ones(B, dtype=torch.bool, device=dev)  # False: finished, awaiting compact()
        t["out_BW"] = torch.zeros(B, W, dtype=torch.long, device=dev)
        t["logp_BW"] = torch.zeros(B, W, dtype=torch.float32, device=dev)
        t["ver_BW"] = torch.full((B, W), -1, dtype=torch.long, device=dev)
        if self.token_entropy:
            t["ent_BW"] = torch.zeros(B, W, dtype=torch.float32, device=dev)
        return t

    def _prefill(self, contexts: list[list[int]], room: int, with_logits: bool = False):
        """Left-padded forward of ``contexts`` (may be empty lists) -> (KV cache with ``room`` free
        columns, mask_BT), and with ``with_logits`` the logits at the last position (B, V) (every
        context non-empty then)."""
        B, T = len(contexts), max(map(len, contexts))
        ids_BT = torch.tensor(
            [[self.pad_id] * (T - len(c)) + list(c) for c in contexts], dtype=torch.long, device=self.device
        ).view(B, T)
        mask_BT = torch.tensor(
            [[0] * (T - len(c)) + [1] * len(c) for c in contexts], dtype=torch.long, device=self.device
        ).view(B, T)
        cache = KVCache.empty(self.model, B, T + room, self.kv_layout)
        if T == 0:  # all contexts empty (one-token prompts being recomputed): nothing to cache yet
            return cache, mask_BT
        pos_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)
        logits_BV = self.decoder.forward(ids_BT, pos_BT, mask_BT, cache, with_logits)
        return (cache, mask_BT, logits_BV) if with_logits else (cache, mask_BT)

    # ---- decoding ------------------------------------------------------------------------------

    def _decode(self, c: _Cohort) -> list[TrajectoryBatch]:
        """One single-token forward for every row of ``c``; sample; retire finished rows."""
        t = c.t
        assert t["mask_BT"].shape[1] == c.cache.T, "cohort mask and KV cache disagree"
        mask_BT = F.pad(t["mask_BT"], (0, 1), value=1)  # the new token's column
        logits_BV = self.decoder.forward(t["next_B"][:, None], t["pos_B"][:, None], mask_BT, c.cache, True)
        t["pos_B"], t["mask_BT"] = t["pos_B"] + 1, mask_BT
        return self._emit(c, logits_BV)

    def _emit(self, c: _Cohort, logits_BV: torch.Tensor) -> list[TrajectoryBatch]:
        """Sample every row's next token from ``logits_BV``, record it, retire finished rows."""
        t = c.t
        tok_B, logp_B = sample_tokens(logits_BV, t["temp_B"], t["top_p_B"], t["greedy_B"], self.gen, c.mode)
        # a finished row still in the batch (see _retire) keeps its length and writes its unused
        # token just past it (the buffers have a column to spare)
        col_B1 = t["n_gen_B"][:, None]
        t["out_BW"].scatter_(1, col_B1, tok_B[:, None])
        t["logp_BW"].scatter_(1, col_B1, logp_B[:, None])
        t["ver_BW"].scatter_(1, col_B1, self.version)
        if self.token_entropy:
            t["ent_BW"].scatter_(1, col_B1, token_entropy(logits_BV, t["temp_B"], t["greedy_B"])[:, None])
        t["n_gen_B"] += t["live_B"]
        t["next_B"] = tok_B
        return self._retire(c, tok_B)

    def _retire(self, c: _Cohort, tok_B: torch.Tensor) -> list[TrajectoryBatch]:
        """Finish the live rows that hit a stop token or their length. Finished rows stay in the
        batch (decoded, ignored, their outputs kept) until a quarter of it has finished: re-indexing
        the KV cache costs about as much as a decode step, so it is not done every time a row ends."""
        live_B, stop_BW = c.t["live_B"], c.t["stop_BW"]
        stop_B = tok_B == stop_BW[:, 0] if stop_BW.shape[1] == 1 else (tok_B[:, None] == stop_BW).any(1)
        done_B = live_B & (stop_B | (c.t["n_gen_B"] >= c.t["max_new_B"]))
        done = done_B.nonzero().squeeze(1).tolist()
        if not done:
            return []
        stopped = stop_B.tolist()
        finished = self._finish_rows(c, done, ["stop" if stopped[i] else "length" for i in done])
        live_B.masked_fill_(done_B, False)
        n_live = int(live_B.sum())
        if n_live == 0:  # the whole cohort ended: nothing to keep, no cache to re-index
            c.rows = []
        elif 4 * n_live <= 3 * len(c.rows):
            self._compact(c)
        return finished

    def _finish_rows(self, c: _Cohort, idx: list[int], reasons: list[str]) -> list[TrajectoryBatch]:
        """Record rows ``idx`` of ``c`` as finished for ``reasons``; return the groups this ends."""
        ended, row_of, live_ids = [], c.rows, self.live_ids
        for i, why in zip(idx, reasons):
            g, s = row_of[i]
            g.reasons[s] = why
            g.left -= 1
            if not g.left:
                ended.append(g)
                live_ids.discard(g.req.group_id)
        return self._outputs(c, ended) if ended else []

    def _outputs(self, c: _Cohort, ended: list[_Group]) -> list[TrajectoryBatch]:
        """The outputs of groups ``ended`` (all samples finished; their rows still in ``c``, but
        those set aside): one copy of all their rows' tokens, each group a slice of it."""
        in_batch = {id(g): sum(s is None for s in g.samples) for g in ended}  # rows each has in c
        if sum(in_batch.values()) == len(c.rows):
            idx = list(range(len(c.rows)))
        else:
            idx = [i for i, (g, _) in enumerate(c.rows) if id(g) in in_batch]
        lens, flats = self._rows_flat(c, idx)
        spans, start = [], 0
        while start < len(idx):  # a group's rows are adjacent in a cohort, in sample order
            g = c.rows[idx[start]][0]
            k = in_batch[id(g)]
            spans.append((g, start, k))
            start += k
        sizes = [sum(lens[a : a + k]) for _, a, k in spans]
        cols = [f.split_with_sizes(sizes) for f in flats]  # no Tensor.split wrapper
        out = []
        for (g, a, k), *parts in zip(spans, *cols):
            if k == len(g.samples):  # none set aside
                out.append(group_output(g.req, lens[a : a + k], *parts[:3], g.reasons, **_more(parts)))
            else:
                self._set_aside(c, idx[a : a + k], lens[a : a + k], parts)
                out.append(group_rows(g.samples))
        return out

    def _rows_flat(self, c: _Cohort, idx: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """Output lengths of rows ``idx`` of ``c`` and their generated ids, logprobs and versions,
        each field of all those rows end to end in one new CPU tensor of its column's dtype (``COLUMNS``)."""
        t = c.t
        whole = len(idx) == len(c.rows)  # idx is then every row in order
        rows = None if whole else torch.tensor(idx, dtype=torch.long, device=self.device)
        n_gen = t["n_gen_B"] if whole else t["n_gen_B"].index_select(0, rows)
        fields = [t[k] for k in ("out_BW", "logp_BW", "ver_BW", "ent_BW") if k in t]
        if not whole:
            fields = [x.index_select(0, rows) for x in fields]
        kept_RW = torch.arange(fields[0].shape[1], device=self.device)[None, :] < n_gen[:, None]
        # the kept cells' flat positions once, then one gather per field (a boolean index per field
        # would find them three times)
        flat = kept_RW.view(-1).nonzero().view(-1)
        dtypes = (COLUMNS["output_ids"], COLUMNS["logprobs"], COLUMNS["versions"], COLUMNS["entropy"])
        return n_gen.tolist(), [x.reshape(-1).index_select(0, flat).to("cpu", d) for x, d in zip(fields, dtypes)]

    def _set_aside(self, c: _Cohort, idx: list[int], lens: list[int], flats: list[torch.Tensor]) -> None:
        """Rows ``idx`` of ``c`` (finished) as their groups' rows: views of ``flats``."""
        make = sample_row
        for i, (o, lp, v, *more) in zip(idx, zip(*(f.split(lens) for f in flats))):
            g, s = c.rows[i]
            g.samples[s] = make(g.req, s, o, lp, v, g.reasons[s], **_more([o, lp, v, *more]))

    def _compact(self, c: _Cohort) -> None:
        """Drop ``c``'s finished rows; those of groups still running are set aside first."""
        live = c.t["live_B"].tolist()
        idx = [i for i, (g, _) in enumerate(c.rows) if not live[i] and g.left]
        if idx:
            self._set_aside(c, idx, *self._rows_flat(c, idx))
        c.compact()

    # ---- weight updates ------------------------------------------------------------------------

    def _recompute(self, c: _Cohort) -> None:
        """Replace ``c``'s KV cache by one prefilled under the current weights over
        prompt + generated tokens, all but the last token (which is fed by the next step)."""
        self._compact(c)
        n_gen, out = c.t["n_gen_B"].tolist(), c.t["out_BW"].tolist()
        seqs = [g.req.prompt_ids + out[i][: n_gen[i]] for i, (g, _) in enumerate(c.rows)]
        room = int((c.t["max_new_B"] - c.t["n_gen_B"]).max()) + 1
        c.cache, c.t["mask_BT"] = self._prefill([s[:-1] for s in seqs], room)


def _eos_id(tokenizer_or_eos_id) -> int:
    if isinstance(tokenizer_or_eos_id, int):
        return tokenizer_or_eos_id
    eos = getattr(tokenizer_or_eos_id, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ValueError(
            f"tokenizer_or_eos_id={tokenizer_or_eos_id!r}: expected an int or a tokenizer with an eos_token_id"
        )
    return eos


LOAD_PART_BYTES = 64 << 20  # a received version that can release its pages is copied this much at a time


def _load(params: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into the model's tensors: one ``_foreach_copy_`` for all (no Python work per
    parameter), or, when the state dict can give back the pages of what was copied (``release``: a version
    received over shm, ``transport/shm_weights.Received``), one per ~64 MiB part, each part's pages released
    after it, so a load maps one part of the new version at a time beside the weights it replaces."""
    names = [n for n in params if n in state_dict]
    release = getattr(state_dict, "release", None)
    if release is None:
        torch._foreach_copy_([params[n] for n in names], [state_dict[n] for n in names])
        return
    part, size = [], 0
    for i, n in enumerate(names):
        part, size = part + [n], size + state_dict[n].numel() * state_dict[n].element_size()
        if size >= LOAD_PART_BYTES or i == len(names) - 1:
            torch._foreach_copy_([params[m] for m in part], src := [state_dict[m] for m in part])
            release(src)
            part, size = [], 0


def _check_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return the model's state tensors by name after checking ``sd`` matches them.

    A key may be missing only when it aliases (shares storage with) a key that is present:
    tied embeddings appear under two names in ``model.state_dict()``.
    """
    params = model.state_dict(keep_vars=True)
    unexpected = sorted(set(sd) - set(params))
    if unexpected:
        raise ValueError(
            f"state dict key {unexpected[0]!r} is not a weight of the model "
            f"(expected names like {next(iter(params))!r})"
        )
    present_ptrs = {params[k].data_ptr() for k in sd}
    for name, p in params.items():
        if name not in sd and p.data_ptr() not in present_ptrs:
            raise ValueError(f"state dict is missing weight {name!r} (shape {tuple(p.shape)})")
        if name in sd and tuple(sd[name].shape) != tuple(p.shape):
            raise ValueError(f"state dict weight {name!r} has shape {tuple(sd[name].shape)}, expected {tuple(p.shape)}")
    return params
