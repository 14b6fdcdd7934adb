"""Packing: layout, block-causal mask, packed logprobs == per-sequence logprobs, allocator."""

import copy
import math
import random

import pytest
import torch
import transformers

from areal_async.trainer.compute.logprobs import iter_micro_batches, packed_logprobs
from areal_async.trainer.compute.micro_batches import allocate_micro_batches, first_fit_decreasing, lower_bound
from areal_async.trainer.compute.packing import (
    VARLEN_IMPL,
    block_causal_mask,
    forward_packed,
    pack,
    select_attn_implementation,
    unpack,
    use_varlen_attention,
)

torch.set_num_threads(1)
VOCAB = 61


def tiny_model(attn: str) -> torch.nn.Module:
    """Same weights whatever the attention implementation (GQA: 4 heads, 2 KV heads)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager" if attn == "eager" else "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    return use_varlen_attention(model) if attn == VARLEN_IMPL else model


def random_seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference_logprobs(model, seq, temperature):
    """One unpadded sequence alone through plain sdpa, plain log_softmax: the ground truth."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return torch.tensor([logp[t, seq[t + 1]].item() for t in range(len(seq) - 1)])


def test_pack_layout():
    p = pack([[5, 6, 7], [8], [9, 10]])
    assert p.ids_T.tolist() == [5, 6, 7, 8, 9, 10]
    assert p.position_ids_T.tolist() == [0, 1, 2, 0, 0, 1]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 3 and p.lengths == [3, 1, 2]
    assert [v.tolist() for v in unpack(torch.arange(6), p.cu_seqlens)] == [[0, 1], [], [4]]


def test_pack_parts_int32_and_bad_input():
    """A (prompt, output) tuple packs as one sequence; int32 ids come out int64; no tensor is changed."""
    prompt, out = torch.tensor([5, 6], dtype=torch.int32), torch.tensor([7], dtype=torch.int64)
    p = pack([(prompt, out), torch.tensor([8], dtype=torch.int32), [9, 10], (torch.tensor([11]),)])
    assert p.ids_T.dtype == torch.int64 and p.position_ids_T.dtype == torch.int64
    assert p.ids_T.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert p.position_ids_T.tolist() == [0, 1, 2, 0, 0, 1, 0]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6, 7] and p.max_seqlen == 3
    assert prompt.dtype == torch.int32 and prompt.tolist() == [5, 6]
    long_seq = pack([list(range(5000))])  # past the cached position ramp's first size
    assert long_seq.position_ids_T[-1].item() == 4999
    with pytest.raises(ValueError, match=r"sequence 1: token ids of shape \(2, 2\)"):
        pack([[1], torch.zeros(2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack([[1], (torch.tensor([], dtype=torch.int32), torch.tensor([], dtype=torch.long))])


def test_block_causal_mask_by_hand():
    mask = block_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32), torch.float32)[0, 0]
    allowed = [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert mask.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            assert (mask[i, j] == 0) == bool(allowed[i][j])


@pytest.mark.parametrize("attn", ["eager", "sdpa", VARLEN_IMPL])
def test_packed_logprobs_match_per_sequence(attn):
    model, plain = tiny_model(attn), tiny_model("sdpa")
    seqs = random_seqs([7, 1, 13, 4, 20, 2, 9])
    for budget in (10_000, 24):  # one micro-batch, then several
        with torch.no_grad():
            got = packed_logprobs(model, seqs, temperature=0.7, max_tokens_per_mb=budget)
        for s, g in zip(seqs, got):
            ref = reference_logprobs(plain, s, 0.7)
            assert g.shape == (len(s) - 1,)
            assert torch.allclose(g, ref, atol=1e-5), (attn, budget, (g - ref).abs().max())


def test_block_structure_matters():
    """A plain causal 4D mask over the packed tokens lets sequence 2 see sequence 1: differs."""
    model = tiny_model("sdpa")
    p = pack(random_seqs([6, 8]))
    causal = torch.zeros(14, 14).masked_fill(~torch.ones(14, 14, dtype=torch.bool).tril(), -1e30)[None, None]
    with torch.no_grad():
        leaky = model(
            input_ids=p.ids_T[None], position_ids=p.position_ids_T[None], attention_mask=causal, use_cache=False
        ).logits[0]
        logp, _ = forward_packed(model, p)
    second_leaky = torch.log_softmax(leaky[6:13], -1).gather(-1, p.ids_T[7:14, None])[:, 0]
    assert not torch.allclose(second_leaky, unpack(logp, p.cu_seqlens)[1], atol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", VARLEN_IMPL])
def test_packed_logprobs_qwen2(attn):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    plain = transformers.Qwen2ForCausalLM(cfg).eval()
    model = use_varlen_attention(copy.deepcopy(plain)) if attn == VARLEN_IMPL else plain
    seqs = random_seqs([9, 3, 14])
    with torch.no_grad():
        got = packed_logprobs(model, seqs, 1.0, 16)
    for s, g in zip(seqs, got):
        assert torch.allclose(g, reference_logprobs(plain, s, 1.0), atol=1e-5)


def test_varlen_and_mask_paths_give_the_same_gradients():
    seqs = random_seqs([5, 11, 3, 8])
    grads = []
    for attn in ("sdpa", VARLEN_IMPL):
        model = tiny_model(attn).train()
        sum(lp.sum() for lp in packed_logprobs(model, seqs, 1.0, 4096)).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)


def _lean_case(arch: str) -> torch.nn.Module:
    """Llama with GQA and tied embeddings, or Qwen2 (q/k/v biases) with GQA: 'packed_sdpa', train mode."""
    torch.manual_seed(3)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    common.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        for lin in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].self_attn.k_proj):
            torch.nn.init.normal_(lin.bias)  # zero-initialised biases would hide a dropped bias
    return use_varlen_attention(model).train()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_forward_equals_hf_forward_values_and_gradients(arch):
    """The lean packed forward (never calling HF's model forward) against HF's forward with the same
    attention: logprobs, entropies and every parameter's gradient of a weighted sum of both, over
    lengths spanning several buckets and past the rotary table's first size (64 positions)."""
    from areal_async.trainer.compute import lean_forward

    seqs = random_seqs([1, 2, 5, 9, 17, 30, 31, 70, 3], seed=4)
    packed = pack(seqs)
    g = torch.Generator().manual_seed(5)
    w_lp, w_ent = torch.randn(packed.ids_T.numel(), generator=g), torch.randn(packed.ids_T.numel(), generator=g)
    got = {}
    for lean in (True, False):
        model = _lean_case(arch)
        assert lean_forward.supports(model)
        if lean:  # proof the lean path ran: HF's decoder stack refuses to be called
            model.model.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("HF forward called"))
        logp, ent = forward_packed(model, packed, 0.7, with_entropy=True, lean=lean)
        ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
        got[lean] = (logp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()})
    (lp1, e1, g1), (lp0, e0, g0) = got[True], got[False]
    assert torch.allclose(lp1, lp0, atol=1e-5) and torch.allclose(e1, e0, atol=1e-5)
    assert g1.keys() == g0.keys()
    for name in g0:
        assert torch.allclose(g1[name], g0[name], atol=1e-5), (arch, name, (g1[name] - g0[name]).abs().max())


def test_lean_forward_refuses_what_it_does_not_compute():
    from areal_async.trainer.compute import lean_forward

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    common.update(num_attention_heads=4, num_key_value_heads=2)
    assert lean_forward.supports(transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)))
    assert not lean_forward.supports(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attention_dropout=0.1))
    )
    assert not lean_forward.supports(
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4))
    )
    assert not lean_forward.supports(transformers.MistralForCausalLM(transformers.MistralConfig(**common)))


def test_varlen_attention_refuses_unpacked_forward():
    model = tiny_model(VARLEN_IMPL)
    with pytest.raises(ValueError, match="packed forwards only"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert select_attn_implementation("cpu") == VARLEN_IMPL


def test_packed_logprobs_carry_gradient_and_entropy():
    model = tiny_model("sdpa").train()
    seqs = random_seqs([5, 9, 3])
    mbs = list(iter_micro_batches(model, seqs, 1.0, 12, with_entropy=True))
    assert sorted(i for mb in mbs for i in mb.indices) == [0, 1, 2]
    total = sum(lp.sum() for mb in mbs for lp in mb.logp)
    total.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    # entropy of position 0 of sequence 0 against a direct computation
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seqs[0]])).logits[0, 0]
    p = torch.softmax(logits, -1)
    ent = float(-(p * torch.log(p)).sum())
    mb0 = next(mb for mb in mbs if 0 in mb.indices)
    assert abs(float(mb0.entropy[mb0.indices.index(0)][0].detach()) - ent) < 1e-5


# ------------------------------------------------------------------------------------------
# allocator
# ------------------------------------------------------------------------------------------


def _check_partition(bins, lengths, budget):
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)


def test_allocator_random_mixes_within_budget_and_near_lower_bound():
    rng = random.Random(0)
    budget = 1000
    for trial in range(120):
        n = rng.randint(1, 150)
        if trial % 2:  # long tail, like reasoning traces
            lengths = [min(budget, int(rng.lognormvariate(math.log(150), 1.0)) + 1) for _ in range(n)]
        else:
            lengths = [rng.randint(1, budget // 3) for _ in range(n)]
        bins = allocate_micro_batches(lengths, budget)
        _check_partition(bins, lengths, budget)
        assert len(bins) <= lower_bound(lengths, budget) + 1, (trial, len(bins))


def test_allocator_never_worse_than_ffd_on_hard_mixes():
    rng = random.Random(1)
    for _ in range(40):  # uniform up to the budget: many items > budget/2, the bound is loose
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(1, 80))]
        bins = allocate_micro_batches(lengths, 500)
        _check_partition(bins, lengths, 500)
        assert len(bins) <= len(first_fit_decreasing(lengths, 500))


def test_allocator_balances():
    lengths = [100] * 8 + [50] * 8  # 1200 tokens, budget 400 -> 3 micro-batches of 400 exist
    bins = allocate_micro_batches(lengths, 400)
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [400, 400, 400]


def test_allocator_many_sequences():
    """Past KK's work limit (n x bins) the allocator runs LPT: 3000 x 300 tokens under a 1000-token
    budget fit at most 3 per micro-batch (4 x 300 > 1000), so exactly 1000 micro-batches of 3."""
    bins = allocate_micro_batches([300] * 3000, 1000)
    _check_partition(bins, [300] * 3000, 1000)
    assert len(bins) == 1000 and {len(b) for b in bins} == {3}
    rng = random.Random(2)
    lengths = [min(1000, int(rng.lognormvariate(math.log(150), 1.0)) + 1) for _ in range(3000)]
    bins = allocate_micro_batches(lengths, 1000)
    _check_partition(bins, lengths, 1000)
    assert len(bins) <= lower_bound(lengths, 1000) * 1.02 + 1


def test_allocator_oversize():
    with pytest.raises(ValueError, match=r"500 tokens.*max_tokens_per_mb=300"):
        allocate_micro_batches([100, 500, 20], 300)
    bins = allocate_micro_batches([100, 500, 20], 300, oversize="own_mb")
    assert [1] in bins and sorted(i for b in bins for i in b) == [0, 1, 2]
    assert all(sum([100, 500, 20][i] for i in b) <= 300 for b in bins if b != [1])


def test_packed_logprobs_oversize_error_names_length():
    model = tiny_model("sdpa")
    with pytest.raises(ValueError, match="30 tokens"):
        packed_logprobs(model, random_seqs([30, 3]), 1.0, max_tokens_per_mb=16)


def test_varlen_plan_buckets_by_hand():
    """Lengths 1, 4, 3 (packed at 0, 1, 5): 4 and 3 share a bucket padded to 4 (3 >= 0.75 * 4), 1 is alone."""
    from areal_async.trainer.compute.packing import varlen_plan

    plan = varlen_plan(torch.tensor([0, 1, 5, 8], dtype=torch.int32))
    assert [b.gather_NL.tolist() for b in plan.buckets] == [[[1, 2, 3, 4], [5, 6, 7, 7]], [[0]]]
    assert [b.real.tolist() for b in plan.buckets] == [[0, 1, 2, 3, 4, 5, 6], [0]]
    # bucket order of tokens: 1..7 then 0, so packed token 0 sits last
    assert plan.inverse_T.tolist() == [7, 0, 1, 2, 3, 4, 5, 6]
