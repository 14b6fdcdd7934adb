"""PPOActor.train_step and SFT on a tiny Llama: learning direction, accumulation, state, reference model."""

import copy
import dataclasses
import random

import pytest
import torch
import transformers

from areal_async.config import ActorConfig, MicroBatchSpec, OptimizerConfig, SFTWarmupConfig
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.compute.logprobs import packed_logprobs
from areal_async.trainer.sft import SFTTrainer, sft_step
from protocols.trajectories import Trajectory

torch.set_num_threads(1)
PROMPT = [1, 2, 3]
GOOD, BAD = [5, 6, 7, 8], [9, 10]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def output_logp(model, prompt, output):
    with torch.no_grad():
        return packed_logprobs(model, [prompt + output], 1.0, 4096)[0][len(prompt) - 1 :]


def make_trajs(model, n_each=2):
    """On-policy: behaviour logprobs are the model's own."""
    out = []
    for k in range(n_each):
        for ids, score in ((GOOD, 1.0), (BAD, 0.0)):
            lp = output_logp(model, PROMPT, ids).tolist()
            out.append(Trajectory(f"{score}-{k}", "g", PROMPT, ids, lp, [0] * len(ids), score))
    return out


def boba_cfg(**kw):
    base = dict(
        use_decoupled_loss=True,
        recompute_logprob=True,
        reward_scaling=10.0,
        reward_bias=-0.5,
        eps_clip=0.4,
        optimizer=OptimizerConfig(lr=1e-2),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=16),
    )
    base.update(kw)
    return ActorConfig(**base)


def test_train_step_raises_logprob_of_positive_advantage_samples():
    model = tiny_model()
    actor = PPOActor(model, boba_cfg(ppo_n_minibatches=2), temperature=1.0, total_steps=10)
    good0, bad0 = output_logp(model, PROMPT, GOOD).sum(), output_logp(model, PROMPT, BAD).sum()
    losses = []
    for _ in range(4):
        m = actor.train_step(make_trajs(model))
        losses.append(m["loss"])
    assert output_logp(model, PROMPT, GOOD).sum() > good0 + 0.5
    assert output_logp(model, PROMPT, BAD).sum() < bad0 - 0.5
    assert all(x == x and abs(x) < 10 for x in losses)  # finite
    assert m["rejected_frac"] == 0.0 and m["imp_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["n_tokens"] == 12 and m["score_mean"] == 0.5 and m["reward_mean"] == pytest.approx(0.0)
    assert m["n_microbatches"] >= 2 and m["lr"] == pytest.approx(1e-2) and m["step"] == 4
    assert actor.step == 4 and m["grad_norm"] > 0
    for key in ("clip_frac", "imp_weight_max", "approx_kl", "entropy", "adv_mean", "adv_std", "skipped_steps"):
        assert key in m


def test_minibatches_are_optimizer_steps():
    actor = PPOActor(tiny_model(), boba_cfg(ppo_n_minibatches=2), 1.0, total_steps=10)
    assert not actor.prox_from_update  # the second minibatch's proximal policy is not its weights
    actor.train_step(make_trajs(actor.model))
    state = next(iter(actor.optimizer.state.values()))
    assert int(state["step"]) == 2
    with pytest.raises(ValueError, match="ppo_n_minibatches=9"):
        PPOActor(tiny_model(), boba_cfg(ppo_n_minibatches=9), 1.0, 10).train_step(make_trajs(actor.model))


def captured_grads(budget):
    """Gradients handed to the optimizer on the first step, with micro-batch budget ``budget``."""
    model = tiny_model()
    cfg = boba_cfg(
        mb_spec=MicroBatchSpec(max_tokens_per_mb=budget), optimizer=OptimizerConfig(lr=1e-2, gradient_clipping=0.0)
    )
    actor = PPOActor(model, cfg, 1.0, 10)
    trajs = make_trajs(model, n_each=3)
    grads = []
    actor.optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in model.parameters()]))
    m = actor.train_step(trajs)
    return grads[0], m["n_microbatches"]


def test_gradient_accumulation_matches_single_micro_batch():
    """Normalizing each micro-batch by the minibatch's global token count makes the summed
    gradient independent of how sequences were split."""
    whole, n1 = captured_grads(4096)
    split, n2 = captured_grads(8)
    assert n1 == 1 and n2 >= 4
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, atol=1e-6)


def reference_grads(model, trajs, cfg):
    """The decoupled PPO gradient spelled out per sequence, independent of the actor: plain HF
    forwards of one unpadded sequence each, rewards and advantages by loops, the loss summed
    token by token (AReaL's formula: kept tokens' w * max(-A r, -A clip(r)), minus the entropy
    bonus, over every output token)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")

    def out_logp_ent(t):
        ids = t.prompt_ids.tolist() + t.output_ids.tolist()
        logits = ref(input_ids=torch.tensor([ids])).logits[0].float()
        logp_all = torch.log_softmax(logits, -1)
        P = len(t.prompt_ids)
        lp = torch.stack([logp_all[P - 1 + j, ids[P + j]] for j in range(len(t.output_ids))])
        ent = torch.stack([-(logp_all[P - 1 + j].exp() * logp_all[P - 1 + j]).sum() for j in range(len(t.output_ids))])
        return lp, ent

    def norm(per_seq, pools):  # mean and unbiased std over each pool's elements, eps 1e-5
        out = []
        for i, vals in enumerate(per_seq):
            pool = [x for j in pools[i] for x in per_seq[j]]
            m = sum(pool) / len(pool)
            sd = (sum((x - m) ** 2 for x in pool) / (len(pool) - 1)) ** 0.5 if len(pool) > 1 else 0.0
            out.append([(v - m) / (sd + 1e-5) for v in vals])
        return out

    n = len(trajs)
    groups = [[j for j in range(n) if trajs[j].group_id == trajs[i].group_id] for i in range(n)]
    r = norm([[(t.score + cfg.reward_bias) * cfg.reward_scaling] for t in trajs], groups)
    adv = norm([[r[i][0]] * len(t.output_ids) for i, t in enumerate(trajs)], [list(range(n))] * n)
    with torch.no_grad():
        prox = [out_logp_ent(t)[0] for t in trajs]
    n_tokens = sum(len(t.output_ids) for t in trajs)
    loss = 0.0
    for i, t in enumerate(trajs):
        lp, ent = out_logp_ent(t)
        for j in range(len(t.output_ids)):
            w = float(torch.exp(prox[i][j] - t.logprobs[j]))
            if w > cfg.rejection_sampling.upper:
                continue
            ratio = torch.exp(lp[j] - prox[i][j])
            a = adv[i][j]
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip))
            loss = loss + (w * pg - cfg.entropy_coef * ent[j]) / n_tokens
    loss.backward()
    return [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("budget", [4096, 12])
@pytest.mark.parametrize("prox_from_update", [True, False])
def test_train_step_gradient_equals_the_loss_spelled_out(budget, prox_from_update):
    """The actor's packed, micro-batched step (lean forward, per-token gathers, flat advantages,
    proximal logprobs from the update's own forward or from a forward of their own) hands the
    optimizer the gradient of the decoupled loss computed sequence by sequence."""
    from areal_async.trainer.compute.packing import use_varlen_attention

    model = use_varlen_attention(tiny_model(seed=2))
    g = torch.Generator().manual_seed(7)
    trajs = []
    for k in range(10):
        prompt = torch.randint(0, 16, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        out = torch.randint(0, 16, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
        lp = output_logp(model, prompt.tolist(), out.tolist())
        behav = lp + 0.3 * torch.randn(lp.shape, generator=g)
        if k in (2, 5):
            behav[0] = lp[0] - 3.0  # importance weight e^3 > 5: rejected, still in the denominator
        score = float(torch.rand((), generator=g) < 0.5)
        trajs.append(Trajectory(f"s{k}", f"g{k % 3}", prompt, out, behav, [0] * len(out), score))
    cfg = boba_cfg(
        mb_spec=MicroBatchSpec(max_tokens_per_mb=budget),
        optimizer=OptimizerConfig(lr=1e-2, gradient_clipping=0.0),
        entropy_coef=0.01,
    )
    want = reference_grads(model, trajs, cfg)
    actor = PPOActor(model, cfg, 1.0, 10)
    assert actor.prox_from_update  # one minibatch, one rank, no KL, no dropout
    actor.prox_from_update = prox_from_update
    got = []
    actor.optimizer.register_step_pre_hook(lambda *_: got.append([p.grad.clone() for p in model.parameters()]))
    m = actor.train_step(trajs)
    assert m["rejected_frac"] > 0 and (m["n_microbatches"] == 1) == (budget == 4096)
    for a, b in zip(got[0], want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


def test_state_dict_round_trip():
    model = tiny_model()
    actor = PPOActor(model, boba_cfg(optimizer=OptimizerConfig(lr=1e-2, lr_scheduler_type="linear")), 1.0, 10)
    actor.train_step(make_trajs(model))
    state = copy.deepcopy(actor.state_dict())
    fresh = PPOActor(copy.deepcopy(model), actor.cfg, 1.0, 10)
    fresh.load_state_dict(state)
    assert fresh.step == 1 and fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.9e-2)
    for p_old, p_new in zip(actor.optimizer.state.values(), fresh.optimizer.state.values()):
        assert torch.equal(p_old["exp_avg"], p_new["exp_avg"])
    with pytest.raises(ValueError, match="lr_scheduler"):
        fresh.load_state_dict({"optimizer": state["optimizer"], "step": 1})


def test_reference_model_only_loaded_when_kl_is_on():
    calls = []

    def loader():
        calls.append(1)
        return tiny_model(seed=1)

    model = tiny_model()
    PPOActor(model, boba_cfg(kl_ctl=0.0), 1.0, 10, ref_model=loader).train_step(make_trajs(model))
    assert calls == []
    actor = PPOActor(model, boba_cfg(kl_ctl=0.1), 1.0, 10, ref_model=loader)
    assert calls == []  # lazy: not at construction
    actor.train_step(make_trajs(model))
    actor.train_step(make_trajs(model))
    assert calls == [1]
    with pytest.raises(ValueError, match="kl_ctl=0.1"):
        PPOActor(model, boba_cfg(kl_ctl=0.1), 1.0, 10)


def test_rejection_counts_stale_tokens():
    model = tiny_model()
    trajs = make_trajs(model)
    for t in trajs[:2]:  # behaviour far less likely than proximal: weight e^3 > upper 5
        t.logprobs = t.logprobs - 3.0
    m = PPOActor(model, boba_cfg(), 1.0, 10).train_step(trajs)
    assert m["rejected_frac"] == pytest.approx(6 / 12, abs=1e-6)
    assert m["imp_weight_max"] == pytest.approx(float(torch.exp(torch.tensor(3.0))), rel=1e-4)


def test_all_rejected_minibatch_takes_no_step():
    model = tiny_model()
    trajs = make_trajs(model)
    for t in trajs:
        t.logprobs = t.logprobs - 3.0
    before = [p.detach().clone() for p in model.parameters()]
    actor = PPOActor(model, boba_cfg(optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1)), 1.0, 10)
    m = actor.train_step(trajs)
    assert m["rejected_frac"] == 1.0 and m["skipped_steps"] == 1.0 and m["optimizer_steps"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sorted(actor.skipped_indices) == [0, 1, 2, 3]  # none of them trained (the trainer's record says so)


def test_skipped_indices_name_the_samples_of_each_skipped_minibatch():
    model = tiny_model()
    actor = PPOActor(model, boba_cfg(ppo_n_minibatches=2), 1.0, 10)
    m = actor.train_step(make_trajs(model))
    assert (m["optimizer_steps"], m["skipped_steps"], actor.skipped_indices) == (2.0, 0.0, [])
    trajs = make_trajs(model)
    for t in trajs:
        t.logprobs = t.logprobs - 3.0  # every token rejected: both minibatches skip their step
    m = actor.train_step(trajs)
    assert (m["optimizer_steps"], m["skipped_steps"]) == (0.0, 2.0) and sorted(actor.skipped_indices) == [0, 1, 2, 3]


def test_decoupled_needs_recompute():
    with pytest.raises(ValueError, match="recompute_logprob"):
        PPOActor(tiny_model(), boba_cfg(recompute_logprob=False), 1.0, 10)


# ------------------------------------------------------------------------------------------
# SFT
# ------------------------------------------------------------------------------------------


def test_sft_loss_is_answer_token_nll_and_decreases():
    model = tiny_model()
    examples = [([1, 2], [5, 6, 7]), ([3], [8, 9]), ([4, 4, 4], [10])]
    ref = torch.cat([output_logp(model, p, a) for p, a in examples])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = sft_step(model, opt, examples, max_tokens_per_mb=6)
    assert first["n_tokens"] == 6
    assert first["loss"] == pytest.approx(float(-ref.mean()), abs=1e-5)
    for _ in range(10):
        last = sft_step(model, opt, examples, max_tokens_per_mb=6)
    assert last["loss"] < first["loss"] - 0.5


def test_sft_answer_mask_leaves_context_tokens_out_of_the_loss():
    model = tiny_model()
    # a tool-use trace: model [5, 6], tool output [11, 12] (mask 0), model [7]; a plain answer [8, 9]
    examples = [([1, 2], [5, 6, 11, 12, 7], [1, 1, 0, 0, 1]), ([3], [8, 9])]
    lp0, lp1 = (output_logp(model, p, a) for p, a, *_ in examples)
    want = -float(lp0[[0, 1, 4]].sum() + lp1.sum()) / 5  # 3 + 2 imitated tokens
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = sft_step(model, opt, examples, max_tokens_per_mb=8)  # 7 + 3 positions: two micro-batches
    assert step["n_tokens"] == 5 and step["loss"] == pytest.approx(want, abs=1e-5)
    for bad in ([1, 1, 0, 0], [1, 1, 2, 0, 1], [0, 0, 0, 0, 0]):
        with pytest.raises(ValueError, match="example 0: answer mask"):
            sft_step(model, opt, [([1, 2], [5, 6, 11, 12, 7], bad)], 16)


def test_sft_trainer_runs_configured_steps():
    model = tiny_model()
    examples = [([1, 2], [5, 6, 7]), ([3], [8, 9]), ([4, 4, 4], [10])]
    own = model.config._attn_implementation
    order = list(range(3))
    random.Random(0).shuffle(order)  # SFTTrainer's first seeded epoch (seed 0)
    first = [examples[i] for i in order[:2]]
    want = -float(torch.cat([output_logp(model, p, a) for p, a in first]).mean())  # the model's own attention
    hist = SFTTrainer(model, SFTWarmupConfig(steps=5, batch_size=2, lr=1e-2), max_tokens_per_mb=16).run(examples)
    assert len(hist) == 5 and all(h["n_tokens"] > 0 for h in hist)
    # the steps ran on the packed attention: the same first loss; the model's attention comes back
    assert hist[0]["loss"] == pytest.approx(want, abs=1e-5)
    assert model.config._attn_implementation == own
    with pytest.raises(ValueError, match="answer 0 tokens"):
        sft_step(model, torch.optim.SGD(model.parameters(), lr=0.1), [([1], [])], 16)


def _unscored(trajs):
    return [dataclasses.replace(t, score=float("nan")) for t in trajs]


@pytest.mark.parametrize(
    "cfg_kw",
    [{}, {"use_decoupled_loss": False, "recompute_logprob": False}, {"mb_spec": MicroBatchSpec(max_tokens_per_mb=64)}],
    ids=["prox-from-update,2-micro-batches", "no-recompute", "1-micro-batch"],
)
def test_a_step_whose_first_forward_ran_ahead_is_the_plain_step(cfg_kw):
    """forward_ahead on unscored trajectories, then train_step with the scores: the same weights and
    metrics, bit for bit, as train_step alone (whose gradient is checked against the loss spelled out
    above), step after step."""
    ahead_actor = PPOActor(tiny_model(), boba_cfg(**cfg_kw), temperature=1.0, total_steps=10)
    plain = PPOActor(tiny_model(), boba_cfg(**cfg_kw), temperature=1.0, total_steps=10)
    assert ahead_actor.can_forward_ahead
    for _ in range(3):
        trajs = make_trajs(plain.model)
        ahead = ahead_actor.forward_ahead(_unscored(trajs))
        got, want = ahead_actor.train_step(trajs, ahead=ahead), plain.train_step(trajs)
        assert got.keys() == want.keys()
        assert all(got[k] == want[k] or (got[k] != got[k] and want[k] != want[k]) for k in want), (got, want)
        assert all(torch.equal(a, b) for a, b in zip(ahead_actor.model.parameters(), plain.model.parameters()))
    assert want["grad_norm"] > 0 and ahead_actor.step == 3


def test_a_forward_ahead_of_other_samples_or_another_step_is_refused_and_changes_nothing():
    actor = PPOActor(tiny_model(), boba_cfg(), temperature=1.0, total_steps=10)
    trajs = make_trajs(actor.model)
    before = [p.detach().clone() for p in actor.model.parameters()]
    ahead = actor.forward_ahead(_unscored(trajs))
    with pytest.raises(ValueError, match="same samples in the same order"):
        actor.train_step(trajs[::-1], ahead=ahead)
    with pytest.raises(ValueError, match="same samples in the same order"):
        actor.train_step(trajs[:3], ahead=ahead)
    assert actor.step == 0 and all(torch.equal(a, b) for a, b in zip(actor.model.parameters(), before))
    old = actor.forward_ahead(_unscored(trajs))
    actor.train_step(trajs, ahead=ahead)  # the weights move: a forward of the old ones is stale
    with pytest.raises(ValueError, match="forward ahead of step 0 .* does not match step 1"):
        actor.train_step(trajs, ahead=old)


@pytest.mark.parametrize(
    "cfg_kw, why",
    [({"ppo_n_minibatches": 2}, "ppo_n_minibatches=2"), ({"kl_ctl": 0.1}, "kl_ctl=0.1")],
)
def test_forward_ahead_is_refused_where_the_update_forward_depends_on_the_scores(cfg_kw, why):
    """Two minibatches: the second forward runs on weights the first step moved; a KL penalty: the
    advantages need the reference forward first."""
    actor = PPOActor(tiny_model(), boba_cfg(**cfg_kw), temperature=1.0, total_steps=10, ref_model=tiny_model(1))
    assert not actor.can_forward_ahead
    with pytest.raises(ValueError, match=why):
        actor.forward_ahead(_unscored(make_trajs(actor.model)))
