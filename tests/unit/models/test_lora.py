"""LoRA (models/lora.py): adapter size by hand, only adapter parameters train, merged == unmerged engine
log-probs, adapter-only publication bytes by hand, checkpoints holding the adapter alone, config refusals."""

from __future__ import annotations

import pytest
import torch

from areal_async.config import ActorConfig, ConfigError, LoraConfig, ModelConfig
from areal_async.models import lora
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.trainer.actor import PPOActor
from protocols.trajectories import Trajectory
from areal_async.transport.buckets import plan


TOK = build_char_tokenizer()
# hidden 32, MLP 48, 4 heads of 8, 2 KV heads (k/v out 16), 2 layers: small numbers to count by hand
CFG = ModelConfig(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model(seed: int = 0):
    return build_model(CFG, len(TOK), seed)


def _random_adapter(model, spec: lora.LoraSpec, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 0.2 for k, s in lora.adapter_shapes(model, spec).items()}


def test_adapter_param_count_is_r_times_in_plus_out_per_layer():
    # per layer, r (in + out): q 32+32, k 32+16, v 32+16, o 32+32, gate 32+48, up 32+48, down 48+32
    per_layer_r1 = 64 + 48 + 48 + 64 + 80 + 80 + 80
    for r, targets, expected in [(4, ALL, 4 * per_layer_r1 * 2), (8, ("q_proj", "v_proj"), 8 * (64 + 48) * 2)]:
        spec = lora.LoraSpec(r, 16.0, targets)
        model = _model()
        assert lora.adapter_numel(model, spec) == expected
        lora.inject(model, spec, seed=0)
        assert sum(p.numel() for p in lora.adapter_params(model).values()) == expected
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected


def _traj(i: int, prompt: list[int], out: list[int], score: float) -> Trajectory:
    n = len(out)
    return Trajectory(
        sample_id=f"s{i}",
        group_id=f"g{i // 2}",
        prompt_ids=torch.tensor(prompt),
        output_ids=torch.tensor(out),
        logprobs=torch.full((n,), -2.0),
        versions=torch.zeros(n, dtype=torch.long),
        score=score,
    )


def test_only_adapter_params_get_gradients_and_optimizer_state():
    model = _model()
    frozen_before = {k: v.clone() for k, v in lora.base_state(model).items()}
    spec = lora.LoraSpec(4, 8.0, ("q_proj", "down_proj"))
    lora.inject(model, spec, seed=0)
    actor = PPOActor(model, ActorConfig(), temperature=1.0, total_steps=4)
    trajs = [_traj(i, TOK.encode("1+2="), TOK.encode(str(i)), float(i % 2)) for i in range(4)]
    actor.train_step(trajs)
    state = actor.optimizer.state
    trained = {id(p) for p in state}
    adapter = lora.adapter_params(actor.model)
    assert trained == {id(p) for p in adapter.values()}  # AdamW state for the adapter alone
    assert all(state[p]["exp_avg"].abs().sum() > 0 for k, p in adapter.items() if "lora_B" in k)
    after = lora.base_state(actor.model)
    assert all(torch.equal(after[k], v) for k, v in frozen_before.items())  # the base did not move
    assert any(p.abs().sum() > 0 for k, p in adapter.items() if "lora_B" in k)  # B left zero: it trained
    published = actor.publish_state(torch.float32, 1 << 20)
    assert sorted(published) == sorted(lora.adapter_shapes(_model(), spec))


def _engine_logprobs(merged: bool, adapter: dict, spec: lora.LoraSpec, lean: bool = True):
    model = _model()
    engine = TorchEngine(model, TOK, seed=0, adapter=lora.EngineAdapter(model, spec, merged), lean=lean)
    engine.update_weights(1, adapter)
    for i, p in enumerate(["7+5=", "12+30=", "1"]):
        engine.add_request(GenRequest(f"g{i}", TOK.encode(p), n=2, max_new_tokens=10, greedy=True))
    out = {}
    while engine.has_work():
        out.update({o.group_id: o for o in engine.step()})
    return {g: [(s.output_ids.tolist(), s.logprobs) for s in o.samples()] for g, o in sorted(out.items())}


@pytest.mark.parametrize("lean", [True, False])
def test_merged_and_unmerged_engine_logprobs_equal_to_1e5(lean):
    spec = lora.LoraSpec(4, 8.0, ALL)
    adapter = _random_adapter(_model(), spec)
    merged, unmerged = (_engine_logprobs(m, adapter, spec, lean) for m in (True, False))
    plain = _engine_logprobs(True, {k: torch.zeros_like(v) for k, v in adapter.items()}, spec, lean)
    assert merged.keys() == unmerged.keys()
    for g in merged:
        for (ids_m, lp_m), (ids_u, lp_u) in zip(merged[g], unmerged[g]):
            assert ids_m == ids_u
            torch.testing.assert_close(lp_m, lp_u, atol=1e-5, rtol=0)
    diff = max((lp_m - lp_p).abs().max() for g in merged for (_, lp_m), (_, lp_p) in zip(merged[g], plain[g]))
    assert diff > 1e-2  # the adapter changed the model: equal log-probs are not equal by doing nothing


def test_engine_adapter_equals_the_trainers_peft_forward():
    """The trainer's model (PEFT's layers) and the engine's merged weights give the same logits."""
    spec = lora.LoraSpec(4, 8.0, ("q_proj", "v_proj", "gate_proj"))
    trainer = lora.inject(_model(), spec, seed=0)
    with torch.no_grad():
        for k, p in lora.adapter_params(trainer).items():
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(k)))
    sent = {k: v.detach().clone() for k, v in lora.adapter_params(trainer).items()}
    engine_model = _model()
    lora.EngineAdapter(engine_model, spec, merged=True).load(sent)
    ids = torch.tensor([TOK.encode("12+30=42")])
    with torch.no_grad():
        torch.testing.assert_close(engine_model(ids).logits, trainer(ids).logits, atol=1e-5, rtol=0)


def test_engine_refuses_a_bad_adapter_and_keeps_its_weights():
    spec = lora.LoraSpec(4, 8.0, ("q_proj",))
    model = _model()
    engine = TorchEngine(model, TOK, adapter=lora.EngineAdapter(model, spec, merged=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = _random_adapter(model, spec)
    name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    for bad, says in [
        ({**good, name: torch.zeros(3, 32)}, "has shape (3, 32), expected (4, 32)"),
        ({k: v for k, v in good.items() if k != name}, f"missing {name!r}"),
        ({**good, "model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 32)}, "is not one of this adapter's"),
    ]:
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            engine.update_weights(1, bad)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert engine.version == -1


def test_adapter_only_publication_bytes_equal_the_formula():
    spec = lora.LoraSpec(8, 16.0, ALL)
    model = lora.inject(_model(), spec, seed=0)
    actor = PPOActor(model, ActorConfig(), temperature=1.0, total_steps=1)
    sd = actor.publish_state(torch.bfloat16, 1 << 20)
    per_layer_r1 = 64 + 48 + 48 + 64 + 80 + 80 + 80
    payload = sum(s.nbytes for s in plan(sd, 1 << 20).slots)
    assert payload == 8 * per_layer_r1 * 2 * 2  # r (in + out), 2 layers, 2 bytes (bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())


def test_adapter_files_round_trip_and_merge(tmp_path):
    spec = lora.LoraSpec(4, 8.0, ("q_proj", "o_proj"))
    model = _model()
    sd = _random_adapter(model, spec)
    lora.save_adapter(tmp_path / "a", sd, spec, "base-dir")
    back, spec2 = lora.load_adapter(tmp_path / "a")
    assert spec2 == spec and back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    merged = lora.merge_into(model.state_dict(), back, spec)
    w = model.state_dict()["model.layers.1.self_attn.o_proj.weight"]
    a, b = sd["model.layers.1.self_attn.o_proj.lora_A.weight"], sd["model.layers.1.self_attn.o_proj.lora_B.weight"]
    torch.testing.assert_close(merged["model.layers.1.self_attn.o_proj.weight"], w + 2.0 * b @ a)  # alpha/r = 2
    assert torch.equal(
        merged["model.layers.1.mlp.up_proj.weight"], model.state_dict()["model.layers.1.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize(
    "kw,says",
    [
        ({"rank": -1}, "rank=-1: expected an integer >= 0"),
        ({"rank": 8, "alpha": 0}, "alpha=0.0: expected > 0"),
        ({"rank": 8, "dropout": 1.0}, "dropout=1.0: expected a number in [0, 1)"),
        ({"rank": 8, "target_modules": []}, "target_modules=[]: expected a non-empty list"),
        ({"rank": 8, "target_modules": ["self_attn.q_proj"]}, "target_modules=['self_attn.q_proj']"),
    ],
)
def test_bad_lora_config_is_refused_naming_the_key(kw, says):
    with pytest.raises(ConfigError) as e:
        LoraConfig(**kw)
    assert str(e.value).startswith(says)


def test_a_target_that_is_no_linear_layer_is_refused():
    with pytest.raises(ValueError, match=r"no linear layer named \['qkv_proj'\] in LlamaForCausalLM"):
        lora.inject(_model(), lora.LoraSpec(4, 8.0, ("q_proj", "qkv_proj")), seed=0)


def test_a_lora_checkpoint_holds_the_adapter_alone_resumes_it_and_exports_it_merged(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from areal_async import cli
    from areal_async.app.workers.trainer_worker import _shard_writer
    from areal_async.models.tiny import load_model, save_policy
    from areal_async.trainer.persist.sharded_ckpt import load_shards

    spec = lora.LoraSpec(4, 8.0, ("q_proj", "up_proj"))
    base = _model()
    save_policy(base, TOK, tmp_path / "base")
    actor = PPOActor(lora.inject(base, spec, seed=0), ActorConfig(), temperature=1.0, total_steps=4)
    actor.train_step([_traj(i, TOK.encode("1+2="), TOK.encode(str(i)), float(i % 2)) for i in range(4)])
    _shard_writer(actor, torch.float32, spec, str(tmp_path / "base"))(tmp_path / "ckpt")

    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    saved, spec2 = lora.load_adapter(tmp_path / "ckpt" / "adapter")
    trained = {k: v.detach() for k, v in lora.adapter_params(actor.model).items()}
    assert spec2 == spec and all(torch.equal(saved[k], trained[k]) for k in trained)
    keys = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 2 * 2 * 2 and all(".lora_" in k for k in model_keys)  # A, B x 2 layers x 2 targets

    again = PPOActor(lora.inject(_model(seed=5), spec, seed=1), ActorConfig(), temperature=1.0, total_steps=4)
    load_shards(tmp_path / "ckpt", again.model, again.optimizer)
    back = lora.adapter_params(again.model)
    assert all(torch.equal(back[k].detach(), trained[k]) for k in trained)
    assert len(again.optimizer.state) == len(trained)

    assert cli.main(["export-lora", str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    ids = torch.tensor([TOK.encode("12+30=42")])
    evaluated = _model(seed=9)
    evaluated.load_state_dict(actor.full_state())  # what the periodic evaluator gets: HF names, merged
    with torch.no_grad():
        want = actor.model(ids).logits
        torch.testing.assert_close(load_model(tmp_path / "merged")(ids).logits, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(evaluated(ids).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("merged", [True, False])
def test_the_engine_reads_the_base_once_at_the_first_adapter(merged):
    """A rollout's engine starts with random weights; the run's base is read when the first adapter comes
    (a restarted rollout too), then only adapters: its forward equals base + s B A (merged by hand)."""
    spec = lora.LoraSpec(4, 8.0, ("k_proj", "gate_proj"))
    base, reads = _model(seed=11).state_dict(), []
    engine_model = _model(seed=0)
    adapter = lora.EngineAdapter(engine_model, spec, merged, base=lambda: reads.append(1) or base)
    ids = torch.tensor([TOK.encode("7+5=12")])
    for seed in (3, 4):
        sd = _random_adapter(_model(), spec, seed)
        adapter.load(sd)
        want = _model(seed=11)
        with torch.no_grad():
            for layer in {k.rsplit(".lora_", 1)[0] for k in sd}:
                w = want.get_submodule(layer).weight
                w += 2.0 * sd[layer + ".lora_B.weight"] @ sd[layer + ".lora_A.weight"]  # alpha / r = 2
            torch.testing.assert_close(engine_model(ids).logits, want(ids).logits, atol=1e-5, rtol=0)
    assert reads == [1]
