"""TorchEngine: behaviour logprobs vs a no-cache forward, shared prefill, continuous batching,
interrupt-and-resume weight updates, finish reasons, abort, and a printed micro-benchmark."""

import time

import pytest
import torch

from protocols.trajectories import TrajectoryBatch

from areal_async.config import ModelConfig
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.engines.engine import GenRequest, group_output, group_rows, sample_row
from areal_async.rollout.engines.kv_cache import KVCache
from areal_async.rollout.engines.kv_decoder import HFDecoder, LeanLlama
from areal_async.rollout.engines.sampling import BLOCK, BLOCKED_MIN_V, draw_tokens, sample_tokens
from areal_async.rollout.engines.torch_engine import TorchEngine

TOK = build_char_tokenizer()
SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
PROMPTS = ["7+5=", "1", "what is 12+30? ", "ab"]  # different lengths: left padding must not leak


def _model(seed=0, cfg=SMALL):
    return build_model(cfg, len(TOK), seed)


def _req(gid, prompt, **kw):
    kw.setdefault("n", 3)
    kw.setdefault("max_new_tokens", 8)
    return GenRequest(gid, TOK.encode(prompt), **kw)


def _run(engine) -> dict[str, TrajectoryBatch]:
    done = {}
    while engine.has_work():
        done.update({o.group_id: o for o in engine.step()})
    return done


def _ref_logprobs(model, prompt_ids, out_ids, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each generated token from one full forward, no cache, no padding."""
    with torch.no_grad():
        logits_TV = model(torch.tensor([list(prompt_ids) + list(map(int, out_ids))])).logits[0].float()
    logp_TV = torch.log_softmax(logits_TV / temperature, -1)[len(prompt_ids) - 1 : -1]
    return logp_TV.gather(1, torch.as_tensor(out_ids)[:, None]).squeeze(1)


def _assert_logprobs_match(model, reqs, outs, temperature):
    for r in reqs:
        for s in outs[r.group_id].samples():
            ref = _ref_logprobs(model, r.prompt_ids, s.output_ids, temperature)
            torch.testing.assert_close(s.logprobs, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_equal_full_forward_with_mixed_prompt_lengths(temperature, top_p):
    model = _model()
    engine = TorchEngine(model, TOK, seed=1, version=0)
    reqs = [_req(f"g{i}", p, temperature=temperature, top_p=top_p) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    outs = _run(engine)
    assert sorted(outs) == sorted(r.group_id for r in reqs)
    assert all(
        len(o.samples()) == 3 and all(s.versions.tolist() == [0] * len(s.output_ids) for s in o.samples())
        for o in outs.values()
    )
    _assert_logprobs_match(model, reqs, outs, temperature)


@pytest.mark.parametrize(
    "arch,lean,layout",
    [("llama", True, None), ("qwen2", True, None), ("llama", False, None)]
    + [(arch, True, layout) for arch in ("llama", "qwen2") for layout in ("heads", "columns")],
)
def test_decoder_logprobs_equal_a_plain_hf_forward_to_1e5(arch, lean, layout):
    """fp32, random biases and norm weights, GQA, mixed prompt lengths: every sampled token's
    logprob equals HF's own no-cache forward of prompt + sample to 1e-5, in every KV cache layout
    (None: the default, rows-last at this head dim). Contexts run past 32 keys; frequent stop tokens
    end rows early, so finished rows sit in the batch (lazy compaction) while others decode."""
    model = _model(cfg=ModelConfig(**{**SMALL.__dict__, "arch": arch}))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    engine = TorchEngine(model, TOK, seed=7, version=0, lean=lean, kv_layout=layout)
    assert isinstance(engine.decoder, LeanLlama if lean else HFDecoder)
    assert engine.kv_layout == (layout or "rows_last")
    assert not lean or all(lp.folded for lp in engine.decoder._layers) and engine.decoder._head is not None
    stops = tuple(range(10, 16))
    reqs = [_req(f"g{i}", p, n=4, max_new_tokens=40, stop_token_ids=stops) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    outs = _run(engine)
    ends = []
    for r in reqs:
        for s in outs[r.group_id].samples():
            ref = _ref_logprobs(model, r.prompt_ids, s.output_ids)
            torch.testing.assert_close(s.logprobs, ref, atol=1e-5, rtol=0)
            ids = s.output_ids.tolist()
            enders = {*stops, TOK.eos_token_id}
            assert not set(ids[:-1]) & enders and (s.finish_reason == "stop") == (ids[-1] in enders)
            ends.append((len(ids), len(r.prompt_ids) + len(ids)))
    assert min(n for n, _ in ends) < 20 and max(c for _, c in ends) > 33


def test_group_prompt_is_prefilled_once_and_samples_differ():
    model = _model()
    shapes = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    engine = TorchEngine(model, TOK, seed=0)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(_req(f"g{i}", p, n=4, max_new_tokens=6))
    outs = _run(engine)
    prefills = [s for s in shapes if s[1] > 1]
    longest = max(len(p) for p in PROMPTS[:3])
    assert prefills == [(3, longest)]  # one forward of the whole prompt, one row per group (not per sample)
    assert shapes[len(prefills)][0] == 12  # then decoding runs over all 3 x 4 samples
    for o in outs.values():
        assert len({tuple(s.output_ids.tolist()) for s in o.samples()}) > 1


def test_greedy_and_tiny_top_p_give_identical_samples():
    model = _model()
    engine = TorchEngine(model, TOK, seed=0)
    engine.add_request(_req("greedy", PROMPTS[0], n=4, greedy=True, temperature=0.5))
    engine.add_request(_req("nucleus", PROMPTS[0], n=4, temperature=0.5, top_p=1e-6))
    outs = _run(engine)
    greedy = [s.output_ids.tolist() for s in outs["greedy"].samples()]
    assert all(g == greedy[0] for g in greedy)
    assert all(s.output_ids.tolist() == greedy[0] for s in outs["nucleus"].samples())  # nucleus of one token == argmax
    req = _req("x", PROMPTS[0])
    _assert_logprobs_match(model, [req], {"x": outs["greedy"]}, 1.0)  # greedy: temperature 1
    _assert_logprobs_match(model, [req], {"x": outs["nucleus"]}, 0.5)  # before top-p truncation


def test_top_p_samples_only_the_nucleus_and_reports_untruncated_logprobs():
    logits_BV = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)  # probs .64 .24 .09 .03
    B = len(logits_BV)
    gen = torch.Generator().manual_seed(0)
    tok_B, logp_B = sample_tokens(
        logits_BV, torch.ones(B), torch.full((B,), 0.7), torch.zeros(B, dtype=torch.bool), gen
    )
    assert set(tok_B.tolist()) == {0, 1}  # 0.64 < 0.7 needs token 1 too; 0.64 + 0.24 >= 0.7 stops there
    assert abs((tok_B == 0).float().mean().item() - 0.644 / 0.881) < 0.03  # renormalised inside the nucleus
    torch.testing.assert_close(logp_B, torch.log_softmax(logits_BV, -1).gather(1, tok_B[:, None]).squeeze(1))


def test_same_seed_reproduces_samples():
    model = _model()

    def sample(seed):
        engine = TorchEngine(model, TOK, seed=seed)
        engine.add_request(_req("g", PROMPTS[2], n=4))
        return [s.output_ids.tolist() for s in _run(engine)["g"].samples()]

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


@pytest.mark.parametrize("max_batch_groups,layout", [(16, None), (1, None), (16, "heads"), (1, "heads")])
def test_request_added_mid_generation_finishes_correctly(max_batch_groups, layout):
    model = _model()
    engine = TorchEngine(model, TOK, seed=2, max_batch_groups=max_batch_groups, version=0, kv_layout=layout)
    # the late prompt is longer than the running context: the running cache gets left-padded
    first, late = _req("first", PROMPTS[3], max_new_tokens=10), _req("late", PROMPTS[2], n=2, max_new_tokens=4)
    engine.add_request(first)
    outs = {o.group_id: o for _ in range(3) for o in engine.step()}
    engine.add_request(late)
    outs.update(_run(engine))
    assert sorted(outs) == ["first", "late"]
    assert all(len(s.output_ids) <= 4 for s in outs["late"].samples())
    _assert_logprobs_match(model, [first, late], outs, 1.0)
    assert len(engine.cohorts) == 0 and not engine.has_work()


def test_rows_left_after_the_longest_prompt_finishes_stay_correct():
    """When the longest-context rows leave, the all-padding cache columns are trimmed."""
    model = _model()
    engine = TorchEngine(model, TOK, seed=4, version=0)
    reqs = [_req("long", PROMPTS[2], n=2, max_new_tokens=2), _req("short", PROMPTS[1], n=2, max_new_tokens=9)]
    for r in reqs:
        engine.add_request(r)
    outs = {o.group_id: o for _ in range(3) for o in engine.step()}
    assert "long" in outs and engine.cohorts[0].t["mask_BT"].shape[1] == len(PROMPTS[1]) - 1 + 3
    outs.update(_run(engine))
    _assert_logprobs_match(model, reqs, outs, 1.0)


@pytest.mark.parametrize("layout", [None, "heads"])
def test_update_weights_mid_generation_recomputes_the_kv_cache(layout):
    old, new = _model(seed=0), _model(seed=1)
    old_sd = {k: v.clone() for k, v in old.state_dict().items()}
    engine = TorchEngine(_model(seed=0), TOK, seed=3, version=4, kv_layout=layout)
    reqs = [_req(f"g{i}", p, n=2, max_new_tokens=10) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    outs = {o.group_id: o for _ in range(4) for o in engine.step()}
    engine.update_weights(5, new.state_dict())
    assert engine.version == 5
    outs.update(_run(engine))
    old.load_state_dict(old_sd)
    for r in reqs:
        for s in outs[r.group_id].samples():
            k = min(4, len(s.output_ids))
            assert s.versions.tolist() == [4] * k + [5] * (len(s.output_ids) - k)
            ref_old = _ref_logprobs(old, r.prompt_ids, s.output_ids)[:k]
            ref_new = _ref_logprobs(new, r.prompt_ids, s.output_ids)[k:]  # prompt + ALL tokens, new weights
            torch.testing.assert_close(s.logprobs, torch.cat([ref_old, ref_new]), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda sd: sd.pop("model.norm.weight"), "missing weight 'model.norm.weight'"),
        (lambda sd: sd.__setitem__("model.norm.weight", torch.ones(7)), r"'model.norm.weight' has shape \(7,\)"),
        (lambda sd: sd.__setitem__("extra.weight", torch.ones(1)), "'extra.weight' is not a weight"),
    ],
)
def test_mismatched_state_dict_is_refused_and_old_weights_keep_working(mutate, match):
    model = _model()
    engine = TorchEngine(model, TOK, seed=0, version=0)
    req = _req("g", PROMPTS[0], max_new_tokens=6)
    engine.add_request(req)
    engine.step()
    bad = dict(_model(seed=7).state_dict())
    mutate(bad)
    with pytest.raises(ValueError, match=match):
        engine.update_weights(1, bad)
    assert engine.version == 0
    outs = _run(engine)
    assert all(s.versions.tolist() == [0] * len(s.output_ids) for s in outs["g"].samples())
    _assert_logprobs_match(model, [req], outs, 1.0)


def test_tied_embeddings_accept_state_dict_without_the_alias():
    cfg = ModelConfig(**{**SMALL.__dict__, "tie_word_embeddings": True})
    engine = TorchEngine(_model(cfg=cfg), TOK, seed=0)
    sd = dict(_model(seed=1, cfg=cfg).state_dict())
    sd.pop("lm_head.weight")
    engine.update_weights(0, sd)
    assert torch.equal(engine.model.lm_head.weight, sd["model.embed_tokens.weight"])


def test_length_stop_tokens_and_eos():
    model = _model()
    engine = TorchEngine(model, TOK, seed=0)
    engine.add_request(_req("len", PROMPTS[0], n=2, max_new_tokens=5, greedy=True))
    greedy = _run(engine)["len"].samples()
    assert [(len(s.output_ids), s.finish_reason) for s in greedy] == [(5, "length")] * 2
    first, second = greedy[0].output_ids[:2].tolist()
    engine.add_request(_req("stop", PROMPTS[0], n=2, max_new_tokens=5, greedy=True, stop_token_ids=(second,)))
    stopped = [(s.output_ids.tolist(), s.finish_reason) for s in _run(engine)["stop"].samples()]
    assert stopped == [([first, second], "stop")] * 2
    eos_engine = TorchEngine(model, first, seed=0)  # eos given as an id
    eos_engine.add_request(_req("eos", PROMPTS[0], n=1, max_new_tokens=5, greedy=True))
    assert [(s.output_ids.tolist(), s.finish_reason) for s in _run(eos_engine)["eos"].samples()] == [([first], "stop")]


def test_abort_all_returns_unfinished_work_as_abort():
    engine = TorchEngine(_model(), TOK, seed=0)
    engine.add_request(_req("running", PROMPTS[0], n=2, max_new_tokens=10, greedy=True))
    engine.add_request(_req("short", PROMPTS[1], n=1, max_new_tokens=1))
    stepped = [o for _ in range(2) for o in engine.step()]
    engine.add_request(_req("queued", PROMPTS[2], n=3))
    aborted = {o.group_id: o for o in engine.abort_all()}
    assert [o.group_id for o in stepped] == ["short"] and sorted(aborted) == ["queued", "running"]
    assert [(len(s.output_ids), s.finish_reason) for s in aborted["running"].samples()] == [(2, "abort")] * 2
    assert [(s.output_ids.tolist(), s.finish_reason) for s in aborted["queued"].samples()] == [([], "abort")] * 3
    assert not engine.has_work() and engine.step() == []


def test_bad_requests_are_refused_with_the_field_named():
    engine = TorchEngine(_model(), TOK)
    with pytest.raises(ValueError, match="temperature=0"):
        engine.add_request(_req("a", "1", temperature=0))
    with pytest.raises(ValueError, match="top_p=1.5"):
        engine.add_request(_req("a", "1", top_p=1.5))
    with pytest.raises(ValueError, match="token id 999"):
        engine.add_request(GenRequest("a", [5, 999], n=1, max_new_tokens=2))
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        engine.add_request(_req("a", "1", max_new_tokens=300))
    engine.add_request(_req("a", "1"))
    with pytest.raises(ValueError, match="'a' is already generating"):
        engine.add_request(_req("a", "2"))


def test_microbenchmark_tokens_per_second():
    """Printed, not asserted: 16 groups x 8 samples x 16 tokens, hidden 64, 2 layers."""
    engine = TorchEngine(build_model(ModelConfig(hidden_size=64, num_hidden_layers=2), len(TOK), 0), -1, seed=0)
    for i in range(16):  # eos id -1 never matches: every sample runs the full 16 tokens
        engine.add_request(GenRequest(f"g{i}", TOK.encode(f"{i}+{2 * i}="), n=8, max_new_tokens=16))
    start = time.perf_counter()
    outs = _run(engine)
    elapsed = time.perf_counter() - start
    n_tokens = sum(len(s.output_ids) for o in outs.values() for s in o.samples())
    assert n_tokens == 16 * 8 * 16
    print(f"\nTorchEngine CPU: {n_tokens} tokens in {elapsed:.3f}s = {n_tokens / elapsed:,.0f} tokens/s")


def test_draw_tokens_follows_unnormalised_rows_and_never_draws_zero_mass():
    row = torch.tensor([0.0, 0.6, 0.0, 1.8, 0.6, 0.0])  # mass 3: expected frequencies 0.2, 0.6, 0.2 on tokens 1, 3, 4
    tok_B = draw_tokens(row.repeat(20000, 1), torch.Generator().manual_seed(3))
    counts = torch.bincount(tok_B, minlength=6).float() / 20000
    assert counts[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(counts[[1, 3, 4]], torch.tensor([0.2, 0.6, 0.2]), atol=0.015, rtol=0)
    one_hot = torch.zeros(50, 6)
    one_hot[:, 5] = 1e-30  # only the last token has mass, and hardly any
    assert draw_tokens(one_hot, torch.Generator().manual_seed(0)).tolist() == [5] * 50


def test_wide_rows_are_drawn_block_first_with_the_same_frequencies():
    """Rows of >= BLOCKED_MIN_V tokens take the two-level draw: the frequencies of a hand-made row (mass in
    the first, a middle and the padded last block, zero-mass blocks between, a zero inside a block)
    follow the masses, and no zero-mass token is ever drawn."""
    V = BLOCKED_MIN_V + 100  # not a multiple of BLOCK: the last block is padded with zeros
    row = torch.zeros(V)
    row[[3, 2 * BLOCK + 7, 2 * BLOCK + 9, V - 1]] = torch.tensor([1.0, 0.5, 2.0, 0.5])  # mass 4
    tok_B, mass_B1 = draw_tokens(row.repeat(20000, 1), torch.Generator().manual_seed(5), with_mass=True)
    assert set(tok_B.unique().tolist()) <= {3, 2 * BLOCK + 7, 2 * BLOCK + 9, V - 1}
    counts = torch.bincount(tok_B, minlength=V).float()[[3, 2 * BLOCK + 7, 2 * BLOCK + 9, V - 1]] / 20000
    torch.testing.assert_close(counts, torch.tensor([0.25, 0.125, 0.5, 0.125]), atol=0.015, rtol=0)
    assert mass_B1.flatten().tolist() == [4.0] * 20000
    tiny = torch.zeros(40, V)
    tiny[:, BLOCK + 1] = 1e-30  # one token with hardly any mass, in the second block
    assert draw_tokens(tiny, torch.Generator().manual_seed(0)).tolist() == [BLOCK + 1] * 40


def test_sampled_logprobs_equal_log_softmax_at_a_wide_vocabulary():
    """The sampler's logprob (no (B, V) log-softmax made) equals torch's log_softmax at the drawn token,
    greedy and sampled rows mixed, temperature 1 and not."""
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(16, 49152, generator=gen) * 4
    greedy = torch.arange(16) % 3 == 0
    for temp in (1.0, 0.7):
        temp_B = torch.full((16,), temp)
        tok, logp = sample_tokens(z, temp_B, torch.ones(16), greedy, gen)
        scaled = torch.where(greedy[:, None], z, z / temp)
        ref = torch.log_softmax(scaled, -1).gather(1, tok[:, None]).squeeze(1)
        torch.testing.assert_close(logp, ref, atol=2e-5, rtol=0)
        assert torch.equal(tok[greedy], z[greedy].argmax(-1))


def test_greedy_tokens_and_logprobs_equal_hf_generate():
    """Greedy decoding (GQA, mixed prompt lengths decoded in one batch) picks the tokens HF
    ``generate`` picks for each prompt alone, and each token's logprob is log_softmax of HF's own
    logits at that step to 1e-5."""
    model = _model(seed=5)
    engine = TorchEngine(model, -1, seed=0, version=0)  # eos -1: every sample runs 8 tokens
    for i, p in enumerate(PROMPTS):
        engine.add_request(_req(f"g{i}", p, n=2, max_new_tokens=8, greedy=True))
    outs = _run(engine)
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([TOK.encode(p)])
        with torch.no_grad():
            ref = model.generate(
                ids,
                do_sample=False,
                max_new_tokens=8,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = ref.sequences[0, ids.shape[1] :]
        logp = torch.stack([torch.log_softmax(lg[0].float(), -1)[t] for lg, t in zip(ref.logits, tokens)])
        for s in outs[f"g{i}"].samples():
            assert s.output_ids.tolist() == tokens.tolist()
            torch.testing.assert_close(s.logprobs, logp, atol=1e-5, rtol=0)


def test_weights_changed_in_place_outside_update_weights_are_used():
    """A model the engine shares may be trained in place (an optimizer step, ``load_state_dict``):
    the next generation uses the new weights, fused projection copies included."""
    model = _model()
    engine = TorchEngine(model, TOK, seed=0, version=0)
    engine.add_request(_req("before", PROMPTS[0]))
    _run(engine)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    req = _req("after", PROMPTS[2])
    engine.add_request(req)
    _assert_logprobs_match(model, [req], _run(engine), 1.0)
    assert all(lp.folded for lp in engine.decoder._layers)  # the norm weights live in the fused copies
    with torch.no_grad():  # only the norms change: the copies that fold them in must follow
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(torch.linspace(0.5, 2.0, p.numel()))
    req = _req("norms", PROMPTS[2])
    engine.add_request(req)
    _assert_logprobs_match(model, [req], _run(engine), 1.0)


def test_parameters_replaced_by_new_objects_are_used():
    """A parameter replaced by a new ``nn.Parameter`` (assignment, ``load_state_dict(assign=True)``)
    is read from its module at the next forward (the engine looks parameters up in the modules'
    parameter dicts, not in copies of the objects): fused projections, the o/down projections
    and the lm head all follow, checked against HF's own no-cache forward."""
    model = _model()
    engine = TorchEngine(model, TOK, seed=0, version=0)
    engine.add_request(_req("before", PROMPTS[0]))
    _run(engine)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) or type(module).__name__.endswith("RMSNorm"):
                w = module.weight
                module.weight = torch.nn.Parameter(w + 0.5 * w.abs().mean() * torch.randn(w.shape, generator=gen))
    req = _req("after", PROMPTS[2])
    engine.add_request(req)
    _assert_logprobs_match(model, [req], _run(engine), 1.0)


@pytest.mark.parametrize("fuse", [True, False])
def test_the_reordered_head_follows_in_place_and_replaced_weights(fuse, monkeypatch):
    """The lm head runs on a reordered copy of its weight (CPU float32); changed in place, then replaced by a new
    parameter, the next generation's logprobs still equal HF's own forward. Fused: the copy carries the final
    norm's weight (a packed ``_Cat``, which keeps no plain copy); unfused (models above ``FUSE_MAX_PARAMS``, as
    the real ones, unless ``linears`` is packed): the copy is of the head's own weight (``_OneDNN``)."""
    if not fuse:
        monkeypatch.setattr(LeanLlama, "FUSE_MAX_PARAMS", 0)
    model = _model()
    engine = TorchEngine(model, TOK, seed=0, version=0)
    dec = engine.decoder
    if fuse:
        assert dec._packed is None and dec._head.kernel == "packed"
    else:
        assert dec._packed is not None and dec._head is None
    for change in ("none", "in place", "replaced"):
        with torch.no_grad():
            if change == "in place":
                model.lm_head.weight.mul_(torch.linspace(0.5, 2.0, model.lm_head.weight.shape[1]))
            elif change == "replaced":
                model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.flip(0).clone())
        req = _req(change, PROMPTS[2])
        engine.add_request(req)
        _assert_logprobs_match(model, [req], _run(engine), 1.0)
        if fuse:  # the reordered copy is all the head's fused form holds: no plain copy beside it
            assert dec._head.w.is_mkldnn and dec._head.w.shape == model.lm_head.weight.shape


@pytest.mark.parametrize("linears", ["blas", "onednn", "packed", "auto"])
def test_each_layer_kernel_follows_in_place_and_replaced_weights_on_every_path(linears, monkeypatch):
    """Above ``FUSE_MAX_PARAMS`` (as the real models): the layers' projections run on oneDNN
    (``rollout.engine_linears``: on the weights as they are) or on F.linear, one call per projection, or, packed,
    q/k/v and gate/up fused (norm weights folded in) and every matmul on a reordered copy, the fused ones keeping
    no plain copy; on every decoder path (prefill, cached decode, a KV recompute after update_weights), with
    weights changed in place and replaced by new parameters, the logprobs equal HF's own forward, and the layers
    hold the kernel asked for."""
    monkeypatch.setattr(LeanLlama, "FUSE_MAX_PARAMS", 0)
    model = _model()
    engine = TorchEngine(model, TOK, seed=0, version=0, linears=linears)
    chosen = engine.decoder.linears  # auto: onednn where it timed faster on this CPU, else blas
    assert chosen == linears or (linears, chosen) in (("auto", "onednn"), ("auto", "blas"))
    layers = engine.decoder._layers
    dnn = [d for lp in layers for d in lp.dnn.values()]
    per_layer = {"blas": 0, "onednn": 7, "packed": 2}[chosen]  # packed: o and down; q/k/v and gate/up fused
    assert len(dnn) == 2 * per_layer and all(d.pack == (chosen == "packed") for d in dnn)
    cats = [c for lp in layers for c in (lp.qkv_cat, lp.gate_up_cat)]
    assert all(c is None for c in cats) if chosen != "packed" else all(c.kernel == "packed" for c in cats)
    assert all(lp.folded for lp in layers) == (chosen == "packed")
    gen = torch.Generator().manual_seed(5)
    for change in ("none", "in place", "replaced"):
        with torch.no_grad():
            for layer in model.model.layers:
                for m in (layer.self_attn.q_proj, layer.mlp.down_proj):
                    noise = 0.5 * m.weight.abs().mean() * torch.randn(m.weight.shape, generator=gen)
                    if change == "in place":
                        m.weight.add_(noise)
                    elif change == "replaced":
                        m.weight = torch.nn.Parameter(m.weight + noise)
        req = _req(change, PROMPTS[2], max_new_tokens=10)
        engine.add_request(req)
        engine.step(), engine.step()  # the prefill and a decode step under the weights before the update below
        engine.update_weights(1, {k: v.clone() for k, v in model.state_dict().items()})  # running rows: recomputed
        _assert_logprobs_match(model, [req], _run(engine), 1.0)
    if chosen == "packed":
        assert all(c.w.is_mkldnn for c in cats)  # only the reordered form is held
    with pytest.raises(ValueError, match="linears='mkl': expected one of"):
        TorchEngine(model, TOK, linears="mkl")


def test_auto_takes_onednn_only_where_it_timed_faster(monkeypatch):
    """``onednn_pays`` against timings given by hand: oneDNN at 0.89 of F.linear's best time pays, at 0.91 not (the
    10 % margin), the best of the calls counted (one slow call does not decide), and without oneDNN never."""
    from areal_async.models import lean_ops

    def timed(blas: list[float], onednn: list[float]) -> bool:
        clock = iter(x for pair in zip(blas, onednn) for t in pair for x in (0.0, t))  # start, end per call
        monkeypatch.setattr(lean_ops.time, "perf_counter", lambda: next(clock))
        lean_ops.onednn_pays.cache_clear()
        return lean_ops.onednn_pays(16, 24)

    assert timed([1.0] * 5, [0.89] * 5) and not timed([1.0] * 5, [0.91] * 5)
    assert timed([1.0, 1.0, 1.0, 1.0, 1.0], [5.0, 5.0, 0.8, 5.0, 5.0])  # the best of 5
    monkeypatch.setattr(lean_ops, "onednn_usable", lambda w: False)
    lean_ops.onednn_pays.cache_clear()
    assert not lean_ops.onednn_pays(16, 24)
    lean_ops.onednn_pays.cache_clear()


def test_samples_ending_at_different_steps_come_back_whole_across_compactions():
    """A third of the vocabulary stops a sample, so the samples of a group end at different steps
    and finished rows are compacted away (set aside) while their group still runs: every group
    comes back with all its samples, each cut at its first stop token (or at max_new_tokens), with
    the logprobs of a full forward, and its packed and per-sample forms agree."""
    model = _model()
    stops = tuple(range(0, len(TOK), 3))
    engine = TorchEngine(model, -1, seed=3, version=0)
    set_aside = []
    real_set_aside = engine._set_aside
    engine._set_aside = lambda c, idx, *a: (set_aside.append(len(idx)), real_set_aside(c, idx, *a))
    reqs = [_req(f"g{i}", p, n=4, max_new_tokens=6, stop_token_ids=stops) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    outs = _run(engine)
    assert sorted(outs) == [r.group_id for r in reqs] and set_aside  # the set-aside path ran
    lengths = set()
    for r in reqs:
        o = outs[r.group_id]
        assert len(o.samples()) == 4 and o.lengths == [len(s.output_ids) for s in o.samples()]
        assert o.finish_reasons == [s.finish_reason for s in o.samples()]
        assert torch.equal(o.output_ids, torch.cat([s.output_ids for s in o.samples()]))
        assert {(s.output_ids.dtype, s.versions.dtype) for s in o.samples()} == {(torch.int32, torch.int32)}
        for s in o.samples():
            ids = s.output_ids.tolist()
            stop_at = [i for i, t in enumerate(ids) if t in stops]
            if s.finish_reason == "stop":
                assert stop_at == [len(ids) - 1]
            else:
                assert (s.finish_reason, stop_at, len(ids)) == ("length", [], 6)
            assert s.versions.tolist() == [0] * len(ids)
            lengths.add(len(ids))
    assert len(lengths) > 2  # samples really ended at different steps
    _assert_logprobs_match(model, reqs, outs, 1.0)


def test_abort_all_keeps_the_samples_that_finished_before_it():
    """Samples that ended (stop token) before ``abort_all`` keep their tokens and reason; the
    others come back as "abort" with the tokens they had."""
    model = _model()
    stops = tuple(range(0, len(TOK), 3))
    engine = TorchEngine(model, -1, seed=5, version=0)
    req = _req("g", PROMPTS[0], n=8, max_new_tokens=50, stop_token_ids=stops)
    engine.add_request(req)
    done = [o for _ in range(2) for o in engine.step()]
    (out,) = engine.abort_all()
    assert done == [] and out.group_id == "g"
    reasons = [s.finish_reason for s in out.samples()]
    assert "stop" in reasons and "abort" in reasons
    for s in out.samples():
        ids = s.output_ids.tolist()
        stopped = [i for i, t in enumerate(ids) if t in stops]
        assert (stopped == [len(ids) - 1]) if s.finish_reason == "stop" else (stopped == [] and len(ids) == 2)
    _assert_logprobs_match(model, [req], {"g": out}, 1.0)


def test_an_engine_gives_a_group_as_the_trajectory_type_packed_or_from_its_rows():
    """``group_output`` (an engine with a group's outputs end to end) and ``group_rows`` of ``sample_row``
    rows (an engine that finishes samples one by one) give the same batch: the request's sample ids and
    prompt, one dtype a column, the finish reasons; the rows of a batch are views of its tensors."""
    req = GenRequest("g", [1, 2], n=3, max_new_tokens=4, sample_ids=("a", "b", "c"))
    packed = group_output(req, [1, 0, 3], torch.tensor([4, 5, 6, 7]), [-0.5, -1.0, -2.0, -0.25], [3, 3, 4, 4],
                          ["stop", "abort", "length"])  # fmt: skip
    rows = packed.samples()
    assert [(s.sample_id, s.output_ids.tolist(), s.logprobs.tolist(), s.versions.tolist(), s.finish_reason)
            for s in rows] == [
        ("a", [4], [-0.5], [3], "stop"),
        ("b", [], [], [], "abort"),
        ("c", [5, 6, 7], [-1.0, -2.0, -0.25], [3, 4, 4], "length"),
    ]  # fmt: skip
    assert rows[2].output_ids.data_ptr() == packed.output_ids.data_ptr() + 4  # int32: one token in
    one_by_one = [sample_row(req, i, s.output_ids.tolist(), s.logprobs, s.versions, s.finish_reason)
                  for i, s in enumerate(rows)]  # fmt: skip
    again = group_rows(one_by_one)
    assert (again.sample_ids, again.output_ids.tolist(), again.lengths, again.finish_reasons) == (
        ["a", "b", "c"],
        [4, 5, 6, 7],
        [1, 0, 3],
        ["stop", "abort", "length"],
    )
    assert {t.dtype for t in (again.prompt_ids, again.output_ids, again.versions)} == {torch.int32}
    assert again.versions.tolist() == [3, 3, 4, 4] and again.group_id == "g" and again.n_samples == 3
    assert group_output(GenRequest("h", [1], n=2, max_new_tokens=1), [1, 1], [2, 3], [0.0, 0.0], [0, 0],
                        ["stop"] * 2).sample_ids == ["h/0", "h/1"]  # fmt: skip
    with pytest.raises(ValueError, match="sample_ids=\\('a',\\), expected none or n=3 ids"):
        GenRequest("g", [1, 2], n=3, max_new_tokens=4, sample_ids=("a",)).validate()


# each layout's shape for capacity 5, 2 layers, 3 kv heads, head dim 4, 6 rows; where its columns and rows are
LAYOUT_SHAPES = {
    "rows_last": ((5, 2, 3, 4, 6), 0, 4),
    "columns": ((5, 2, 6, 3, 4), 0, 2),
    "heads": ((2, 6, 3, 5, 4), 3, 1),
}


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
@pytest.mark.parametrize("start", [0, 1, 3])
def test_kv_cache_row_gathers_equal_index_select_of_the_filled_columns(layout, start):
    """``select`` and ``repeat_rows`` gather the filled columns of the chosen rows; they must equal a
    plain ``index_select`` of the 5D buffers' filled columns, with the room after them kept."""
    gen = torch.Generator().manual_seed(0)
    shape, c, d = LAYOUT_SHAPES[layout]
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    cache = KVCache(k, v, 3, layout)
    rows = torch.tensor([4, 0, 4, 5])
    for got, first in ((cache.select(rows, start), start), (cache.repeat_rows(rows), 0)):
        assert got.T == 3 - first and got.k.shape[c] == 5 - first and got.n_rows == 4 and got.capacity == 5 - first
        for mine, full in ((got.k, k), (got.v, v)):
            want = full.narrow(c, first, 3 - first).index_select(d, rows)
            assert torch.equal(mine.narrow(c, 0, got.T), want)


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_kv_cache_merge_left_pads_the_shorter_cache_with_zeros(layout):
    """Rows of the first cache then the second's; the one with fewer filled columns gets zero columns in
    front, the room is the larger of the two (checked against a per-row rebuild by hand)."""
    gen = torch.Generator().manual_seed(1)
    shape, c, d = LAYOUT_SHAPES[layout]
    a = KVCache(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), 3, layout)  # 3 + 2 room
    b = KVCache(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), 1, layout)  # 1 + 4 room
    m = a.merge(b)
    assert (m.T, m.room, m.n_rows, m.nbytes) == (3, 4, 12, a.merged_nbytes(b))
    for kind in "kv":
        got = getattr(m, kind).narrow(c, 0, 3)
        first = getattr(a, kind).narrow(c, 0, 3)
        second = getattr(b, kind).narrow(c, 0, 1)
        assert torch.equal(got.narrow(d, 0, 6), first)
        assert torch.equal(got.narrow(d, 6, 6).narrow(c, 2, 1), second)
        assert not got.narrow(d, 6, 6).narrow(c, 0, 2).any()


def test_default_layout_follows_the_head_dim_and_a_bad_layout_is_refused():
    assert TorchEngine(_model(), TOK).kv_layout == "rows_last"  # head dim 8
    wide = ModelConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1)  # fmt: skip
    assert TorchEngine(_model(cfg=wide), TOK).kv_layout == "heads"  # head dim 64
    with pytest.raises(ValueError, match="kv_layout='rows'"):
        TorchEngine(_model(), TOK, kv_layout="rows")


# ---- the KV cache budget (rollout/engines/kv_budget.py) ----------------------------------------------

# SMALL by hand: 2 layers x 2 KV heads x head_dim 32/4 = 8 x (keys, values) x 4 bytes (float32) = 256 bytes
SMALL_POSITION_BYTES = 2 * 2 * 8 * 2 * 4


def test_kv_cache_bytes_by_hand():
    model = _model()
    eng = TorchEngine(model, TOK, kv_cache_bytes=10_000)
    assert eng.kv_budget.per_position == SMALL_POSITION_BYTES
    cache = KVCache.empty(model, 3, 10)
    assert cache.nbytes == 3 * 10 * SMALL_POSITION_BYTES
    other = KVCache.empty(model, 2, 14)
    other.T = 5  # 5 filled + 9 room; cache: 0 filled + 10 room -> merged: 5 + 10 columns, 5 rows
    assert cache.merged_nbytes(other) == cache.merge(other).nbytes == 5 * 15 * SMALL_POSITION_BYTES


def test_a_group_that_cannot_fit_alone_is_refused_naming_its_need():
    prompt = TOK.encode("what is 12+30? ")  # 15 tokens
    need = (3 + 1) * (len(prompt) + 8) * SMALL_POSITION_BYTES  # 3 samples + the prefill row, 8 new tokens
    eng = TorchEngine(_model(), TOK, kv_cache_bytes=need - 1)
    with pytest.raises(ValueError, match=r"needs 0\.0 MiB \(\(3 samples \+ 1 prefill row\) x \(15 prompt \+ 8 new"):
        eng.add_request(GenRequest("g", prompt, n=3, max_new_tokens=8))
    assert not eng.has_work()  # nothing was queued
    eng = TorchEngine(_model(), TOK, kv_cache_bytes=need)
    eng.add_request(GenRequest("g", prompt, n=3, max_new_tokens=8))
    assert len(_run(eng)["g"].samples()) == 3
    with pytest.raises(ValueError, match="kv_cache_bytes=-1"):
        TorchEngine(_model(), TOK, kv_cache_bytes=-1)


def test_the_budget_bounds_the_live_caches_and_changes_no_token():
    """Greedy (float64): the same tokens as without a bound, while the live caches never exceed a
    budget of one and a half of the largest group; unbounded, all four groups run at once."""
    model = _model().double()
    reqs = [_req(f"g{i}", p, greedy=True) for i, p in enumerate(PROMPTS)]
    largest = max((3 + 1) * (len(r.prompt_ids) + 8) for r in reqs) * 2 * SMALL_POSITION_BYTES  # float64
    budget = largest * 3 // 2
    outs, peaks = {}, {}
    for bound in (0, budget):
        eng = TorchEngine(model, TOK, kv_cache_bytes=bound)
        for r in reqs:
            eng.add_request(r)
        outs[bound], most = {}, 0
        while eng.has_work():
            outs[bound].update({o.group_id: o for o in eng.step()})
            assert not bound or eng.kv_bytes() <= bound
            most = max(most, sum(len(c.rows) for c in eng.cohorts))
        peaks[bound] = (most, eng.kv_peak_bytes)
    assert peaks[0][0] == 4 * 3 and peaks[0][1] > budget  # unbounded: every row at once, over the budget
    assert peaks[budget][0] < 4 * 3 and peaks[budget][1] <= budget

    def tokens(out):
        return [s.output_ids.tolist() for s in out.samples()]

    assert {g: tokens(o) for g, o in outs[budget].items()} == {g: tokens(o) for g, o in outs[0].items()}


def test_token_entropy_is_each_tokens_sampling_entropy_from_a_full_forward():
    """``token_entropy``: every generated token comes with the entropy of softmax(logits / T) it was drawn from
    (before top-p), here against ``torch.distributions.Categorical`` over one full no-cache forward; rows set
    aside (stop tokens end samples at different steps) and whole groups alike; off, no entropy column."""
    model = _model()
    stops = tuple(range(0, len(TOK), 3))
    engine = TorchEngine(model, -1, seed=3, version=0, token_entropy=True)
    set_aside, real_set_aside = [], engine._set_aside
    engine._set_aside = lambda c, idx, *a: (set_aside.append(len(idx)), real_set_aside(c, idx, *a))
    reqs = [_req(f"g{i}", p, n=4, temperature=0.7, top_p=0.9, stop_token_ids=stops) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    outs = _run(engine)
    assert set_aside  # the set-aside path ran
    for r in reqs:
        assert outs[r.group_id].entropy.dtype == torch.float32
        for s in outs[r.group_id].samples():
            with torch.no_grad():
                logits_TV = model(torch.tensor([r.prompt_ids + s.output_ids.tolist()])).logits[0].float()
            at = logits_TV[len(r.prompt_ids) - 1 : -1] / 0.7
            torch.testing.assert_close(
                s.entropy, torch.distributions.Categorical(logits=at).entropy(), atol=1e-4, rtol=0
            )
    plain = TorchEngine(model, -1, seed=3, version=0)
    plain.add_request(_req("p", PROMPTS[0]))
    out = _run(plain)["p"]
    assert out.entropy is None and list(out.encode()[1]) == ["prompt_ids", "output_ids", "logprobs", "versions"]
