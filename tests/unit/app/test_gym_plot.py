"""`areal-async plot` draws a reasoning-gym run's per-task columns (tasks.png) and only for such a run."""

from __future__ import annotations

import json

import pytest

from areal_async.app.commands.plot import plot_run, task_names

pytest.importorskip("matplotlib")


def write_rows(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tasks_png_for_a_mixture_run_and_none_without_task_columns(tmp_path):
    rows = []
    for step in range(6):
        row = {"step": step, "reward_mean": 0.5, "wall_s": step + 1.0, "samples_trained_total": 8 * (step + 1)}
        row |= {"task/a/samples_total": 6 * (step + 1), "task/a/reward_mean": 0.1 * step, "task/a/level": step // 3}
        row |= {"task/b/samples_total": 2 * (step + 1)}  # b: no sample trained in any step, so no reward_mean
        rows.append(row)
    write_rows(tmp_path / "mix", rows)
    assert task_names(rows) == ["a", "b"]
    names = {p.name for p in plot_run(tmp_path / "mix")}
    assert "tasks.png" in names and (tmp_path / "mix" / "plots" / "tasks.png").stat().st_size > 10_000
    write_rows(tmp_path / "plain", [{k: v for k, v in r.items() if not k.startswith("task/")} for r in rows])
    assert "tasks.png" not in {p.name for p in plot_run(tmp_path / "plain")}
