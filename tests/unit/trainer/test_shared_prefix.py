"""A group's prompt trained once (``shared_prefix``): the layout by hand, and the same logprobs, entropies and
gradients as the sequences laid out whole, on the lean forward of Llama and Qwen2."""

import contextlib

import pytest
import torch

from areal_async.trainer.compute import lean_forward
from areal_async.trainer.compute.logprobs import tail_index
from areal_async.config import MicroBatchSpec, OptimizerConfig
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.compute.packing import forward_packed, pack, use_varlen_attention
from areal_async.trainer.compute.shared_prefix import allocate_runs, branch_mask, prompt_runs, share_prefixes
from protocols.trajectories import Trajectory
from tests.unit.trainer.test_packing import VOCAB, _lean_case


def test_layout_by_hand():
    """Two samples of prompt [1 2 3] (outputs [4 5], [6]) and one of prompt [7 8] (output [9])."""
    packed = pack([(torch.tensor([1, 2, 3]), torch.tensor([4, 5])), (torch.tensor([1, 2, 3]), torch.tensor([6])),
                   (torch.tensor([7, 8]), torch.tensor([9]))])  # fmt: skip
    sh = share_prefixes(packed.ids_T, packed.position_ids_T, [3, 3, 2], [2, 1, 1], [2, 1])
    assert sh.ids_P.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sh.pos_P.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2]  # the second output starts where its prompt ends
    assert sh.cu_P.tolist() == [0, 6, 9]
    assert sh.branch_P.tolist() == [0, 0, 0, 1, 1, 2, 0, 0, 1]
    # virtual [1 2 3 4 5 | 1 2 3 6 | 7 8 9] -> physical rows
    assert sh.rows_T.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8]
    assert torch.equal(sh.ids_P[sh.rows_T], packed.ids_T) and torch.equal(sh.pos_P[sh.rows_T], packed.position_ids_T)
    with pytest.raises(ValueError, match="cover 2 sequences; the batch has 3"):
        share_prefixes(packed.ids_T, packed.position_ids_T, [3, 3, 2], [2, 1, 1], [1, 1])
    with pytest.raises(ValueError, match="prompt lengths differ"):
        share_prefixes(packed.ids_T, packed.position_ids_T, [3, 3, 2], [2, 1, 1], [1, 2])


def test_branch_mask_by_hand():
    """Prompt of 2 (branch 0), output 1 of 2 tokens, output 2 of 1: row i lists the keys query i sees."""
    m = branch_mask(torch.tensor([[0, 0, 1, 1, 2]]))[0, 0]
    assert [row.nonzero().flatten().tolist() for row in m] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 4]]


def test_prompt_runs_check_the_tokens_not_just_the_key():
    p, q = torch.tensor([1, 2]), torch.tensor([1, 3])
    assert prompt_runs(["g0", "g0", "g0", "g1", "g1"], [p, p.clone(), p, p, p]) == [3, 2]
    assert prompt_runs(["g0", "g0", "g0"], [p, q, q]) == [1, 2]  # same key, other tokens: not shared
    assert prompt_runs(["g0", "g1", "g0"], [p, p, p]) == [1, 1, 1]  # runs are consecutive


@contextlib.contextmanager
def counted_tokens():
    """The token count of every lean forward run meanwhile (a list, in call order)."""
    real, ran = lean_forward.lean_hidden, []

    def counted(model, ids_T, *a, **k):
        ran.append(ids_T.numel())
        return real(model, ids_T, *a, **k)

    lean_forward.lean_hidden = counted
    try:
        yield ran
    finally:
        lean_forward.lean_hidden = real


def _groups(seed: int):
    """Three groups (prompts of 5, 23 and 1 tokens; 4, 2 and 3 samples of 1-19 output tokens) and a lone sample."""
    g = torch.Generator().manual_seed(seed)
    seqs, keys = [], []
    for k, (p, outs) in enumerate([(5, [3, 19, 1, 7]), (23, [2, 11]), (1, [4, 1, 9]), (6, [5])]):
        prompt = torch.randint(0, VOCAB, (p,), generator=g)
        for o in outs:
            seqs.append((prompt, torch.randint(0, VOCAB, (o,), generator=g)))
            keys.append(f"g{k}")
    return seqs, keys


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("scored", [True, False])
def test_shared_prefix_equals_the_whole_sequences(arch, scored):
    """A float64 model, so the summation order's rounding is far below the tolerance (the head's logits are taken in
    float32: one float32 ulp of a logprob near -4 is 4.8e-7): every output token's logprob and entropy, and every
    parameter's gradient of a weighted sum of them, equal the sequences' own forward; the
    layers ran on the shared layout's 5 + 30 + 23 + 13 + 1 + 14 + 6 + 5 = 97 tokens, not the sequences'
    4 x 5 + 30 + 2 x 23 + 13 + 3 + 14 + 6 + 5 = 137."""
    seqs, keys = _groups(7)
    n_prompt, n_out = [p.numel() for p, _ in seqs], [o.numel() for _, o in seqs]
    runs = prompt_runs(keys, [p for p, _ in seqs])
    assert runs == [4, 2, 3, 1]
    tails = tail_index(pack(seqs).cu_seqlens, [p - 1 for p in n_prompt])
    g = torch.Generator().manual_seed(11)
    w_lp, w_ent = (torch.randn(tails.numel(), generator=g, dtype=torch.float64) for _ in range(2))
    got = {}
    with counted_tokens() as ran:
        for share in (False, True):
            model = _lean_case(arch).double()
            packed = pack(seqs)
            if scored:
                packed.scored_T = tails
            if share:
                packed.shared = share_prefixes(packed.ids_T, packed.position_ids_T, n_prompt, n_out, runs)
            logp_T, ent_T = forward_packed(model, packed, 0.7, with_entropy=True)
            lp, ent = logp_T[tails], ent_T[tails]
            ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
            got[share] = (lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert ran == [137, 97]
    (lp0, e0, g0), (lp1, e1, g1) = got[False], got[True]
    assert torch.allclose(lp1, lp0, rtol=0, atol=1e-6) and torch.allclose(e1, e0, rtol=0, atol=1e-6)
    assert g1.keys() == g0.keys()
    for name in g0:
        assert torch.allclose(g1[name], g0[name], rtol=0, atol=1e-6), (name, (g1[name] - g0[name]).abs().max())


def test_hf_forward_ignores_the_shared_layout():
    """A model the lean forward does not run (lean=False: HF's forward) gets the sequences as they are."""
    seqs, keys = _groups(8)
    n_prompt, n_out = [p.numel() for p, _ in seqs], [o.numel() for _, o in seqs]
    model = _lean_case("llama").double()
    plain = pack(seqs)
    shared = pack(seqs)
    shared.shared = share_prefixes(
        shared.ids_T, shared.position_ids_T, n_prompt, n_out, prompt_runs(keys, [p for p, _ in seqs])
    )
    with torch.no_grad():
        a, _ = forward_packed(model, plain, 1.0, lean=False)
        b, _ = forward_packed(model, shared, 1.0, lean=False)
    assert torch.equal(a, b)


def test_allocate_runs_keeps_runs_whole_and_cuts_one_over_the_budget():
    """Runs of 4, 2 and 1 (prompts 3, 5, 2; outputs 2 each, 4 each, 9): costs 3 + 8 = 11, 5 + 8 = 13, 11."""
    n_prompt, n_out = [3, 3, 3, 3, 5, 5, 2], [2, 2, 2, 2, 4, 4, 9]
    assert allocate_runs([4, 2, 1], n_prompt, n_out, 13, "error") == [[4, 5], [0, 1, 2, 3], [6]]
    # budget 10: the first run is cut in two parts of 3 + 6 (each pays its prompt), the second in 5 + 4 each
    mbs = allocate_runs([4, 2, 1], n_prompt, n_out, 10, "own_mb")
    assert sorted(map(tuple, mbs)) == [(0, 1, 2), (3,), (4,), (5,), (6,)]
    with pytest.raises(ValueError, match="sequence 6 has 11 tokens"):  # the sequence's position, not its unit's
        allocate_runs([4, 2, 1], n_prompt, n_out, 10, "error")
    assert allocate_runs([1, 1, 1], [3, 3, 3], [2, 2, 2], 10, "error") == [[0, 2], [1]]


@pytest.mark.parametrize("budget", [4096, 24])
def test_a_shared_prompt_train_step_hands_the_optimizer_the_loss_spelled_out(budget):
    """The actor with ``share_prompts`` (the default) on groups of one prompt: the same gradient as the decoupled
    loss computed sequence by sequence (``test_trainer_actor.reference_grads``, HF forwards of one sequence
    each), its forwards on the shared layout: 3 prompts once each instead of once a sample."""
    from tests.unit.trainer.test_trainer_actor import boba_cfg, output_logp, reference_grads, tiny_model

    model = use_varlen_attention(tiny_model(seed=4))
    g = torch.Generator().manual_seed(9)
    trajs, n_virtual, n_physical = [], 0, 0
    for k in range(3):
        prompt = torch.randint(0, 16, (3 + 2 * k,), generator=g)
        n_physical += prompt.numel()
        for j in range(4):
            out = torch.randint(0, 16, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
            lp = output_logp(model, prompt.tolist(), out.tolist())
            behav = lp + 0.3 * torch.randn(lp.shape, generator=g)
            score = float(torch.rand((), generator=g) < 0.5)
            trajs.append(Trajectory(f"g{k}.{j}", f"g{k}", prompt, out, behav, [0] * len(out), score))
            n_virtual, n_physical = n_virtual + prompt.numel() + out.numel(), n_physical + out.numel()
    budget_cfg = MicroBatchSpec(max_tokens_per_mb=budget)
    cfg = boba_cfg(mb_spec=budget_cfg, optimizer=OptimizerConfig(lr=1e-2, gradient_clipping=0.0))
    want = reference_grads(model, trajs, cfg)
    actor = PPOActor(model, cfg, 1.0, 10)
    assert actor.shares_prompts
    got = []
    actor.optimizer.register_step_pre_hook(lambda *_: got.append([p.grad.clone() for p in model.parameters()]))
    with counted_tokens() as ran:
        m = actor.train_step(trajs)
    assert sum(ran) == m["n_layer_tokens"] == n_physical < n_virtual and (m["n_microbatches"] == 1) == (budget == 4096)
    for a, b in zip(got[0], want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


def test_share_prompts_applies_on_the_lean_forward_only():
    from tests.unit.trainer.test_trainer_actor import boba_cfg, tiny_model

    assert PPOActor(use_varlen_attention(tiny_model()), boba_cfg(), 1.0, 10).shares_prompts
    assert not PPOActor(use_varlen_attention(tiny_model()), boba_cfg(share_prompts=False), 1.0, 10).shares_prompts
    hf = tiny_model()
    hf.set_attn_implementation("sdpa")  # HF's forward (a dense mask): no branch masks there
    assert not PPOActor(hf, boba_cfg(), 1.0, 10).shares_prompts


def test_a_segmented_sample_is_never_shared_and_the_step_equals_the_unshared_one():
    """A group whose middle sample is segmented (an agent's turns: ``segment_starts``) beside plain ones: the plain
    ones before and after it share their prompt, nothing is shared across it, and the step's gradient equals the
    one without sharing."""
    from tests.unit.trainer.test_trainer_actor import boba_cfg, output_logp, tiny_model

    prompt = torch.randint(0, 16, (4,), generator=torch.Generator().manual_seed(5))
    outs = [torch.randint(0, 16, (5,), generator=torch.Generator().manual_seed(100 + j)) for j in range(5)]
    grads, ran = {}, {}
    for share in (True, False):
        model = use_varlen_attention(tiny_model(seed=6))
        trajs = []
        for j, out in enumerate(outs):
            lp = output_logp(model, prompt.tolist(), out.tolist())
            mask = [True, True, False, True, True]  # the segment's first token is its prompt: not trained
            trajs.append(Trajectory(f"g.{j}", "g", prompt, out, lp, [0] * 5, float(j % 2), loss_mask=mask))
        trajs[2].segment_starts = [2]
        cfg = boba_cfg(share_prompts=share, optimizer=OptimizerConfig(lr=1e-2, gradient_clipping=0.0))
        actor = PPOActor(model, cfg, 1.0, 10)
        got = grads[share] = []
        actor.optimizer.register_step_pre_hook(
            lambda *_, m=model, g=got: g.append([p.grad.clone() for p in m.parameters()])
        )
        with counted_tokens() as ran[share]:
            actor.train_step(trajs)
    # runs [2, 1, 2]: two prompts of 4 run once each, the segmented sample whole
    assert sum(ran[True]) == 2 * (4 + 5 + 5) + (4 + 5) < sum(ran[False]) == 5 * (4 + 5)
    for a, b in zip(grads[True][0], grads[False][0]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()
