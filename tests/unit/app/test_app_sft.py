"""``areal-async sft`` (areal_async.app.commands.sft): a short run on a tiny model learns, writes its
books, saves a model that reloads with ``from_pretrained`` to the same logits; bad inputs are
refused before training with exit code 2 and a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_async.config import load_config
from areal_async.app.commands import sft as sft_app
from areal_async.app.commands.sft import SFTInputError, batches, run_sft, sft, sft_total_steps

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs/tiny_sft.yaml"
SMALL = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=1",
    "model.max_position_embeddings=32",
    "train_dataset.size=40",
    "sft.holdout=8",
    "sft.batch_size=16",
    "sft.optimizer.warmup_steps_proportion=0",
    "evaluator.max_problems=8",
    "gconfig.max_new_tokens=10",
    "cluster.torch_threads=1",
]


def small_cfg(*overrides: str):
    return load_config(TINY, SMALL + list(overrides))


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft")
    result = sft(small_cfg("sft.steps=30", "sft.save_freq_steps=10", "saver.keep_last=2"), run_dir)
    return run_dir, result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_loss_decreases_and_metrics_are_written(short_run):
    run_dir, _ = short_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["n_tokens"] > 0 and r["grad_norm"] >= 0 and r["wall_s"] > 0 for r in rows)
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.5 * first, (first, last)


def test_summary_reports_data_and_accuracy_before_and_after(short_run):
    run_dir, result = short_run
    s = json.loads((run_dir / "summary.json").read_text())
    assert s == json.loads(json.dumps(result.summary))
    assert (s["steps"], s["n_problems"], s["n_train_examples"]) == (30, 40, 32)
    assert s["eval_problems"] == {"train": 8, "heldout": 8}
    for side in ("before", "after"):
        for split in ("train", "heldout"):
            ev = s["eval"][side][split]
            assert 0.0 <= ev["accuracy"] <= 1.0 and ev["n_samples"] == 8
    assert s["eval"]["before"]["train"]["accuracy"] == 0.0  # a random init never writes \boxed{a+b}
    assert s["final_loss"] < s["first_loss"] and s["train_tokens"] == sum(
        r["n_tokens"] for r in read_jsonl(run_dir / "metrics.jsonl")
    )


def test_saved_model_reloads_with_the_same_logits(short_run):
    run_dir, result = short_run
    reloaded = AutoModelForCausalLM.from_pretrained(run_dir / "model", local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(run_dir / "model", local_files_only=True)
    assert tok.encode("3+4=", add_special_tokens=False) == result.tokenizer.encode("3+4=", add_special_tokens=False)
    ids = torch.tensor([[tok.bos_token_id] + tok.encode("3+4=\\boxed{7}", add_special_tokens=False)])
    with torch.no_grad():
        result.model.eval()
        torch.testing.assert_close(reloaded(ids).logits, result.model(ids).logits, rtol=0, atol=1e-5)


def test_periodic_checkpoints_keep_the_last_ones(short_run):
    run_dir, _ = short_run
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_20", "step_30"]  # saver.keep_last=2 of saves at 10, 20, 30
    assert (run_dir / "checkpoints/step_30/COMPLETE").is_file()


def test_dataset_without_answers_is_refused(tmp_path, capsys):
    data = tmp_path / "no_answers.jsonl"
    data.write_text('{"prompt": "1+1=", "solutions": ["2"]}\n{"prompt": "2+2=", "solutions": ["4"]}\n')
    cfg = small_cfg("train_dataset.type=jsonl", f"train_dataset.path={data}", "sft.holdout=0")
    assert run_sft(cfg, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "no_answers.jsonl" in err and "'answer'" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


@pytest.mark.parametrize(
    "override,named",
    [
        ("sft.holdout=40", "sft.holdout=40"),
        ("evaluator.max_new_tokens=40", "max_position_embeddings=32"),
        ("actor.mb_spec.max_tokens_per_mb=8", "actor.mb_spec.max_tokens_per_mb=8"),
        ("model.path=/nonexistent/model", "/nonexistent/model"),
    ],
)
def test_unusable_inputs_are_refused_before_training(tmp_path, override, named):
    with pytest.raises(SFTInputError, match=named.replace("+", r"\+").replace("[", r"\[")):
        sft(small_cfg(override), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_jsonl_answers_train(tmp_path):
    data = tmp_path / "train.jsonl"
    lines = [{"prompt": f"{a}+{a}=", "solutions": [str(2 * a)], "answer": f"\\boxed{{{2 * a}}}"} for a in range(6)]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = small_cfg(
        "train_dataset.type=jsonl",
        f"train_dataset.path={data}",
        "sft.holdout=0",
        "sft.steps=3",
        "evaluator.enabled=false",
    )
    s = sft(cfg, tmp_path / "run").summary
    assert (s["n_train_examples"], s["steps"], s["eval"]) == (6, 3, {"before": {}, "after": {}})


def test_batches_visit_every_example_once_per_epoch():
    examples = [([1], [i]) for i in range(10)]
    stream = batches(examples, 5, seed=3)
    first_epoch = next(stream) + next(stream)
    assert sorted(a[0] for _, a in first_epoch) == list(range(10))
    assert next(batches(examples, 5, seed=3)) == first_epoch[:5]  # seeded


def test_steps_follow_epochs_when_zero():
    cfg = small_cfg("sft.steps=0", "sft.epochs=2.5", "sft.batch_size=16")
    assert sft_total_steps(cfg, 32) == 5  # ceil(2.5 * 32 / 16)
    assert sft_total_steps(small_cfg("sft.steps=7"), 32) == 7


def test_interrupted_sft_resumes_to_the_same_model_as_an_uninterrupted_run(tmp_path, monkeypatch, short_run):
    """Crash after step 23 of 30 (checkpoints at 10 and 20), rerun with recover.mode=auto: the run
    continues from step 20 with its optimizer, schedule, RNG and batch order, rolls back the
    metrics rows of steps 21-23, and ends with the uninterrupted run's weights."""
    overrides = ("sft.steps=30", "sft.save_freq_steps=10", "saver.keep_last=2")
    real_step = sft_app._step

    def crashing_step(cfg, model, opt, batch, step, t0):
        if step == 24:
            raise RuntimeError("simulated crash")
        return real_step(cfg, model, opt, batch, step, t0)

    monkeypatch.setattr(sft_app, "_step", crashing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        sft(small_cfg(*overrides), tmp_path)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 24))
    monkeypatch.setattr(sft_app, "_step", real_step)
    resumed = sft(small_cfg(*overrides, "recover.mode=auto"), tmp_path)

    assert resumed.summary["resumed_from_step"] == 20
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    reference_dir, reference = short_run  # the same config, never interrupted
    ref_rows = read_jsonl(reference_dir / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], rel=1e-5)
    ref_sd, sd = reference.model.state_dict(), resumed.model.state_dict()
    assert ref_sd.keys() == sd.keys()
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-5, atol=1e-6, msg=k)
    assert resumed.summary["eval"]["before"] == reference.summary["eval"]["before"]  # the first attempt's


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(SFTInputError, match="recover.mode=resume but .* holds no complete checkpoint"):
        sft(small_cfg("sft.steps=2", "recover.mode=resume"), tmp_path)
