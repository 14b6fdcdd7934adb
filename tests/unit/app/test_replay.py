"""Replay (app/commands/replay.py) on a real trainer's checkpoints and recording, in one process (no fleet):
bit-identical weights from a checkpoint + the recorded batches; a corrupted checkpoint or recording named by its
first tensor."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from areal_async.app.workers import trainer_worker
from areal_async.app.commands.replay import (
    ReplayError,
    build_actor,
    first_difference,
    parse_steps,
    replay,
    state_digest,
    state_tensors,
    tensor_digest,
)
from areal_async.cli import main
from areal_async.config import load_config, to_yaml
from areal_async.models.tiny import load_policy
from areal_async.trainer.compute.dp import DataParallel
from areal_async.trainer.persist.recording import Recorder, machine_header, read_step, step_path, write_step
from areal_async.trainer.persist.sharded_ckpt import save_shards
from protocols.trajectories import Trajectory

ROOT = Path(__file__).resolve().parents[3]
OVERRIDES = [
    "sft_warmup.steps=0",
    "total_train_steps=8",
    "saver.keep_last=10",
    "actor.optimizer.weight_decay=0.01",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=2",
]


def batch(step: int, vocab: int) -> list[Trajectory]:
    """Eight trajectories of mixed lengths, stale tokens among them, scores 0/1 (a seeded generator)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(8):
        n_p, n_o = 3 + i % 3, 2 + (i * 5) % 7
        out.append(
            Trajectory(
                f"s{step}-{i}",
                f"g{step}-{i // 4}",
                torch.randint(1, vocab, (n_p,), generator=g, dtype=torch.int32),
                torch.randint(1, vocab, (n_o,), generator=g, dtype=torch.int32),
                -torch.rand(n_o, generator=g) * 3,
                torch.full((n_o,), max(0, step - i % 2), dtype=torch.int32),
                float(i % 3 == 0),
            )
        )
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A trainer's run directory: config, checkpoints of versions 1, 3 and 5, the recording of steps 0..4."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("run")
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", OVERRIDES)
    (d / "config.yaml").write_text(to_yaml(cfg))
    model, tok = load_policy(cfg.model, cfg.seed)
    actor = trainer_worker.make_actor(cfg, model, tok, DataParallel.single(), sharded=False)
    save = trainer_worker._checkpointer(cfg, d, actor, tok, trainer_worker._shard_writer(actor, torch.float32))
    rec = Recorder(d, 0, machine_header("cpu", 1, "float32"))
    rows = []
    for step in range(5):
        trajs, rng = batch(step, len(tok)), rec.rng_state()
        rows.append(json.dumps({"step": step, "loss": float(actor.train_step(trajs)["loss"])}))
        rec.step(step, step + 1, trajs, rng)
        if step % 2 == 0:
            save(step, step + 1, {})
    (d / "metrics.jsonl").write_text("\n".join(rows) + "\n")  # as the scheduler logs the trainer's loss
    return d


def test_replay_is_bit_identical_to_the_checkpoint(run_dir):
    rep = replay(run_dir, 1, 5)
    assert rep.identical, rep.first_diff
    assert rep.replayed_sha256 == rep.checkpoint_sha256
    assert (rep.start.name, rep.end.name) == ("step_0", "step_4")
    assert len(rep.losses) == 4 and all(x != 0 for x in rep.losses)
    assert rep.losses == rep.run_losses and rep.first_loss_diff is None  # every step's loss, bit for bit
    start = state_digest(state_tensors(build_actor(load_config(run_dir / "config.yaml"), rep.start)))
    assert start != rep.checkpoint_sha256  # the steps moved the weights: the identity is not trivial
    assert rep.n_tensors > len(build_actor(load_config(run_dir / "config.yaml"), rep.end).model.state_dict())


def test_cli_exit_0_and_the_digest(run_dir, capsys):
    assert main(["replay", str(run_dir), "--steps", "3:5"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical to" in out and out.count("sha256") == 2 and out.count("(the run's: same)") == 2


def test_corrupted_checkpoint_names_the_tensor(run_dir, tmp_path):
    """The checkpoint of version 5 with one weight nudged by one ulp: exit 1 naming exactly that tensor."""
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    end = bad / "checkpoints" / "step_4"
    cfg = load_config(bad / "config.yaml")
    actor = build_actor(cfg, end)
    w = actor.model.get_parameter("model.layers.1.mlp.up_proj.weight")
    with torch.no_grad():
        w[3, 7] = torch.nextafter(w[3, 7], torch.tensor(float("inf")))
    shutil.rmtree(end / "dcp")
    save_shards(end, actor.model, actor.optimizer)
    rep = replay(bad, 3, 5)
    assert not rep.identical and rep.first_loss_diff is None  # the steps ran as the run's did
    assert rep.first_diff.startswith("model.layers.1.mlp.up_proj.weight (1 of ")
    assert main(["replay", str(bad), "--steps", "3:5"]) == 1


def test_corrupted_recording_gives_exit_1(run_dir, tmp_path, capsys):
    """One behaviour logprob of step 4 changed: the update differs, exit 1 with a tensor named."""
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    rec = read_step(step_path(bad, 4))
    rec.trajs[2].logprobs[0] -= 0.5
    write_step(bad, 4, 5, rec.trajs, rec.rng_state)
    assert main(["replay", str(bad), "--steps", "3:5"]) == 1
    err = capsys.readouterr().err
    assert "differs from" in err and "first tensor: model." in err
    assert err.rstrip().endswith("the first step whose loss differs from the run's: 4")


def test_missing_checkpoint_or_step_is_exit_2(run_dir, tmp_path, capsys):
    assert main(["replay", str(run_dir), "--steps", "2:5"]) == 2  # no checkpoint of version 2
    assert "no complete checkpoint of version 2 (saved after step 1)" in capsys.readouterr().err
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    step_path(bad, 3).unlink()
    assert main(["replay", str(bad), "--steps", "3:5"]) == 2
    assert "steps [3] are not recorded" in capsys.readouterr().err


def test_a_header_whose_linears_cannot_run_here_is_exit_2(run_dir, tmp_path, capsys, monkeypatch):
    """The header's linears (what the trainer resolved) are run by replay: an unknown one, or oneDNN where this
    torch has none, is refused before anything is built."""
    import shutil

    from areal_async.app.commands import replay as replay_mod

    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    path = bad / "recording" / "header.json"
    header = json.loads(path.read_text())
    assert "linears" not in header  # machine_header without it: a recording from before, replayed as it was
    path.write_text(json.dumps(header | {"linears": "fast"}))
    assert main(["replay", str(bad), "--steps", "1:5"]) == 2
    assert "linears 'fast' is not 'onednn' or 'blas'" in capsys.readouterr().err
    path.write_text(json.dumps(header | {"linears": "onednn"}))
    monkeypatch.setattr(replay_mod, "onednn_usable", lambda w: False)
    assert main(["replay", str(bad), "--steps", "1:5"]) == 2
    assert "recorded with the trainer's linears on oneDNN; this torch has no oneDNN matmul" in capsys.readouterr().err


def test_parse_steps():
    assert parse_steps("10:20") == (10, 20)
    for bad in ("10", "20:10", "a:b", "5:5", "-1:3"):
        with pytest.raises(ReplayError):
            parse_steps(bad)


def test_digest_is_sha256_of_name_dtype_shape_bytes():
    t = torch.tensor([1.0, -2.0], dtype=torch.float32)
    want = hashlib.sha256(b"w|torch.float32|(2,)|" + b"\x00\x00\x80\x3f\x00\x00\x00\xc0").hexdigest()
    assert tensor_digest("w", t) == want
    assert state_digest({"w": t}) == hashlib.sha256(want.encode()).hexdigest()


def test_first_difference_in_order_and_kind():
    a = {"x": torch.zeros(3), "y": torch.ones(2)}
    assert first_difference(dict(a), a) is None
    assert first_difference({"x": torch.zeros(3), "y": torch.tensor([1.0, 1.5])}, a) == (
        "y (1 of 2 elements differ in bits, max |diff| 0.5)"
    )
    assert first_difference({"x": torch.zeros(3, dtype=torch.float64), "y": a["y"]}, a).startswith("x (torch.float64")
    assert first_difference({"x": a["x"]}, a) == "y (in the checkpoint, not in the replay)"
    # -0.0 and 0.0 compare equal as numbers but not as bits
    assert first_difference({"x": -torch.zeros(3), "y": a["y"]}, a).startswith(
        "x (3 of 3 elements differ in bits, max |diff| 0"
    )
