"""The objective keys of ``actor.*`` (issue 26): clip-higher, dual clip, KL estimator and place,
GSPO's sequence-level ratio, loss aggregation, the advantage estimator, DAPO's soft overlong
punishment, no-eos masking, TIS and the proximal-logprob method.

Named as the anchors name them: AReaL ``areal/api/cli_args.py`` (``eps_clip_higher``, ``c_clip``,
``kl_estimator``, ``importance_sampling_level``, ``overlong_*``, ``mask_no_eos_with_zero``,
``prox_logp_method``) and verl (``loss_agg_mode``, ``adv_estimator``). ``ObjectiveConfig`` is the
base of ``ActorConfig``; ``check_objective_fleet`` holds the rules that need other sections.
The formulas live in ``trainer/algo/loss.py`` and ``trainer/algo/advantages.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from areal_async.config.base import Section, _f, above, at_least, one_of, require

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACES = ("reward", "loss")
IS_LEVELS = ("token", "sequence")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
PROX_LOGP_METHODS = ("recompute", "loglinear")
NORM_LEVELS = ("group", "batch", "none")


@dataclass
class RejectionSamplingConfig(Section):
    """Behaviour-importance rejection of the decoupled loss."""

    metric: str = _f("ratio", "'ratio' (exp(prox_logp - behav_logp)) or 'none'.")
    upper: float = _f(5.0, "Tokens whose importance weight exceeds this are rejected.")
    mode: str = _f("mask", "'mask' drops rejected tokens from the loss; 'clamp' clips their weight to 'upper'.")
    level: str = _f(
        "token", "'token' or 'sequence' (a sequence judged by its weight of `agg`, its tokens share that weight)."
    )
    lower: Optional[float] = _f(
        None,
        "Lower bound: tokens (sequences) whose weight is below it are rejected too; None = none. With level "
        "'token', mode 'mask', lower 0.5 and upper 5 this is IcePop (docs/objectives.md#off-policy-corrections).",
    )
    agg: str = _f(
        "mean",
        "level 'sequence' only: the sequence's weight is exp(mean log w), the geometric mean (geometric "
        "sequence mask), or 'sum': exp(sum log w), the sequence's importance ratio (MIS, masked importance "
        "sampling).",
    )

    def check(self) -> None:
        one_of(self, "metric", ("ratio", "none"))
        one_of(self, "level", ("token", "sequence"))
        above(self, "upper", 1)
        one_of(self, "mode", ("mask", "clamp"))
        one_of(self, "agg", ("mean", "sum"))
        lo = self.lower
        require(lo is None or 0 < lo < 1, "lower", lo, "None or in (0, 1) (a weight of 1 is on-policy)")
        require(self.agg == "mean" or self.level == "sequence", "agg", self.agg, "'mean' unless level='sequence'")


@dataclass
class NormConfig(Section):
    """Mean/std normalization levels ('group', 'batch' or 'none')."""

    mean_level: str = _f("group", "Subtract the mean over: group | batch | none.")
    std_level: str = _f("group", "Divide by the std over: group | batch | none.")
    eps: float = _f(1e-5, "Added to the std.")

    def check(self) -> None:
        one_of(self, "mean_level", NORM_LEVELS)
        one_of(self, "std_level", NORM_LEVELS)
        at_least(self, "eps", 0)


@dataclass
class ObjectiveConfig(Section):
    """Objective keys shared by every actor config; checked by ``check_objective``."""

    eps_clip_higher: Optional[float] = _f(
        None, "Upper ratio clip 1 + eps_clip_higher (DAPO clip-higher, e.g. 0.28); None = eps_clip."
    )
    c_clip: Optional[float] = _f(
        None, "Dual clip: the token loss is capped at c_clip * |A| (binds for A < 0); > 1; None = off."
    )
    kl_estimator: str = _f("k1", "KL estimator of log(pi/ref): k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d.")
    kl_in: str = _f("reward", "Where the kl_ctl-weighted KL goes: 'reward' (per-token penalty) or 'loss'.")
    importance_sampling_level: str = _f(
        "token", "'token' (PPO ratio per token) or 'sequence' (GSPO: exp(mean log ratio) per sequence)."
    )
    loss_agg_mode: str = _f(
        "token-mean",
        "token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm "
        "(the last: sum / (n_seqs * gconfig.max_new_tokens), Dr.GRPO).",
    )
    adv_estimator: str = _f(
        "grpo",
        "grpo (reward_norm) | rloo (r - mean of the others in the group) | reinforce_pp (no baseline, "
        "batch-whitened) | reinforce_pp_baseline (r - group mean, batch-whitened).",
    )
    overlong_reward_penalty: bool = _f(False, "DAPO soft overlong punishment on the score (needs overlong_*).")
    overlong_tokens: Optional[int] = _f(None, "Length of the punishment interval at the end of max_new_tokens.")
    overlong_penalty_factor: Optional[float] = _f(None, "Score penalty at max_new_tokens (linear from 0).")
    mask_no_eos_with_zero: bool = _f(False, "A sample cut at gconfig.max_new_tokens (no eos) gets reward 0.")
    behav_imp_weight_cap: Optional[float] = _f(
        None, "TIS: the decoupled loss's behaviour weight exp(prox - behav) truncated at this cap (> 1); None = off."
    )
    m2_threshold: Optional[float] = _f(
        None,
        "M2PO: each minibatch's tokens with the largest (behav - prox)^2 leave the loss (and its token count) until "
        "the mean of the rest is below this (AReaL's m2_threshold, e.g. 0.04); None = off.",
    )
    prox_logp_method: str = _f(
        "recompute",
        "recompute (the proximal forward) | loglinear (AReaL: behav + alpha * (logp - behav), "
        "alpha = clamp((v - 1 - v_behav) / (v - v_behav), 0, 1); no proximal forward).",
    )

    def check(self) -> None:
        check_objective(self)


def check_objective(c: Any) -> None:
    """The objective keys' own values and their combinations with each other."""
    for name, choices in (
        ("kl_estimator", KL_ESTIMATORS),
        ("kl_in", KL_PLACES),
        ("importance_sampling_level", IS_LEVELS),
        ("loss_agg_mode", LOSS_AGG_MODES),
        ("adv_estimator", ADV_ESTIMATORS),
        ("prox_logp_method", PROX_LOGP_METHODS),
    ):
        one_of(c, name, choices)
    _check_clips(c)
    _check_overlong(c)
    cap = c.behav_imp_weight_cap
    require(cap is None or cap > 1, "behav_imp_weight_cap", cap, "> 1 or None (TIS off)")
    m2 = c.m2_threshold
    require(m2 is None or m2 > 0, "m2_threshold", m2, "> 0 or None (M2PO off)")


def check_objective_actor(c: Any) -> None:
    """Rules joining the objective keys with the rest of ``actor.*`` (run by ``ActorConfig.check``)."""
    _check_estimator(c)
    _check_decoupled(c)
    require(
        c.kl_in == "reward" or c.kl_ctl > 0,
        "kl_in",
        c.kl_in,
        "'reward' while kl_ctl=0 (a KL in the loss needs kl_ctl > 0)",
    )


def _check_clips(c: Any) -> None:
    hi = c.eps_clip_higher
    require(hi is None or hi > 0, "eps_clip_higher", hi, "> 0 or None (None = eps_clip)")
    require(c.c_clip is None or c.c_clip > 1, "c_clip", c.c_clip, "> 1 or None (dual clip off)")


def _check_overlong(c: Any) -> None:
    if not c.overlong_reward_penalty:
        for name in ("overlong_tokens", "overlong_penalty_factor"):
            require(getattr(c, name) is None, name, getattr(c, name), "None unless overlong_reward_penalty=true")
        return
    n, f = c.overlong_tokens, c.overlong_penalty_factor
    require(n is not None and n >= 1, "overlong_tokens", n, "an integer >= 1 with overlong_reward_penalty=true")
    require(f is not None and f > 0, "overlong_penalty_factor", f, "> 0 with overlong_reward_penalty=true")


def _check_estimator(c: Any) -> None:
    """rloo and reinforce_pp(_baseline) bring their own baseline: a reward normalization on top would
    apply a second one; reinforce_pp(_baseline) whiten the advantages over the batch by definition."""
    if c.adv_estimator == "grpo":
        return
    rn = c.reward_norm
    require(
        rn.mean_level == "none" and rn.std_level == "none",
        "reward_norm",
        f"{rn.mean_level}/{rn.std_level}",
        f"none/none with adv_estimator={c.adv_estimator} (it subtracts its own baseline); set "
        "actor.reward_norm.mean_level=none and actor.reward_norm.std_level=none",
    )
    if c.adv_estimator.startswith("reinforce_pp"):
        an = c.adv_norm
        require(
            an.mean_level == "batch" and an.std_level == "batch",
            "adv_norm",
            f"{an.mean_level}/{an.std_level}",
            f"batch/batch with adv_estimator={c.adv_estimator} (REINFORCE++ whitens over the batch)",
        )


def _check_decoupled(c: Any) -> None:
    cap = c.behav_imp_weight_cap
    require(
        cap is None or c.use_decoupled_loss,
        "behav_imp_weight_cap",
        cap,
        "None unless use_decoupled_loss=true (the weight is exp(prox_logp - behav_logp))",
    )
    rs = c.rejection_sampling
    require(
        cap is None or rs.metric == "none" or rs.mode == "mask",
        "behav_imp_weight_cap",
        cap,
        "None with rejection_sampling.mode=clamp (that already truncates the weight, at rejection_sampling.upper)",
    )
    m2 = c.m2_threshold
    require(
        m2 is None or (c.use_decoupled_loss and c.prox_logp_method == "recompute"),
        "m2_threshold",
        m2,
        "None unless use_decoupled_loss=true with prox_logp_method=recompute (M2PO masks by (behav - prox)^2 "
        "over the whole minibatch, before its update: it needs the proximal forward)",
    )
    require(
        c.prox_logp_method == "recompute" or c.use_decoupled_loss,
        "prox_logp_method",
        c.prox_logp_method,
        "'recompute' unless use_decoupled_loss=true (loglinear approximates the decoupled loss's proximal policy)",
    )


def check_objective_fleet(cfg: Any) -> None:
    """Objective rules that read other sections (called by ``ExperimentConfig.check``)."""
    a, g = cfg.actor, cfg.gconfig
    require(
        a.adv_estimator not in ("rloo", "reinforce_pp_baseline") or g.n_samples >= 2,
        "gconfig.n_samples",
        g.n_samples,
        f">= 2 with actor.adv_estimator={a.adv_estimator} (a group baseline needs two samples)",
    )
    if a.overlong_reward_penalty:
        require(
            a.overlong_tokens < g.max_new_tokens,
            "actor.overlong_tokens",
            a.overlong_tokens,
            f"< gconfig.max_new_tokens={g.max_new_tokens}",
        )
    uses_length = a.overlong_reward_penalty or a.mask_no_eos_with_zero or a.loss_agg_mode.endswith("-norm")
    require(
        not uses_length or not cfg.rollout.episodic,
        "rollout.workflow",
        cfg.rollout.workflow,
        "'' with actor.overlong_reward_penalty, mask_no_eos_with_zero or loss_agg_mode=seq-mean-token-sum-norm "
        "(they judge one generation against gconfig.max_new_tokens; a workflow's episode is several)",
    )
    nucleus_logprobs = cfg.rollout.backend.startswith("vllm") and not g.greedy and g.temperature != 1.0
    require(
        g.top_p == 1.0 or not nucleus_logprobs,
        "gconfig.top_p",
        g.top_p,
        f"1.0 with rollout.backend={cfg.rollout.backend} at gconfig.temperature={g.temperature}: vLLM then returns "
        "processed logprobs, renormalised over the top-p nucleus (log pi_T - log S), while the trainer recomputes "
        "log pi_T, so every behaviour weight exp(prox - behav) would be the nucleus mass S < 1, not 1 (trl #6789, "
        "docs/objectives.md); use temperature 1.0 (raw logprobs), top_p 1.0, or another backend",
    )
    d = cfg.train_dataset
    levels = d.type == "reasoning_gym" and any(dict(t).get("levels") for t in d.tasks)
    require(
        not cfg.rollout.skip_solved_after or not levels,
        "rollout.skip_solved_after",
        cfg.rollout.skip_solved_after,
        "0 with a reasoning_gym curriculum (tasks with levels): a level change puts a new problem behind a "
        "prompt index, which the memory would judge by the old one's rewards",
    )
    require(
        a.prox_logp_method == "recompute" or cfg.cluster.n_trainer_ranks == 1,
        "actor.prox_logp_method",
        a.prox_logp_method,
        "'recompute' with cluster.n_trainer_ranks > 1 (loglinear's skip decision is rank-local here)",
    )
