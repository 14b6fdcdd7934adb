"""Checkpoints: HF round trip, optimizer/scheduler/RNG/extra restored, atomicity, pruning."""

import random

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from areal_async.config import ActorConfig, OptimizerConfig
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.persist.checkpoint import load_checkpoint, save_checkpoint
from areal_async.trainer.persist.checkpoint_dirs import COMPLETE, latest_complete_checkpoint, prune
from protocols.trajectories import Trajectory

torch.set_num_threads(1)


def tiny_model():
    torch.manual_seed(0)
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


def tiny_tokenizer():
    vocab = {"[UNK]": 0, "one": 1, "two": 2, "three": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def trained_actor():
    model = tiny_model()
    cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2, lr_scheduler_type="cosine"))
    actor = PPOActor(model, cfg, 1.0, total_steps=10)
    trajs = [Trajectory(f"s{i}", "g", [1, 2], [3 + i, 4], [-2.0, -2.0], [0, 0], float(i % 2)) for i in range(4)]
    actor.train_step(trajs)
    return actor


def save(root, step, actor, **kw):
    return save_checkpoint(
        root,
        step,
        version=step + 1,
        model=actor.model,
        tokenizer=kw.get("tokenizer"),
        actor_state=actor.state_dict(),
        extra=kw.get("extra", {"cursor": step}),
    )


def test_round_trip(tmp_path):
    actor = trained_actor()
    extra = {"cursor": {"epoch": 1, "index": 17}, "ledger": [["s0", "trained"]]}
    path = save(tmp_path, 3, actor, tokenizer=tiny_tokenizer(), extra=extra)
    assert path == tmp_path / "step_3" and (path / COMPLETE).is_file()
    assert (path / "model.safetensors").is_file()
    # the weights: from_pretrained gives the same logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, actor.model(ids).logits, atol=1e-6)
    assert transformers.AutoTokenizer.from_pretrained(path)("one three")["input_ids"] == [1, 3]
    # the rest
    ck = load_checkpoint(path)
    assert (ck["step"], ck["version"], ck["extra"]) == (3, 4, extra)
    fresh = PPOActor(loaded, actor.cfg, 1.0, total_steps=10)
    fresh.load_state_dict(ck["actor_state"])
    assert fresh.step == 1
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(actor.optimizer.param_groups[0]["lr"])
    for a, b in zip(actor.optimizer.state.values(), fresh.optimizer.state.values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and int(a["step"]) == int(b["step"])


def test_rng_states_restored(tmp_path):
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save(tmp_path, 0, trained_actor())
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    load_checkpoint(path, restore_rng=True)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want


def test_half_written_checkpoints_are_never_picked(tmp_path):
    actor = trained_actor()
    save(tmp_path, 2, actor)
    # a crash mid-save: the temp dir, and a step dir that somehow lacks its marker
    (tmp_path / ".tmp-step_7-99999").mkdir()
    half = tmp_path / "step_9"
    half.mkdir()
    (half / "config.json").write_text("{}")
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "step_2"
    with pytest.raises(ValueError, match="no COMPLETE marker"):
        load_checkpoint(half)
    assert latest_complete_checkpoint(tmp_path / "missing") is None


def test_resave_same_step_replaces_atomically(tmp_path):
    actor = trained_actor()
    save(tmp_path, 1, actor, extra={"v": 1})
    save(tmp_path, 1, actor, extra={"v": 2})
    assert load_checkpoint(tmp_path / "step_1")["extra"] == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_prune_keeps_newest(tmp_path):
    actor = trained_actor()
    for step in (1, 5, 10, 12):
        save(tmp_path, step, actor)
    (tmp_path / "step_3").mkdir()  # incomplete leftover older than the newest complete one
    (tmp_path / ".tmp-step_11-99999").mkdir()  # another (crashed) process's temp dir
    prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_12"]
    assert latest_complete_checkpoint(tmp_path).name == "step_12"


def test_extra_must_be_json(tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        save(tmp_path, 0, trained_actor(), extra={"bad": object()})
    assert not any(tmp_path.iterdir())  # rejected before anything was written


def test_checkpoints_are_private_and_one_others_could_write_is_refused(tmp_path):
    """DCP's .metadata is unpickled on load: checkpoints are written 0700, and load_shards refuses one
    that group/others may write or (as root, where the test can chown) another user owns."""
    import os
    import stat

    from areal_async.trainer.persist.sharded_ckpt import DCP_DIR, load_shards, save_shards

    actor = trained_actor()
    root = tmp_path / "checkpoints"
    path = save_checkpoint(
        root, 0, version=1, model=actor.model, tokenizer=None, actor_state=actor.state_dict(), extra={},
        write_model=lambda d: save_shards(d, actor.model, actor.optimizer),
    )  # fmt: skip
    assert stat.S_IMODE(root.stat().st_mode) == stat.S_IMODE(path.stat().st_mode) == 0o700
    fresh = PPOActor(tiny_model(), actor.cfg, 1.0, total_steps=10)
    load_shards(path, fresh.model, fresh.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(), actor.model.state_dict().values()))
    meta = path / DCP_DIR / ".metadata"
    for target, mode in ((meta, 0o664), (path / DCP_DIR, 0o757), (path, 0o770)):
        before = stat.S_IMODE(target.stat().st_mode)
        os.chmod(target, mode)
        with pytest.raises(PermissionError, match="writable by group or others"):
            load_shards(path, fresh.model, fresh.optimizer)
        os.chmod(target, before)
    if os.getuid() == 0:
        os.chown(meta, 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            load_shards(path, fresh.model, fresh.optimizer)
