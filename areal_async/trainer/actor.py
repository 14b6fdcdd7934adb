"""The PPO actor: one trainer step from a batch of trajectories to updated weights.

    train_step(trajs)
      |- rewards -> advantages               (advantages.py; KL penalty only when kl_ctl > 0)
      |- proximal logprobs, no grad          (when recompute_logprob; each rank its share, gathered;
      |                                       with one minibatch on one rank they are the update's own
      |                                       forward, detached: see PPOActor._prox_from_update)
      |- for each of ppo_n_minibatches:      (balanced by tokens; one optimizer step each)
      |    global token count N              (every output token of the minibatch on every rank,
      |                                       rejected ones included)
      |    for each packed micro-batch:      forward, loss = sum(token losses) / N, backward
      |    clip grads, optimizer step        (skipped: grad norm not finite, or no token kept)
      '- lr schedule step, step += 1

Forward ahead (``forward_ahead``, then ``train_step(trajs, ahead=...)``): the update's first
micro-batch forward run before the step's scores are known, when nothing in it needs them (one
PPO minibatch, no KL penalty, one rank, the proximal logprobs from the update's own forward or not
used). The trainer worker runs it at eta = 0 while the rewards are scored; the step is then the
same computation on the same weights, its first forward already done.

Covered: the update on one process or on K data-parallel ranks (``compute/dp.py``: FSDP2, the batch
split over ranks by tokens, one global N, so K ranks take the same step as one), its metrics
(merged over ranks), and its resumable state (optimizer + lr scheduler + step; the weights are
saved by ``persist/checkpoint.py``). Every rank calls ``train_step`` with the same trajectories.
Not covered: weight publication (the trainer worker gathers shards for it).
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from areal_async.config import ActorConfig
from areal_async.models import lora
from areal_async.trainer.algo.advantages import advantages_flat, scaled_rewards
from areal_async.trainer.algo.corrections import m2po_keep, masked_block
from areal_async.trainer.compute.dp import (
    DataParallel,
    ShardedWeights,
    minibatches_by_tokens,
    rank_micro_batches,
    shard_model,
    split_over_ranks,
)
from areal_async.trainer.compute.logprobs import MicroBatchOut, iter_micro_batches, ranges, tail_index
from areal_async.trainer.algo.loss import LossStats, agg_scale, count_kept_tokens, loglinear_prox, policy_loss
from areal_async.trainer.algo.mismatch import GapCollector, mismatch_metrics
from areal_async.trainer.compute.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from areal_async.trainer.compute.packing import PackedBatch, forward_packed, pack, runs_lean
from areal_async.trainer.compute.shared_prefix import allocate_runs, prompt_runs, share_prefixes
from protocols.trajectories import Trajectory, TrajectoryBatch

ModelOrLoader = Union[torch.nn.Module, Callable[[], torch.nn.Module]]


class ForwardAhead:
    """The update's micro-batches for ``sample_ids`` (in this order), the first one's forward
    done (its graph held: one micro-batch's activations, as during the update), taken at actor
    step ``step``. Good for one ``train_step`` at that step on these samples in this order."""

    def __init__(self, sample_ids: list[str], step: int, batch: "_Batch", micro_batches: Iterator):
        self.sample_ids, self.step, self.batch, self.micro_batches = sample_ids, step, batch, micro_batches


class _Batch:
    """One trainer step's trajectories: their sequences, and per output token (laid end to end
    in trajectory order, all on the actor's device) behaviour logprobs, loss mask, proximal
    logprobs and advantages. The per-token inputs are the columns of the one trajectory type
    (``TrajectoryBatch.of_samples``: views of a message's when the rows lie end to end in it, else
    one copy), in their declared dtypes."""

    def __init__(self, trajs: Sequence[Trajectory], device: torch.device, share_prompts: bool = False):
        cols = TrajectoryBatch.of_samples(trajs)
        self.seqs = [t.seq_parts for t in trajs]  # (prompt, output) tensors: pack copies each token once
        # a group's samples share their prompt in the forward (actor.share_prompts): group ids to find the runs
        self.keys = (
            [t.group_id if type(s) is tuple else None for t, s in zip(trajs, self.seqs)] if share_prompts else None
        )
        self.n_prompt = [t.prompt_ids.numel() for t in trajs]
        self.n_out = cols.lengths
        self.lengths = [p + o for p, o in zip(self.n_prompt, self.n_out)]
        self.out_start = np.cumsum([0] + self.n_out[:-1], dtype=np.int64)
        self.behav = cols.logprobs.to(device)  # float32 from the engine on
        # trained output tokens (a workflow's environment tokens are not): bool per output token
        mask = cols.loss_mask
        self.mask = torch.ones(self.behav.numel(), dtype=torch.bool, device=device) if mask is None else mask.to(device)
        self.versions = cols.versions  # int32 per output token, on the host (prox_logp_method=loglinear)
        self.entropy = cols.entropy  # the engine's (rollout.token_entropy), NaN for a row without; or None
        self.prox: Optional[torch.Tensor] = None
        self.adv: Optional[torch.Tensor] = None
        self.ref: Optional[torch.Tensor] = None  # reference logprobs, kept for kl_in='loss'
        self.scale: Optional[torch.Tensor] = None  # per-token loss coefficients (loss_agg_mode other than token-mean)
        self.m2keep: Optional[torch.Tensor] = None  # M2PO's kept tokens (actor.m2_threshold), set per minibatch
        self.n_m2po = 0  # tokens M2PO took out of the loss, every minibatch
        self._all = list(range(len(trajs)))
        self._packed: dict[tuple[int, ...], PackedBatch] = {}
        self.update_tokens = 0  # tokens the update's forwards ran through the layers (fewer with shared prompts)

    def packed(self, indices: Sequence[int], count: bool = False) -> PackedBatch:
        """The sequences ``indices`` packed, kept for the step: the proximal recompute and the
        update run the same micro-batches (one rank, one PPO minibatch). ``count``: an update's
        micro-batch, its tokens through the layers added to ``update_tokens``."""
        if count:
            self.update_tokens += self.packed(indices).layer_tokens
        key = tuple(indices)
        if key not in self._packed:
            p = pack([self.seqs[i] for i in indices])
            # the lm head runs only where an output token is scored (what MicroBatchOut.tails reads)
            p.scored_T = tail_index(p.cu_seqlens, [self.n_prompt[i] - 1 for i in indices])
            runs = self.prompt_runs(indices)
            if len(runs) < len(indices):
                n_prompt, n_out = [self.n_prompt[i] for i in indices], [self.n_out[i] for i in indices]
                p.shared = share_prefixes(p.ids_T, p.position_ids_T, n_prompt, n_out, runs)
            self._packed[key] = p
        return self._packed[key]

    def prompt_runs(self, indices: Sequence[int]) -> list[int]:
        """The runs of ``indices`` that share their prompt (``shared_prefix.prompt_runs``); ones without sharing."""
        if self.keys is None:
            return [1] * len(indices)
        keys = [self.keys[i] for i in indices]  # None: a segmented sequence (never shared, no prompt part to read)
        return prompt_runs(keys, [self.seqs[i][0] if k is not None else None for i, k in zip(indices, keys)])

    def allocation(self, indices: Sequence[int], budget: int, oversize: str) -> list[list[int]]:
        """Micro-batches of ``indices`` under the token budget, whole runs of a shared prompt each."""
        n_prompt, n_out = [self.n_prompt[i] for i in indices], [self.n_out[i] for i in indices]
        mbs = allocate_runs(self.prompt_runs(indices), n_prompt, n_out, budget, oversize)
        return [[indices[j] for j in mb] for mb in mbs]

    def token_index(self, indices: Sequence[int]) -> Optional[torch.Tensor]:
        """Positions of the output tokens of trajectories ``indices`` (in that order) in the
        per-token tensors; None when that is all of them in order (no gather needed)."""
        if list(indices) == self._all:
            return None
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(ranges(self.out_start[idx], np.asarray(self.n_out, dtype=np.int64)[idx]))

    def cat(self, name: str, indices: Sequence[int], where: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The per-token tensor ``name`` at the output tokens of ``indices`` (``where``: their
        ``token_index``, when the caller has it)."""
        values = getattr(self, name)
        if values is None:
            return None
        where = self.token_index(indices) if where is None else where
        return values if where is None else values.index_select(0, where.to(values.device))


def rollout_entropy(entropy: Optional[torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """The engine's mean token entropy (its ``entropy`` column; None: no metric) over the trained tokens
    (``mask``), beside the trainer's own ``entropy``: a gap between them is the engine and the trainer
    disagreeing. A row without the column beside rows with it has NaN there: left out."""
    ent = torch.empty(0) if entropy is None else entropy[mask.to(entropy.device)]
    ent = ent[~ent.isnan()]
    return {"rollout_entropy": float(ent.mean())} if ent.numel() else {}


def enable_checkpointing(model: torch.nn.Module) -> None:
    """``actor.gradient_checkpointing``: HF's per-layer activation checkpointing (non-reentrant), which
    the lean forward honours too (``lean_forward.lean_hidden``); ``ValueError`` for a model without it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"actor.gradient_checkpointing=true: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class PPOActor:
    """Owns the policy's optimizer and schedule; ``train_step`` is one RL trainer step."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ActorConfig,
        temperature: float,
        total_steps: int,
        device: str | torch.device = "cpu",
        ref_model: Optional[ModelOrLoader] = None,
        dp: Optional[DataParallel] = None,
        compute_dtype: Optional[torch.dtype] = None,
        max_new_tokens: Optional[int] = None,
        eos_token_ids: Sequence[int] = (),
    ):
        """``dp``: this process's trainer rank (default: the only one). ``compute_dtype``: shard the
        policy with FSDP2 (needs an initialised process group, even of one rank) and keep float32
        master weights and optimizer state while forward/backward run in this dtype; None keeps
        the model as given (and is only allowed with one rank). ``max_new_tokens`` (gconfig's) and
        ``eos_token_ids``: what the length-aware objective keys judge an output by (a sample of
        max_new_tokens tokens not ending in one of ``eos_token_ids`` was cut: no eos)."""
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: expected > 0 (the rollout's sampling temperature)")
        if cfg.use_decoupled_loss and not cfg.recompute_logprob:
            raise ValueError(
                "use_decoupled_loss=True needs recompute_logprob=True (the proximal policy's "
                "logprobs); got recompute_logprob=False"
            )
        if cfg.kl_ctl > 0 and ref_model is None:
            raise ValueError(f"kl_ctl={cfg.kl_ctl} > 0 needs a reference model (or a loader); got None")
        uses_length = cfg.overlong_reward_penalty or cfg.mask_no_eos_with_zero or cfg.loss_agg_mode.endswith("-norm")
        if uses_length and not max_new_tokens:
            raise ValueError(
                "overlong_reward_penalty, mask_no_eos_with_zero and loss_agg_mode=seq-mean-token-sum-norm need "
                f"max_new_tokens (gconfig.max_new_tokens); got {max_new_tokens!r}"
            )
        self.max_new_tokens, self.eos_token_ids = max_new_tokens, frozenset(int(i) for i in eos_token_ids)
        self.device = torch.device(device)
        self.dp = dp or DataParallel.single()
        if self.dp.active and compute_dtype is None:
            raise ValueError(f"{self.dp.world} trainer ranks need compute_dtype (FSDP2 sharding); got None")
        self.sharded, self.compute_dtype = compute_dtype is not None, compute_dtype
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
        self.model = shard_model(model, compute_dtype, self.device) if self.sharded else model.to(self.device)
        self.cfg = cfg
        self.temperature = temperature
        # frozen parameters (a LoRA run's base model: models/lora.py) get no optimizer state
        self.optimizer = build_optimizer((p for p in self.model.parameters() if p.requires_grad), cfg.optimizer)
        self.lora = bool(lora.adapter_params(self.model))  # the model carries LoRA layers
        self.lr_scheduler = build_lr_scheduler(self.optimizer, total_steps, cfg.optimizer)
        self.step = 0
        self.skipped_indices: list[int] = []  # of the last train_step's trajectories: not trained
        self._gaps = GapCollector()  # proximal vs behaviour per token, when the update makes the proximal
        # boba runs kl_ctl = 0: keep no reference model around at all then
        self._ref_source = ref_model if cfg.kl_ctl > 0 else None
        self._ref: Optional[torch.nn.Module] = None
        self.prox_from_update = self._prox_from_update()

    def _prox_from_update(self) -> bool:
        """Whether the proximal logprobs are taken from the update's own forward (detached) instead
        of a forward of their own: the same numbers when every micro-batch of the update runs on
        the step's starting weights (one PPO minibatch: the only optimizer step comes after them),
        nothing needs them before the update (no KL penalty in the advantages), no rank needs
        another's (one rank: rejection is counted locally) and the forward is the same in train
        mode (no dropout)."""
        if not self.cfg.recompute_logprob or self.cfg.ppo_n_minibatches != 1 or self.cfg.kl_ctl > 0:
            return False
        if self.cfg.m2_threshold is not None:  # M2PO masks the minibatch before its update
            return False
        if self.cfg.prox_logp_method == "loglinear":  # the proximal logprobs are approximated instead
            return False
        cfg = getattr(self.model, "config", None)
        dropout = float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0 or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()
        )
        return not self.dp.active and not dropout

    # ---------------------------------------------------------------------------------------
    # public API
    # ---------------------------------------------------------------------------------------

    @property
    def shares_prompts(self) -> bool:
        """``actor.share_prompts`` where it applies: the lean forward runs the model (``shared_prefix``), one rank."""
        return self.cfg.share_prompts and not self.dp.active and runs_lean(self.model)

    @property
    def can_forward_ahead(self) -> bool:
        """Whether the update's first forward can run before the scores are known: one PPO minibatch
        (its forward runs on the step's starting weights), no KL penalty (the advantages need no
        forward of their own), one rank (the others would need the batch) and no proximal forward
        of its own (it comes from the update's, or is not recomputed)."""
        return (
            self.cfg.ppo_n_minibatches == 1 and self.cfg.kl_ctl == 0 and not self.dp.active and not self._prox_forward
        )

    @property
    def _prox_forward(self) -> bool:
        """Whether the step runs a proximal forward of its own (not from the update, not approximated)."""
        return self.cfg.recompute_logprob and not self.prox_from_update and self.cfg.prox_logp_method == "recompute"

    def forward_ahead(self, trajs: Sequence[Trajectory]) -> ForwardAhead:
        """The update's first micro-batch forward on ``trajs`` (their scores are not read), for
        ``train_step(trajs', ahead=...)`` with the same samples in the same order, scored, before
        any other step. Raises when ``can_forward_ahead`` is false."""
        if not self.can_forward_ahead:
            raise ValueError(
                "forward_ahead needs ppo_n_minibatches=1, kl_ctl=0, one trainer rank and the proximal "
                f"logprobs from the update's forward (got ppo_n_minibatches={self.cfg.ppo_n_minibatches}, "
                f"kl_ctl={self.cfg.kl_ctl}, {self.dp.world} rank(s), recompute_logprob="
                f"{self.cfg.recompute_logprob}, proximal from the update: {self.prox_from_update})"
            )
        if not trajs:
            raise ValueError("forward_ahead got no trajectories; expected a non-empty batch")
        batch = _Batch(trajs, self.device, self.shares_prompts)
        self.model.train()
        micro_batches = self._update_micro_batches(batch, list(range(len(trajs))))
        first = next(micro_batches)  # the forward: the rest of the micro-batches run in the update
        return ForwardAhead([t.sample_id for t in trajs], self.step, batch, itertools.chain([first], micro_batches))

    def train_step(self, trajs: Sequence[Trajectory], ahead: Optional[ForwardAhead] = None) -> dict[str, float]:
        """One trainer step; returns its metrics (means over tokens unless named otherwise).
        ``ahead``: this step's ``forward_ahead`` on the same samples in the same order.
        ``skipped_indices`` then holds the indices (into ``trajs``) of the samples whose
        minibatch's optimizer step was skipped (``_update``): they were not trained."""
        if not trajs:
            raise ValueError("train_step got no trajectories; expected a non-empty batch")
        if ahead is not None:
            ids = [t.sample_id for t in trajs]
            if ahead.step != self.step or ahead.sample_ids != ids:
                raise ValueError(
                    f"forward ahead of step {ahead.step} on {len(ahead.sample_ids)} samples "
                    f"({ahead.sample_ids[:3]}...) does not match step {self.step} on {len(ids)} samples "
                    f"({ids[:3]}...); expected the same step and the same samples in the same order"
                )
        batch = self._prepare(trajs, ahead.batch if ahead is not None else None)
        stats, grad_norms, n_mb, skipped = LossStats(), [], 0, 0
        self.skipped_indices, self._gaps = [], GapCollector()
        for idx in minibatches_by_tokens(batch.lengths, self.cfg.ppo_n_minibatches):
            mb_stats, grad_norm, n, stepped = self._update(batch, idx, ahead.micro_batches if ahead else None)
            stats, n_mb, skipped = stats.merge(mb_stats), n_mb + n, skipped + (not stepped)
            grad_norms.append(grad_norm)
            if not stepped:  # this minibatch's samples moved no weight: not trained
                self.skipped_indices += idx
        stats = self.dp.sum_stats(stats)
        lr = self.optimizer.param_groups[0]["lr"]
        self._advance_schedule()
        self.step += 1
        m = self._metrics(trajs, batch, stats, grad_norms, n_mb, lr)
        m["skipped_steps"] = float(skipped)
        m["optimizer_steps"] = float(len(grad_norms) - skipped)
        m["masked_tokens"] = float((~batch.mask).sum())  # workflow env tokens, not trained
        m |= masked_block(float(batch.mask.sum()), stats.n_rejected, float(batch.n_m2po))
        return m | self._mismatch(batch) | rollout_entropy(batch.entropy, batch.mask)

    def _mismatch(self, batch: _Batch) -> dict[str, float]:
        """trainer/algo/mismatch.py's columns: over the whole batch when its proximal logprobs were computed
        apart (every rank has them all), else over the tokens of this rank's micro-batches."""
        if batch.prox is None:
            return self._gaps.metrics()
        return mismatch_metrics(batch.prox, batch.behav, (self.step - 1) - batch.versions.long(), batch.mask)

    def state_dict(self, with_optimizer: bool = True) -> dict:
        """Optimizer (unless saved apart, as DCP shards: ``persist/sharded_ckpt.py``), lr schedule, step."""
        out = {"lr_scheduler": self.lr_scheduler.state_dict(), "step": self.step}
        return out | {"optimizer": self.optimizer.state_dict()} if with_optimizer else out

    def load_state_dict(self, state: dict) -> None:
        missing = {"lr_scheduler", "step"} - set(state)
        if missing:
            raise ValueError(
                f"actor state lacks {sorted(missing)}; expected keys lr_scheduler, step (and optimizer "
                "unless the checkpoint holds DCP shards)"
            )
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step = int(state["step"])

    def publish_state(self, dtype: torch.dtype, bucket_bytes: int):
        """What the weight channel publishes: the state dict in ``dtype`` (the adapter's tensors alone
        when the model carries LoRA layers), gathered from the shards a bucket at a time when sharded
        (every rank must then gather too: ``ShardedWeights``)."""
        state = lora.adapter_params(self.model) if self.lora else None
        if self.sharded:
            return ShardedWeights(self.model, dtype, bucket_bytes, state)
        return {
            k: v.detach() if not v.is_floating_point() or v.dtype == dtype else v.detach().to(dtype)
            for k, v in (state or self.model.state_dict()).items()
        }

    def full_state(self) -> dict[str, torch.Tensor]:
        """The policy's whole state dict under the HF names (a LoRA run's: the adapter merged in); one rank."""
        if self.lora:
            return lora.merged_state(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    @property
    def ref_model(self) -> Optional[torch.nn.Module]:
        """The frozen reference model, loaded on first use and only when kl_ctl > 0."""
        if self._ref is None and self._ref_source is not None:
            src = self._ref_source
            ref = (src if isinstance(src, torch.nn.Module) else src()).eval().requires_grad_(False)
            # sharded like the policy (every rank loads it here, at the same step): its forwards are collectives
            self._ref = shard_model(ref, self.compute_dtype, self.device) if self.sharded else ref.to(self.device)
        return self._ref

    # ---------------------------------------------------------------------------------------
    # steps of train_step
    # ---------------------------------------------------------------------------------------

    def _prepare(self, trajs: Sequence[Trajectory], batch: Optional[_Batch] = None) -> _Batch:
        """``batch``: these trajectories' (built ahead); its advantages are set here from their scores."""
        batch = _Batch(trajs, self.device, self.shares_prompts) if batch is None else batch
        if self._prox_forward:
            batch.prox = self._output_logprobs(self.model, batch)
        ref = self._output_logprobs(self.ref_model, batch) if self.cfg.kl_ctl > 0 else None
        lengths = dict(max_new_tokens=self.max_new_tokens, truncated=[self._truncated(t) for t in trajs])
        if self.cfg.kl_ctl > 0 and self.cfg.kl_in == "reward":  # per-token penalties: per-trajectory logprobs
            old = batch.prox if batch.prox is not None else batch.behav
            old_seq, ref_seq = (list(x.cpu().split(batch.n_out)) for x in (old, ref))
            batch.adv = advantages_flat(trajs, self.cfg, old_seq, ref_seq, **lengths).to(self.device)
        else:
            batch.ref = ref
            batch.adv = advantages_flat(trajs, self.cfg, **lengths).to(self.device)
        return batch

    def _truncated(self, t: Trajectory) -> bool:
        """Cut by the generation budget: max_new_tokens tokens, the last not an eos (unknown budget: False)."""
        if not self.max_new_tokens or t.output_ids.numel() < self.max_new_tokens:
            return False
        return int(t.output_ids[-1]) not in self.eos_token_ids

    @torch.no_grad()
    def _output_logprobs(self, model: torch.nn.Module, batch: _Batch) -> torch.Tensor:
        """Output-token logprobs of every sequence (per-token layout): each rank computes its
        share, then all gather."""
        was_training = model.training
        model.eval()
        shares = split_over_ranks(batch.lengths, self.dp.world)
        mine: dict[int, torch.Tensor] = {}
        out = torch.empty(batch.behav.numel(), dtype=torch.float32, device=self.device)
        for mb in self._rank_micro_batches(model, batch, shares, grad=False):
            # output token j sits at position P+j and is scored by position P+j-1
            lp = mb.tails([batch.n_prompt[i] - 1 for i in mb.indices])[0].float()
            if self.dp.active:
                mine.update(zip(mb.indices, lp.split([batch.n_out[i] for i in mb.indices])))
            else:
                where = batch.token_index(mb.indices)
                out = lp if where is None else out.index_copy_(0, where.to(out.device), lp)
        model.train(was_training)
        if not self.dp.active:
            return out
        return torch.cat(self.dp.all_gather_per_seq(mine, shares, batch.n_out)).to(self.device)

    def _rank_micro_batches(self, model: torch.nn.Module, batch: _Batch, shares: list[list[int]], grad: bool):
        """This rank's packed micro-batches (MicroBatchOut with batch indices), then as many
        zero-loss padding forwards (and backwards when ``grad``) as it takes to run the same
        count as the busiest rank: FSDP's gathers and reductions are collectives."""
        mb = self.cfg.mb_spec
        if batch.keys is not None:  # prompts shared (one rank): micro-batches of whole runs
            own, n_mb = batch.allocation(shares[0], mb.max_tokens_per_mb, mb.oversize), 0
        else:
            per_rank, n_mb = rank_micro_batches(batch.lengths, shares, mb.max_tokens_per_mb, mb.oversize)
            own = per_rank[self.dp.rank]
        share = shares[self.dp.rank]
        pos = {i: j for j, i in enumerate(share)}
        alloc = [[pos[i] for i in m] for m in own]
        for out in iter_micro_batches(
            model,
            [batch.seqs[i] for i in share],
            self.temperature,
            mb.max_tokens_per_mb,
            mb.oversize,
            with_entropy=grad,
            entropy_grad=self.cfg.entropy_coef != 0,
            allocation=alloc,
            packer=lambda mb: batch.packed([share[j] for j in mb], count=grad),
            chunk_tokens=self.cfg.logits_chunk_tokens,
            whole_max_bytes=self.cfg.logits_whole_max_mb << 20,
        ):
            yield MicroBatchOut([share[j] for j in out.indices], out.logp_T, out.entropy_T, out.cu_seqlens)
        for _ in range(n_mb - len(own)):
            self._padding_pass(model, grad)

    @staticmethod
    def _padding_pass(model: torch.nn.Module, grad: bool) -> None:
        logp_T, _ = forward_packed(model, pack([[0, 0]]))
        if grad:
            (logp_T.sum() * 0.0).backward()

    def _advance_schedule(self) -> None:
        # LambdaLR computes lr from its step counter, so advancing after a skipped optimizer
        # step loses nothing; torch's order warning does not apply
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.lr_scheduler.step()

    def _update_micro_batches(self, batch: _Batch, idx: list[int]) -> Iterator[MicroBatchOut]:
        """The minibatch ``idx``'s micro-batches with grad, each forward run when it is taken."""
        shares = [[idx[j] for j in s] for s in split_over_ranks([batch.lengths[i] for i in idx], self.dp.world)]
        return self._rank_micro_batches(self.model, batch, shares, grad=True)

    def _update(
        self, batch: _Batch, idx: list[int], micro_batches: Optional[Iterator[MicroBatchOut]] = None
    ) -> tuple[LossStats, float, int, bool]:
        """One optimizer step on the minibatch ``idx``: (stats, grad norm, micro-batches, stepped).
        ``micro_batches``: its ``_update_micro_batches``, started ahead.

        No step when the grad norm is not finite, nor when every token was rejected (AdamW
        would still move the weights by momentum and weight decay)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # the grads are None here: forwards ahead keep none
        where = batch.token_index(idx)
        mask = self._m2po(batch, idx, where)
        n_tokens = int(mask.sum())  # the loss denominator: rejected tokens stay in it (M2PO's leave it)
        seq_lens = [batch.n_out[i] for i in idx]
        if self.cfg.loss_agg_mode != "token-mean":
            self._set_scale(batch, where, agg_scale(mask, seq_lens, self.cfg.loss_agg_mode, self.max_new_tokens))
        prox_in_update = batch.prox is None and self.cfg.recompute_logprob
        if not prox_in_update:
            n_kept = count_kept_tokens(
                batch.cat("prox", idx, where), batch.cat("behav", idx, where), self.cfg, mask, seq_lens
            )
        stats, n_mb = LossStats(), 0
        for mb in micro_batches if micro_batches is not None else self._update_micro_batches(batch, idx):
            loss, s = self._micro_loss(batch, mb.indices, mb, n_tokens)
            loss.backward()
            stats, n_mb = stats.merge(s), n_mb + 1
        if prox_in_update:  # proximal logprobs from this update's forwards (or approximated from them)
            n_kept = int(stats.n_loss_tokens)
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optimizer.gradient_clipping)
        stepped = n_kept > 0 and math.isfinite(grad_norm)
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats, grad_norm, n_mb, stepped

    def _m2po(self, batch: _Batch, idx: list[int], where: Optional[torch.Tensor]) -> torch.Tensor:
        """The minibatch's trained tokens, less those M2PO masks (``actor.m2_threshold``; kept in
        ``batch.m2keep`` for the micro-batches, counted in ``batch.n_m2po``)."""
        mask = batch.cat("mask", idx, where)
        if self.cfg.m2_threshold is None:
            return mask
        keep = m2po_keep(batch.cat("behav", idx, where), batch.cat("prox", idx, where), mask, self.cfg.m2_threshold)
        batch.n_m2po += int((mask & ~keep).sum())
        if where is None:
            batch.m2keep = keep
        else:
            if batch.m2keep is None:
                batch.m2keep = torch.zeros_like(batch.mask)
            batch.m2keep.index_copy_(0, where.to(keep.device), keep)
        return keep

    def _micro_loss(
        self, batch: _Batch, traj_idx: list[int], mb: MicroBatchOut, n_tokens: int
    ) -> tuple[torch.Tensor, LossStats]:
        # output token j sits at position P+j and is scored by position P+j-1
        logp, entropy = mb.tails([batch.n_prompt[i] - 1 for i in traj_idx])
        where = batch.token_index(traj_idx)
        prox = batch.cat("prox", traj_idx, where)
        behav = batch.cat("behav", traj_idx, where)
        if prox is None and self.cfg.recompute_logprob and self.cfg.prox_logp_method == "loglinear":
            prox = loglinear_prox(behav, logp, batch.cat("versions", traj_idx, where), self.step)
        elif prox is None and self.cfg.recompute_logprob:  # prox_from_update: these weights are the proximal policy
            prox = logp.detach().float()
        if prox is not None and batch.prox is None:
            lags = self.step - batch.cat("versions", traj_idx, where).long()
            self._gaps.add(prox, behav, lags, batch.cat("mask", traj_idx, where))
        return policy_loss(
            logp,
            prox,
            behav,
            batch.cat("adv", traj_idx, where),
            self.cfg,
            n_tokens=n_tokens,
            entropy=entropy,
            loss_mask=batch.cat("mask" if batch.m2keep is None else "m2keep", traj_idx, where),
            scale=batch.cat("scale", traj_idx, where),
            seq_lens=[batch.n_out[i] for i in traj_idx],
            ref_logp=batch.cat("ref", traj_idx, where),
        )

    @staticmethod
    def _set_scale(batch: _Batch, where: Optional[torch.Tensor], scale: torch.Tensor) -> None:
        """Store a minibatch's per-token loss coefficients at its tokens (``where``; None = all of them)."""
        if where is None:
            batch.scale = scale
            return
        if batch.scale is None:
            batch.scale = torch.zeros(batch.behav.numel(), dtype=scale.dtype, device=scale.device)
        batch.scale.index_copy_(0, where.to(scale.device), scale)

    def _metrics(
        self, trajs, batch: _Batch, stats: LossStats, grad_norms: list[float], n_mb: int, lr: float
    ) -> dict[str, float]:
        adv = batch.adv
        rewards = scaled_rewards([t.score for t in trajs], self.cfg.reward_bias, self.cfg.reward_scaling)
        m = stats.as_dict()
        m["loss"] = stats.loss / len(grad_norms)  # each minibatch's loss is already a token mean
        finite = [g for g in grad_norms if math.isfinite(g)]
        m.update(
            grad_norm=sum(finite) / len(finite) if finite else float("nan"),
            lr=float(lr),
            score_mean=sum(t.score for t in trajs) / len(trajs),
            reward_mean=float(rewards.mean()),
            adv_mean=float(adv.mean()),
            adv_std=float(adv.std()) if adv.numel() > 1 else 0.0,
            n_tokens=float(adv.numel()),
            n_seqs=float(len(trajs)),
            n_microbatches=float(n_mb),
            n_layer_tokens=float(batch.update_tokens),
            step=float(self.step),
        )
        return m
