"""PPO policy loss with token-level normalization and the decoupled (three-policy) objective.

Covered:
- the clipped surrogate max(-A*r, -A*clip(r, 1-eps, 1+eps)) per token;
- token-level normalization: sum over every loss token of the batch / number of loss tokens
  (NOT a per-sequence mean: a 100-token sequence weighs 10x a 10-token one). Under gradient
  accumulation the caller passes the global token count of the minibatch as ``n_tokens``;
- decoupled PPO (behaviour / proximal / current): r = exp(logp - prox_logp), each token weighted
  by w = exp(prox_logp - behav_logp); rejection by ``rejection_sampling`` ('mask' zeroes the
  loss of tokens with w > upper but keeps them in the token count, as AReaL's
  ``ppo_actor_loss_fn`` does: dropping them from the count would up-weight the survivors of a
  staler batch; 'clamp' clips w at upper);
- plain PPO: r = exp(logp - old_logp), old = prox if recompute_logprob else behaviour;
- an optional entropy bonus, and summable statistics (``LossStats``) so micro-batches merge
  exactly.

- the objective keys (config/objective.py): clip-higher (upper clip 1 + eps_clip_higher), dual
  clip (token loss capped at c_clip * |A|, AReaL's ``ppo_actor_loss_fn``), GSPO
  (``importance_sampling_level=sequence``: the ratio exp(mean over the sequence's kept tokens of
  log r) and the sequence's mean advantage on every token, as AReaL's
  ``_compute_sequence_level_ratio_and_advantages``), sequence-level rejection (the sequence
  judged and weighted by exp(mean log w)), TIS (w truncated at ``behav_imp_weight_cap``), a
  KL term in the loss (k1/k2/k3) and the loss aggregation modes through per-token scales
  (``agg_scale``; verl's ``agg_loss``, Dr.GRPO's constant normaliser as TRL's ``dr_grpo``);
- AReaL's log-linear proximal approximation (``loglinear_prox``).

Not covered: value losses (no critic), SAPO. M2PO's mask is ``corrections.m2po_keep`` (the actor applies it
per minibatch, before the update).
All inputs are flat per-token tensors of the same shape (the caller concatenates sequences;
``seq_lens`` gives their lengths where a sequence-level quantity is needed).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from areal_async.config import ActorConfig, RejectionSamplingConfig


@dataclass
class LossStats:
    """Sums over tokens, so that micro-batches merge by addition and means come out exact."""

    loss: float = 0.0  # sum of the (already normalized) loss values of the merged parts
    n_loss_tokens: float = 0.0  # tokens that entered the loss (after rejection)
    n_tokens: float = 0.0  # all tokens seen (kept + rejected)
    n_rejected: float = 0.0
    n_clipped: float = 0.0  # loss tokens where the clipped branch was taken
    n_dual_clipped: float = 0.0  # loss tokens where the dual clip c_clip * |A| bound
    iw_sum: float = 0.0  # behaviour importance weight exp(prox - behav) over all tokens, raw
    iw_max: float = 0.0
    kl_sum: float = 0.0  # 0.5 * (logp - old_logp)^2 over loss tokens
    behav_kl_sum: float = 0.0  # 0.5 * (prox_logp - behav_logp)^2 over all tokens: how far off-policy the data is
    entropy_sum: float = 0.0  # over loss tokens

    def merge(self, other: "LossStats") -> "LossStats":
        out = LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})
        out.iw_max = max(self.iw_max, other.iw_max)
        return out

    def as_dict(self) -> dict[str, float]:
        k = max(self.n_loss_tokens, 1.0)
        return {
            "loss": self.loss,
            "clip_frac": self.n_clipped / k,
            "dual_clip_frac": self.n_dual_clipped / k,
            "imp_weight_mean": self.iw_sum / max(self.n_tokens, 1.0),
            "imp_weight_max": self.iw_max,
            "rejected_frac": self.n_rejected / max(self.n_tokens, 1.0),
            "approx_kl": self.kl_sum / k,
            "behav_approx_kl": self.behav_kl_sum / max(self.n_tokens, 1.0),
            "entropy": self.entropy_sum / k,
            "n_loss_tokens": self.n_loss_tokens,
        }


def seq_index(seq_lens: Sequence[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(the sequence of each token, the number of sequences) for tokens of ``seq_lens`` laid end to end."""
    lens = torch.as_tensor(list(seq_lens), dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(lens)), lens).to(device), len(lens)


def segment_mean(values: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Each token gets the mean of ``values`` over its sequence's ``mask`` tokens (differentiable)."""
    m = mask.to(values.dtype)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, values * m)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, m)
    return (sums / counts.clamp(min=1))[index]


def _seq(seq_lens: Optional[Sequence[int]], like: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
    if seq_lens is None:
        raise ValueError(f"{what} needs seq_lens (the length of each sequence of the flat tensors); got None")
    if sum(seq_lens) != like.numel():
        raise ValueError(f"seq_lens sum to {sum(seq_lens)}, expected the {like.numel()} tokens of the flat tensors")
    return seq_index(seq_lens, like.device)


def behav_importance(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    rs: RejectionSamplingConfig,
    seq_lens: Optional[Sequence[int]] = None,
    mask: Optional[torch.Tensor] = None,
    cap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, keep): w = exp(prox - behav), rejection applied per rs, then TIS: min(w, cap).
    Constants (no grad). Judged against [``rs.lower``, ``rs.upper``] (no lower bound when None; AReaL's
    ``_check_bounds``, areal/utils/functional/functional.py L167-182): at level 'token' with a lower bound
    and mode 'mask' this is IcePop's token mask. At ``rs.level='sequence'`` a sequence is judged by, and
    each of its tokens weighted with, its weight over its ``mask`` tokens: ``agg='mean'`` exp(mean log w),
    the geometric mean (AReaL's sequence level, ratio metric; verl's seq_mean_k1 "Geo-RS"), ``agg='sum'``
    exp(sum log w), the sequence's importance ratio (verl's Seq-MIS: rollout_is=sequence weights,
    rollout_corr_helper.py L537-544, judged as seq_sum_k1; log sums clamped at +-20 as verl's
    SAFETY_BOUND, L75)."""
    log_w = prox_logp.detach().float() - behav_logp.detach().float()
    weight = torch.exp(log_w)
    keep = torch.ones_like(weight, dtype=torch.bool)
    if rs.metric not in ("ratio", "none"):
        raise ValueError(f"rejection_sampling.metric={rs.metric!r}: expected 'ratio' or 'none'")
    if rs.metric == "ratio":
        if rs.level == "sequence":
            idx, n = _seq(seq_lens, log_w, "rejection_sampling.level=sequence")
            weight = torch.exp(_seq_log_weight(log_w, mask if mask is not None else keep, idx, n, rs.agg))
        lower = 0.0 if rs.lower is None else rs.lower
        if rs.mode == "mask":
            keep = (weight <= rs.upper) & (weight >= lower)
        elif rs.mode == "clamp":
            weight = weight.clamp(min=lower, max=rs.upper)
        else:
            raise ValueError(f"rejection_sampling.mode={rs.mode!r}: expected 'mask' or 'clamp'")
    return (weight.clamp(max=cap) if cap is not None else weight), keep


SAFETY_BOUND = 20.0  # verl's bound on a sequence's log weight before exp (rollout_corr_helper.py L75)


def _seq_log_weight(log_w: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n: int, agg: str) -> torch.Tensor:
    """Each token gets its sequence's log weight: the mean (agg 'mean') or the sum (agg 'sum', clamped
    at +-SAFETY_BOUND) of log w over the sequence's ``mask`` tokens."""
    if agg == "mean":
        return segment_mean(log_w, mask, idx, n)
    if agg != "sum":
        raise ValueError(f"rejection_sampling.agg={agg!r}: expected 'mean' or 'sum'")
    m = mask.to(log_w.dtype)
    sums = torch.zeros(n, dtype=log_w.dtype, device=log_w.device).index_add(0, idx, log_w * m)
    return sums.clamp(-SAFETY_BOUND, SAFETY_BOUND)[idx]


def loss_weights(
    prox_logp: Optional[torch.Tensor],
    behav_logp: torch.Tensor,
    cfg: ActorConfig,
    seq_lens: Optional[Sequence[int]] = None,
    mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, keep) of each token; weight 1 and keep all unless the loss is decoupled."""
    if cfg.use_decoupled_loss:
        if prox_logp is None:
            raise ValueError("use_decoupled_loss needs prox_logp; got None")
        return behav_importance(prox_logp, behav_logp, cfg.rejection_sampling, seq_lens, mask, cfg.behav_imp_weight_cap)
    ones = torch.ones_like(behav_logp, dtype=torch.float32)
    return ones, torch.ones_like(ones, dtype=torch.bool)


def count_kept_tokens(
    prox_logp: Optional[torch.Tensor],
    behav_logp: torch.Tensor,
    cfg: ActorConfig,
    loss_mask: Optional[torch.Tensor] = None,
    seq_lens: Optional[Sequence[int]] = None,
) -> int:
    """Tokens whose loss is not zeroed by rejection or the loss mask (the actor skips a step that keeps none).

    Known before the update because rejection depends only on prox and behaviour logprobs.
    The loss denominator is NOT this count: it is every trained output token (rejected ones included).
    """
    keep = loss_weights(prox_logp, behav_logp, cfg, seq_lens, loss_mask)[1]
    return int((keep & loss_mask).sum() if loss_mask is not None else keep.sum())


def surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, c_clip: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), then min(that, c_clip * |A|) when
    c_clip is set; with the masks of tokens where the clip and where the dual clip bound."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    tok = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    if c_clip is None:
        return tok, clipped, torch.zeros_like(clipped)
    cap = c_clip * adv.abs()
    return torch.minimum(tok, cap), clipped, cap < tok


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss max(-A r, -A clip(r)) and the mask of tokens where clipping bound."""
    tok, clipped, _ = surrogate(torch.exp(logp - old_logp.detach()), adv, eps_clip, eps_clip)
    return tok, clipped


def ratio_and_adv(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    keep: torch.Tensor,
    level: str,
    seq_lens: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, advantage) per token: exp(logp - old) and adv at level 'token'; at 'sequence' (GSPO) the
    sequence's exp(mean over its kept tokens of (logp - old)) and its mean advantage on each token."""
    log_r = logp - old_logp.detach()
    if level == "token":
        return torch.exp(log_r), adv
    if level != "sequence":
        raise ValueError(f"importance_sampling_level={level!r}: expected 'token' or 'sequence'")
    idx, n = _seq(seq_lens, log_r, "importance_sampling_level=sequence")
    return torch.exp(segment_mean(log_r, keep, idx, n)), segment_mean(adv.to(log_r.dtype), keep, idx, n)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from d = logp - ref: k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d (Schulman's estimators; AReaL's ``KLEstimator``)."""
    d = logp - ref_logp.detach().to(logp.dtype)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"kl_estimator={estimator!r}: expected k1, k2 or k3")


def agg_scale(
    mask: torch.Tensor, seq_lens: Sequence[int], mode: str, max_new_tokens: Optional[int] = None
) -> torch.Tensor:
    """Per-token coefficient c_t such that the loss is sum_t c_t * l_t over the trained (``mask``) tokens
    of the sequences ``seq_lens`` (a whole minibatch: the counts are global):
    token-mean 1/N_tok, seq-mean-token-sum 1/N_seq, seq-mean-token-mean 1/(N_seq * n_i),
    seq-mean-token-sum-norm 1/(N_seq * max_new_tokens)."""
    m = mask.to(torch.float64)
    idx, n = _seq(seq_lens, m, f"loss_agg_mode={mode}")
    if mode == "token-mean":
        return (m / m.sum().clamp(min=1)).float()
    if mode == "seq-mean-token-sum":
        return (m / n).float()
    if mode == "seq-mean-token-mean":
        counts = torch.zeros(n, dtype=m.dtype, device=m.device).index_add(0, idx, m).clamp(min=1)
        return (m / (n * counts[idx])).float()
    if mode == "seq-mean-token-sum-norm":
        if not max_new_tokens:
            raise ValueError("loss_agg_mode=seq-mean-token-sum-norm needs max_new_tokens (the constant normaliser)")
        return (m / (n * max_new_tokens)).float()
    raise ValueError(
        f"loss_agg_mode={mode!r}: expected token-mean, seq-mean-token-sum, seq-mean-token-mean "
        "or seq-mean-token-sum-norm"
    )


def loglinear_prox(
    behav_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, current_version: int
) -> torch.Tensor:
    """AReaL's ``prox_logp_method=loglinear``: behav + alpha * (logp - behav), per token,
    alpha = clamp((v - 1 - v_behav) / (v - v_behav), 0, 1) where v > v_behav >= 0, else 0; v is the
    version of the weights being trained (areal/trainer/ppo/actor.py, compute_prox_logp_approximations)."""
    v_b = versions.to(device=behav_logp.device, dtype=torch.float64)
    diff = current_version - v_b
    alpha = torch.where((diff > 0) & (v_b >= 0), (current_version - 1 - v_b) / diff.clamp(min=1), 0.0).clamp(0, 1)
    behav = behav_logp.detach().float()
    return behav + alpha.float() * (logp.detach().float() - behav)


def policy_loss(
    logp: torch.Tensor,
    prox_logp: Optional[torch.Tensor],
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    cfg: ActorConfig,
    n_tokens: Optional[int] = None,
    entropy: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    seq_lens: Optional[Sequence[int]] = None,
    ref_logp: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, LossStats]:
    """Scalar loss = sum over kept tokens / n_tokens (default: this call's trained tokens, rejected ones
    included), or sum over kept tokens of ``scale`` * token loss (``agg_scale``: the other aggregations).

    Under gradient accumulation or data parallelism ``n_tokens`` / ``scale`` come from the whole
    minibatch (every micro-batch and rank). ``loss_mask`` (bool, per token; None = all): tokens
    outside it (a workflow's environment tokens) are in no sum, no count and no statistic.
    ``seq_lens``: the sequences of these tokens (GSPO, sequence-level rejection). ``ref_logp``: the
    reference model's logprobs, read when kl_in='loss' (+ kl_ctl * KL estimate, aggregated alike)."""
    old = prox_logp if (cfg.use_decoupled_loss or cfg.recompute_logprob) else behav_logp
    if old is None:
        raise ValueError("recompute_logprob / use_decoupled_loss need prox_logp; got None")
    mask = loss_mask.to(torch.bool) if loss_mask is not None else torch.ones_like(behav_logp, dtype=torch.bool)
    weight, keep = loss_weights(prox_logp, behav_logp, cfg, seq_lens, mask)
    keep = keep & mask
    ratio, a = ratio_and_adv(logp, old, adv, keep, cfg.importance_sampling_level, seq_lens)
    hi = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    tok_loss, clipped, dual = surrogate(ratio, a, cfg.eps_clip, hi, cfg.c_clip)
    keep_f = keep.to(tok_loss.dtype)
    # rejected tokens stay in the denominator (AReaL: pg_loss.sum() / loss_mask_count)
    denom = max(float(n_tokens if n_tokens is not None else mask.sum()), 1.0)

    def agg(x: torch.Tensor) -> torch.Tensor:
        return (x * keep_f * scale).sum() if scale is not None else (x * keep_f).sum() / denom

    loss = agg(tok_loss * weight)
    if entropy is not None and cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * agg(entropy)
    kl = _kl_in_loss(logp, ref_logp, cfg)
    if kl is not None:
        loss = loss + cfg.kl_ctl * agg(kl)
    stats = _stats(loss, logp, old, behav_logp, prox_logp, keep, clipped, entropy, mask)
    stats.n_dual_clipped = float((dual & keep).sum())
    return loss, stats


def _kl_in_loss(logp: torch.Tensor, ref_logp: Optional[torch.Tensor], cfg: ActorConfig) -> Optional[torch.Tensor]:
    if cfg.kl_in != "loss" or cfg.kl_ctl == 0:
        return None
    if ref_logp is None:
        raise ValueError("kl_in='loss' with kl_ctl > 0 needs ref_logp (the reference model's logprobs); got None")
    return kl_estimate(logp, ref_logp, cfg.kl_estimator)


def _stats(loss, logp, old, behav_logp, prox_logp, keep, clipped, entropy, mask) -> LossStats:
    with torch.no_grad():
        iw = torch.exp(prox_logp.float() - behav_logp.float()) if prox_logp is not None else torch.ones_like(logp)
        kl = 0.5 * (logp.detach().float() - old.float()) ** 2
        log_iw = (prox_logp.float() - behav_logp.float()) if prox_logp is not None else torch.zeros_like(kl)
        iw = iw[mask]
        return LossStats(
            loss=float(loss.detach()),
            n_loss_tokens=float(keep.sum()),
            n_tokens=float(mask.sum()),
            n_rejected=float((mask & ~keep).sum()),
            n_clipped=float((clipped & keep).sum()),
            iw_sum=float(iw.sum()),
            iw_max=float(iw.max()) if iw.numel() else 0.0,
            kl_sum=float(kl[keep].sum()),
            behav_kl_sum=float((0.5 * log_iw[mask] ** 2).sum()),
            entropy_sum=float(entropy.detach()[keep].sum()) if entropy is not None else 0.0,
        )
