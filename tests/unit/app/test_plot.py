"""``areal-async plot``: moving averages and rates by hand, every PNG written and valid, clear failures."""

import json
import random
import struct
from pathlib import Path

import pytest

from areal_async.scheduler.weight_updates import PHASES
from areal_async.app.commands.plot import PlotError, moving_average, plot_run, rates

ROOT = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_moving_average_and_rates_by_hand():
    assert moving_average([1, 2, 3, 4, 5], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert moving_average([4, 0, 2], 5) == [4.0, 2.0, 2.0]
    rows = [{"wall_s": 0.0, "n": 0}, {"wall_s": 2.0, "n": 10}, {"wall_s": 4.0, "n": 30}, {"wall_s": 5.0, "n": 30}]
    assert rates(rows, "n", window=1) == ([2.0, 4.0, 5.0], [5.0, 10.0, 0.0])
    assert rates(rows, "n", window=2) == ([2.0, 4.0, 5.0], [5.0, 7.5, 20 / 3])


def fake_run(run_dir: Path, steps: int = 40) -> None:
    """Rows shaped like a real run's (keys from metrics.jsonl), with eval rows and trajectories."""
    rng = random.Random(0)
    rows, trajs = [], []
    for s in range(steps):
        if s % 20 == 0:
            rows.append(
                {
                    "kind": "eval",
                    "step": s,
                    "version": s,
                    "eval_pass1": 0.3 + s / 100,
                    "eval_pass1_ci_low": 0.2,
                    "eval_pass1_ci_high": 0.5 + s / 100,
                    "eval_n_problems": 100,
                    "eval_k": 8,
                }
            )
        rows.append(
            {
                "step": s,
                "version": s + 1,
                "reward_mean": min(1.0, 0.3 + s / 60 + rng.uniform(-0.1, 0.1)),
                "staleness_max": rng.randint(0, 2),
                "staleness_mean": rng.uniform(0, 1.5),
                "samples_trained_total": 128 * (s + 1),
                "samples_generated_total": 140 * (s + 1),
                "samples_rewarded_total": 136 * (s + 1),
                "wall_s": 1.0 + 0.4 * s,
                "loss": rng.gauss(0, 0.1),
                "clip_frac": rng.uniform(0, 0.1),
                "imp_weight_mean": 1 + rng.uniform(-0.01, 0.01),
                "rejected_frac": 0.0,
                "entropy": 2.5 - s / 40,
                "grad_norm": rng.uniform(0.5, 2),
                "behav_approx_kl": rng.uniform(0, 0.004),
                "approx_kl": rng.uniform(0, 0.01),
                **({} if s < 2 else _weight_update(s, rng)),
            }
        )
        trajs += [{"status": "trained", "train_step": s, "version_min": s - rng.randint(0, 2)} for _ in range(4)]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajs))


def _weight_update(step: int, rng) -> dict:
    phases = {f"weight_update_{p}": rng.uniform(0.001, 0.05) for p in PHASES}
    return {"weight_update_version": step, "weight_update_s": sum(phases.values()), **phases}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def with_health_columns(run_dir: Path) -> None:
    """The doctor's per-step columns (issue 28) added to every trainer-step row of ``run_dir``."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        if "kind" not in r:
            r.update(
                truncated_frac=0.01,
                completion_len_mean=9.0,
                completion_len_p90=11.0,
                logp_gap_mean_lag0=0.0,
                logp_gap_mean_lag1=0.004,
                logp_gap_p99=0.1,
                ess_frac=0.99,
                trainer_idle_frac=0.05,
                rollout_idle_frac=0.8,
                groups_all_zero_frac=0.1,
                groups_all_one_frac=0.2,
                # the mismatch block and the long tail (issue 42)
                kl_k3=0.002,
                ratio_max=3.0,
                ratio_p99=1.4,
                ratio_p1=0.7,
                ratio_min=0.2,
                masked_frac=0.01,
                masked_frac_rs=0.01,
                masked_frac_m2po=0.0,
                tail_s=0.3,
                wasted_tokens=40,
                trained_tokens=400,
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_writes_every_figure_as_a_valid_png_and_health_with_its_columns(tmp_path):
    """One run renders every figure (each rendering ~0.2 s: the health figure's run is the every-figure run); a run
    without the health columns gets no health.png (test_plot_cli_fails_clearly_on_an_empty_run_dir's second run)."""
    fake_run(tmp_path / "run")
    with_health_columns(tmp_path / "run")
    paths = plot_run(tmp_path / "run")
    assert [p.name for p in paths] == [
        "reward.png",
        "staleness.png",
        "throughput.png",
        "loss.png",
        "kl.png",
        "eval.png",
        "weights.png",
        "health.png",
        "mismatch.png",
        "longtail.png",
    ]
    for p in paths[:-3] + paths[-2:]:
        width, height = png_size(p)
        assert p.parent == tmp_path / "run" / "plots" and width >= 500 and height >= 350 and p.stat().st_size > 10_000
    import matplotlib.image

    assert matplotlib.image.imread(paths[0]).shape[2] in (3, 4)  # decodes as an image, not just a header
    width, height = png_size(paths[-3])  # health.png: 2 x 2 panels
    assert width >= 1000 and height >= 700 and paths[-3].stat().st_size > 20_000


def test_plot_cli_fails_clearly_on_an_empty_run_dir(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    done = cli("plot", tmp_path / "empty")
    assert done.returncode == 2
    assert f"{tmp_path / 'empty'}: no trainer-step rows in metrics.jsonl (file missing): nothing to plot" in done.stderr
    assert not (tmp_path / "empty" / "plots").exists()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"kind": "eval", "step": 0}\n')
    with pytest.raises(PlotError, match="no trainer-step rows in metrics.jsonl .empty."):
        plot_run(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1\n')
    with pytest.raises(PlotError, match="metrics.jsonl:2: not valid JSON"):
        plot_run(tmp_path / "empty")
    fake_run(tmp_path / "run", steps=5)
    done = cli("plot", tmp_path / "run", "--out", tmp_path / "figs")
    assert done.returncode == 0 and done.stdout.count("KiB)") == 7 and (tmp_path / "figs" / "kl.png").exists()
    assert not (tmp_path / "figs" / "health.png").exists()  # no health columns in this run
