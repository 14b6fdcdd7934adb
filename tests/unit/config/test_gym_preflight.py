"""Bad reasoning-gym configs are refused before anything starts, in one line naming the key: an unknown task,
a negative weight, a config the task refuses, the extra missing. And the shipped presets pass the preflight."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_async import cli
from areal_async.config import load_config
from areal_async.supervisor.preflight import context_for, preflight

ROOT = Path(__file__).resolve().parents[3]
CHAIN = str(ROOT / "configs/chain_sum.yaml")


def refused(tmp_path: Path, capsys, *overrides: str) -> str:
    run_dir = tmp_path / "run"
    code = cli.main(["run", CHAIN, "--no-progress", "--run-dir", str(run_dir), *overrides])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and not run_dir.exists(), out
    assert out.err.count("\n") == 1 and out.err.startswith("areal-async: "), out.err  # ONE line
    return out.err


def test_an_unknown_task_is_refused_naming_its_key_and_the_close_names(tmp_path, capsys):
    pytest.importorskip("reasoning_gym")
    err = refused(tmp_path, capsys, "train_dataset.tasks=[{name: chain_sum}, {name: chain_summ}]")
    assert "train_dataset.tasks[1].name='chain_summ': no such reasoning-gym task; did you mean chain_sum" in err


def test_a_negative_weight_is_refused_naming_its_key(tmp_path, capsys):
    err = refused(tmp_path, capsys, "train_dataset.tasks=[{name: chain_sum, weight: -0.5}]")
    assert "config error: train_dataset.tasks[0].weight=-0.5: expected a number > 0" in err


def test_a_config_the_task_refuses_is_refused_naming_the_level(tmp_path, capsys):
    pytest.importorskip("reasoning_gym")
    levels = "levels: [{max_terms: 3}, {min_terms: 5, max_terms: 4}]"
    err = refused(tmp_path, capsys, f"train_dataset.tasks=[{{name: chain_sum, {levels}}}]")
    assert "train_dataset.tasks[0].levels[1]={'min_terms': 5, 'max_terms': 4}: reasoning-gym's chain_sum refuses" in err
    assert "max_terms must be >= min_terms" in err  # reasoning-gym's own words
    err = refused(tmp_path, capsys, "train_dataset.tasks=[{name: chain_sum, config: {max_termz: 3}}]")
    assert "train_dataset.tasks[0].config={'max_termz': 3}: reasoning-gym's chain_sum refuses it" in err


def test_the_missing_extra_is_refused_with_the_install_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    err = refused(tmp_path, capsys)
    assert (
        "train_dataset.type='reasoning_gym': the reasoning-gym package is not installed; pip install -e '.[gym]'" in err
    )


def test_task_keys_on_another_dataset_type_are_refused(tmp_path, capsys):
    code = cli.main(
        [
            "run",
            str(ROOT / "configs/tiny_arith.yaml"),
            "--no-progress",
            "--run-dir",
            str(tmp_path / "r"),
            "train_dataset.tasks=[{name: chain_sum}]",
        ]
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and "train_dataset.tasks=[{'name': 'chain_sum'}]: read only by train_dataset.type='reasoning_gym'" in err
    )


@pytest.mark.parametrize("preset", ["configs/chain_sum.yaml", "configs/gym_mix.yaml"])
def test_the_gym_presets_pass_every_check(preset, tmp_path):
    pytest.importorskip("reasoning_gym")
    path = str(ROOT / preset)
    found = preflight(context_for(load_config(path), path, [], "run", tmp_path / "r"), stop_at_error=False)
    assert [f.line for f in found if f.level != "ok"] == []
    assert any(f.key == "train_dataset.tasks" and f.level == "ok" for f in found)
