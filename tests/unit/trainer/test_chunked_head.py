"""The chunked lm head (trainer/compute/chunked_head.py) and activation checkpointing against the whole-logits
computation written out here (plain log_softmax / softmax over the full (T, V) logits), in float64."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from areal_async.config.sections import ActorConfig
from areal_async.trainer.actor import enable_checkpointing
from areal_async.trainer.compute.chunked_head import DEFAULT_CHUNK_TOKENS, head_logprobs
from areal_async.trainer.compute.packing import VARLEN_IMPL, forward_packed, pack, use_varlen_attention

torch.set_num_threads(1)
VOCAB = 53


def model64(attn: str, tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.Qwen2ForCausalLM(cfg).double().train()
    return use_varlen_attention(model) if attn == VARLEN_IMPL else model


def packed_batch():
    g = torch.Generator().manual_seed(3)
    return pack([torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 4, 12)])  # T = 25


def whole(model, packed, temperature):
    """Written out: the model's full logits, log_softmax, softmax, in float64."""
    out = model(
        input_ids=packed.ids_T[None], position_ids=packed.position_ids_T[None], use_cache=False, **_kwargs(packed)
    )
    z = out.logits[0] / temperature
    logq = torch.log_softmax(z, -1)
    nxt = torch.roll(packed.ids_T, -1)
    return logq[torch.arange(z.shape[0]), nxt], -(logq.exp() * logq).sum(-1)


def _kwargs(packed):
    cu = packed.cu_seqlens
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen)


def loss_of(logp, ent):
    g = torch.Generator().manual_seed(5)
    w1, w2 = (torch.randn(logp.shape[0], generator=g, dtype=torch.float64) for _ in range(2))
    return (w1 * logp).sum() + (w2 * ent).sum()


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-6):
    assert (a - b).norm() <= rel * b.norm(), (a - b).norm() / b.norm()


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_gradient_equals_whole_logits_float64(lean, tie):
    model, packed = model64(VARLEN_IMPL, tie), packed_batch()
    ref_logp, ref_ent = whole(model, packed, 0.7)
    ref = grads(model, loss_of(ref_logp, ref_ent))
    logp, ent = forward_packed(model, packed, 0.7, with_entropy=True, lean=lean, chunk_tokens=4)  # 25 = 6 x 4 + 1
    assert_rel_close(logp, ref_logp)
    assert_rel_close(ent, ref_ent)
    got = grads(model, loss_of(logp, ent))
    assert got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
    for name in ref:
        assert_rel_close(got[name], ref[name])


def test_entropy_as_statistic_carries_no_gradient():
    model, packed = model64(VARLEN_IMPL), packed_batch()
    ref_logp, _ = whole(model, packed, 1.0)
    ref = grads(model, (ref_logp * 2).sum())
    logp, ent = forward_packed(model, packed, with_entropy=True, entropy_grad=False, chunk_tokens=5)
    assert not ent.requires_grad
    got = grads(model, (logp * 2).sum())
    for name in ref:
        assert_rel_close(got[name], ref[name])


def test_head_logprobs_alone_with_bias_and_no_entropy():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(29, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(29, generator=g, dtype=torch.float64, requires_grad=True)
    nxt = torch.randint(0, 29, (11,), generator=g)
    logp, ent = head_logprobs(h, w, b, nxt, 1.3, chunk=3)
    assert ent is None
    ref = torch.log_softmax((h @ w.T + b) / 1.3, -1)[torch.arange(11), nxt]
    assert_rel_close(logp, ref.float(), rel=1e-6)  # logp is float32, as forward_packed's always was
    got = torch.autograd.grad(logp.double().sum(), (h, w, b))
    want = torch.autograd.grad(ref.sum(), (h, w, b))
    for x, y in zip(got, want):
        assert_rel_close(x, y, rel=1e-6)


def test_refuses_bad_chunk_and_temperature():
    h, w, nxt = torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk=0"):
        head_logprobs(h, w, None, nxt, 1.0, chunk=0)
    with pytest.raises(ValueError, match="temperature=0"):
        head_logprobs(h, w, None, nxt, 0.0, chunk=2)
    with pytest.raises(ValueError, match="chunk_tokens=-1"):
        forward_packed(model64(VARLEN_IMPL), packed_batch(), chunk_tokens=-1)


class _LargestTensor(TorchDispatchMode):
    """The largest tensor any op produces while active (numel)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 4])
def test_no_tokens_by_vocab_tensor_when_chunked(chunk):
    """Invariant 8: no op of forward + backward produces a (T, V) tensor; with chunk 0 (whole) one does."""
    model, packed = model64(VARLEN_IMPL), packed_batch()
    T = packed.ids_T.numel()
    with _LargestTensor() as seen:
        logp, ent = forward_packed(model, packed, with_entropy=True, chunk_tokens=chunk)
        (logp.sum() + ent.sum()).backward()
    if chunk:  # the largest is a chunk's logits (4 x V) or a weight (V x hidden 16)
        assert seen.largest == max(4, 16) * VOCAB < T * VOCAB
    else:
        assert seen.largest == T * VOCAB


@pytest.mark.parametrize("attn", [VARLEN_IMPL, "sdpa"])
def test_gradient_checkpointing_same_gradient_and_recomputes(attn):
    model, packed = model64(attn), packed_batch()
    ref = grads(model, loss_of(*forward_packed(model, packed, with_entropy=True, chunk_tokens=8)))
    enable_checkpointing(model)
    calls = []
    hook = model.model.layers[0].mlp.act_fn.register_forward_hook(lambda *a: calls.append(1))
    got = grads(model, loss_of(*forward_packed(model, packed, with_entropy=True, chunk_tokens=8)))
    hook.remove()
    assert len(calls) == 2  # the layer ran in forward and again in backward
    for name in ref:
        assert_rel_close(got[name], ref[name], rel=1e-12)


def test_checkpointing_refused_for_a_model_without_it():
    with pytest.raises(ValueError, match="does not support it"):
        enable_checkpointing(torch.nn.Linear(2, 2))


def test_config_default_and_validation():
    assert ActorConfig().logits_chunk_tokens == DEFAULT_CHUNK_TOKENS
    cfg = ActorConfig()
    cfg.logits_chunk_tokens = -1
    with pytest.raises(ValueError, match="logits_chunk_tokens"):
        cfg.check()


class _LargestVocabRow(TorchDispatchMode):
    """The most elements of any tensor an op produces whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """The trainer's one-rank FSDP2 group (``dp.shard_model`` needs a default group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("tie", [False, True])
def test_fsdp_sharded_model_takes_the_chunked_head_with_the_whole_logits_gradient(gloo_world_of_one, tie):
    """The FSDP2 trainer (boba's 4 ranks) had the whole (T, V) logits: ``_head`` refused sharded models.
    Now the fused head runs inside the root's forward: values and gradients (reduced by FSDP, float32)
    equal the written-out float64 computation on the same float32 master weights, and no op makes a
    tensor of T x V elements (the whole path, chunk 0, does: the check can fail)."""
    import copy

    from areal_async.trainer.compute.dp import full_tensor, shard_model

    base = model64(VARLEN_IMPL, tie).float()
    ref, packed = copy.deepcopy(base).double(), packed_batch()
    ref_logp, ref_ent = whole(ref, packed, 0.7)
    expected = grads(ref, loss_of(ref_logp, ref_ent))
    sharded = shard_model(use_varlen_attention(copy.deepcopy(base)), torch.float64, torch.device("cpu"))
    T = packed.ids_T.numel()
    for chunk in (4, 0):
        sharded.zero_grad()  # before forward: after it, the root's registered parameters are the gathered ones
        with _LargestVocabRow() as seen:
            logp, ent = forward_packed(sharded, packed, 0.7, with_entropy=True, chunk_tokens=chunk)
            got = grads(sharded, loss_of(logp, ent))
        assert seen.largest == (max(4, 16) * VOCAB if chunk else T * VOCAB)  # a chunk's logits or W.T (16 x V)
        assert_rel_close(logp.double(), ref_logp.detach())
        assert_rel_close(ent.double(), ref_ent.detach())
        assert sorted(got) == sorted(expected)
        for name, g in got.items():
            assert_rel_close(full_tensor(g).double(), expected[name])


def test_the_head_is_chunked_only_when_the_whole_logits_would_exceed_the_limit(monkeypatch):
    """25 tokens x 53 vocabulary x 4 bytes = 5,300 bytes of whole float32 logits: a limit of 5,300 keeps them
    whole, 5,299 chunks them (as the old rule did whenever a micro-batch was longer than a chunk); a
    micro-batch no longer than a chunk is whole whatever the limit. Which path ran: the chunked head's calls
    counted, and the numbers equal to that path's own."""
    from areal_async.trainer.compute import packing

    assert [packing.use_chunked_head(25, 53, 4, lim) for lim in (0, 5299, 5300)] == [True, True, False]
    assert not packing.use_chunked_head(25, 53, 25, 1) and not packing.use_chunked_head(25, 53, 0, 1)
    calls = []
    real = packing.head_logprobs
    monkeypatch.setattr(packing, "head_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, packed = model64(VARLEN_IMPL), packed_batch()
    whole_logp = forward_packed(model, packed, chunk_tokens=0)[0]
    chunked_logp = forward_packed(model, packed, chunk_tokens=4)[0]
    assert len(calls) == 1
    assert torch.equal(forward_packed(model, packed, chunk_tokens=4, whole_max_bytes=5300)[0], whole_logp)
    assert len(calls) == 1
    assert torch.equal(forward_packed(model, packed, chunk_tokens=4, whole_max_bytes=5299)[0], chunked_logp)
    assert len(calls) == 2
    assert ActorConfig().logits_whole_max_mb == 256


def test_the_micro_batch_loop_hands_forward_packed_its_chunk_and_its_limit(monkeypatch):
    """``iter_micro_batches`` (the trainer's forward) passes ``chunk_tokens`` and ``whole_max_bytes`` as such. Main
    passed them by position into forward_packed's ``(lean, chunk_tokens)``: the chunk became ``lean`` and the
    limit (256 MiB by default) the chunk, so no micro-batch's head was ever chunked (found by the gpu_check twin
    fsdp2_chunked_checkpointing, issue 36). Same sequences and limits as the test above, through the loop."""
    from areal_async.trainer.compute import packing
    from areal_async.trainer.compute.logprobs import iter_micro_batches

    calls = []
    real = packing.head_logprobs
    monkeypatch.setattr(packing, "head_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 4, 12)]  # one micro-batch of 25 tokens
    model = model64(VARLEN_IMPL)
    for limit, chunked in ((5300, 0), (5299, 1), (0, 1)):
        calls.clear()
        list(iter_micro_batches(model, seqs, 1.0, 64, chunk_tokens=4, whole_max_bytes=limit))
        assert len(calls) == chunked, (limit, calls)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("lean", [True, False])
def test_whole_logits_with_the_entropy_as_statistic_equal_the_written_out_float64(temperature, lean):
    """The whole-logits path keeps the softmax for backward (``chunked_head.whole_logprobs``): logprobs, the
    entropy statistic and every parameter's gradient of a weighted logprob sum equal log_softmax / softmax
    written out over the model's own logits."""
    model, packed = model64(VARLEN_IMPL, tie=True), packed_batch()
    ref_logp, ref_ent = whole(model, packed, temperature)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(ref_logp.shape[0], generator=g, dtype=torch.float64)
    ref = grads(model, (w * ref_logp).sum())
    logp, ent = forward_packed(model, packed, temperature, with_entropy=True, entropy_grad=False, lean=lean,
                               chunk_tokens=0)  # fmt: skip
    assert not ent.requires_grad
    assert_rel_close(logp, ref_logp)
    assert_rel_close(ent, ref_ent.detach())
    got = grads(model, (w * logp).sum())
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel_close(got[name], ref[name])


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("chunk", [0, 4])
def test_the_head_runs_on_the_scored_positions_only(lean, chunk, monkeypatch):
    """``PackedBatch.scored_T`` (the trainer's output-token scorers): the head sees those rows alone (counted
    where it runs), their logprobs, entropies and every gradient of a loss on them equal the whole-logits
    computation written out here (float64), and every other position is 0."""
    from areal_async.trainer.compute import packing

    model, packed = model64(VARLEN_IMPL), packed_batch()  # sequences of 9, 4, 12 tokens at 0, 9, 13
    scored = torch.tensor([3, 4, 5, 6, 7, 11, 20, 21, 22, 23])  # outputs after prompts of 4, 3 and 8 tokens
    packed.scored_T = scored
    rows = []
    real_head, real_linear = packing.head_logprobs, packing.module_linear
    monkeypatch.setattr(packing, "head_logprobs", lambda h, *a: rows.append(h.shape[0]) or real_head(h, *a))
    monkeypatch.setattr(packing, "module_linear", lambda m, h: rows.append(h.shape[0]) or real_linear(m, h))
    ref_logp, ref_ent = whole(model, packed, 0.7)
    ref = grads(model, loss_of(ref_logp[scored], ref_ent[scored]))
    logp, ent = forward_packed(model, packed, 0.7, with_entropy=True, lean=lean, chunk_tokens=chunk)
    assert rows == [10]  # one head call on the 10 scored rows (chunked or whole), not 25
    rest = torch.ones(25, dtype=torch.bool).index_fill_(0, scored, False)
    assert not logp[rest].any() and not ent[rest].any()
    assert_rel_close(logp[scored], ref_logp[scored])
    assert_rel_close(ent[scored], ref_ent[scored])
    got = grads(model, loss_of(logp[scored], ent[scored]))
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel_close(got[name], ref[name])
