"""``areal-async plot RUN_DIR``: PNG curves of a run, for a report.

Reads ``metrics.jsonl`` (trainer-step rows and, with ``evaluator.freq_steps``, evaluation rows)
and ``trajectories.jsonl`` when the run dumped it; writes into ``RUN_DIR/plots`` (or ``--out``):

    reward.png       reward per step (task score in [0, 1]) and its moving average
    staleness.png    trained samples by staleness (train step - oldest token version), and the
                     per-step mean / max over the run
    throughput.png   samples/s per role against wall time: rollout (generated), reward (scored),
                     trainer (trained), each a rate over a moving window of rows
    loss.png         loss statistics: loss, clip fraction, importance weights, rejected fraction,
                     entropy, grad norm (raw and moving average)
    kl.png           behaviour KL (how far off-policy the trained tokens were) and the
                     proximal-current approx KL, per step
    eval.png         periodic evaluation: pass@1 with its 95 % interval per policy version
                     (only when the run has evaluation rows)
    health.png       the health columns of ``areal-async doctor`` (docs/doctor.md): log-prob gap
                     by staleness lag, ESS, truncation and all-zero / all-one groups, lengths,
                     idle fractions per role (when the run has them)
    weights.png      weight updates: seconds from the optimizer step's end to every rollout
                     generating with the new weights, stacked by phase, per version (when timed)
    mismatch.png     the mismatch block (docs/objectives.md#off-policy-corrections): behaviour vs
                     proximal k3 KL, the tails of w = exp(prox - behav) (log scale), and the fraction
                     of trained tokens each correction masked (when the run has the block)
    longtail.png     the long tail (docs/running.md#the-long-tail): tail_s, the seconds the last group of
                     each batch kept the trainer waiting, and wasted_tokens (generated, never trained) per
                     trained token, per step (when the run has them)
    tasks.png        a reasoning-gym mixture (rows with task/<name>/* columns): reward per task per
                     step and its moving average, each task's share of the samples trained so far,
                     and its curriculum level (tasks with levels)

Each figure has labelled axes with units; raw series are drawn thin, moving averages bold
(window: about a twentieth of the run, at least 1). A run directory without any step row is an
error naming what is missing. Needs matplotlib (the 'bench' extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

from areal_async.scheduler.weight_updates import PHASES


class PlotError(ValueError):
    """Nothing to plot (no metrics rows), or matplotlib is missing; the message says which."""


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise PlotError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def window_for(n: int) -> int:
    return max(1, n // 20)


def rates(rows: list[dict], key: str, window: int) -> tuple[list[float], list[float]]:
    """(wall time, d key / d wall) over a window of rows: a cumulative counter -> per-second rate."""
    pts = [(r["wall_s"], r[key]) for r in rows if key in r and "wall_s" in r]
    xs, ys = [], []
    for i in range(1, len(pts)):
        j = max(0, i - window)
        dt = pts[i][0] - pts[j][0]
        if dt > 0:
            xs.append(pts[i][0])
            ys.append((pts[i][1] - pts[j][1]) / dt)
    return xs, ys


def plot_run(run_dir: str | Path, out_dir: Optional[str | Path] = None) -> list[Path]:
    """Write the PNGs; returns their paths. ``PlotError`` when the run has no step rows."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: not a directory")
    rows = read_rows(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "kind" not in r and "step" in r]
    if not steps:
        raise PlotError(
            f"{run_dir}: no trainer-step rows in metrics.jsonl "
            f"({'file missing' if not (run_dir / 'metrics.jsonl').exists() else 'empty'}): nothing to plot"
        )
    plt = _pyplot()
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    evals = [r for r in rows if r.get("kind") == "eval"]
    trajs = read_rows(run_dir / "trajectories.jsonl")
    figures: list[tuple[str, Callable]] = [
        ("reward.png", lambda ax: _reward(ax, steps)),
        ("staleness.png", lambda ax: _staleness(ax, steps, trajs)),
        ("throughput.png", lambda ax: _throughput(ax, steps)),
        ("loss.png", lambda ax: _loss(ax, steps)),
        ("kl.png", lambda ax: _kl(ax, steps)),
    ] + ([("eval.png", lambda ax: _eval(ax, evals))] if evals else [])
    if any("weight_update_s" in r for r in steps):
        figures.append(("weights.png", lambda ax: _weights(ax, steps)))
    if any("truncated_frac" in r for r in steps):
        figures.append(("health.png", lambda ax: _health(ax, steps)))
    if any("ratio_p99" in r for r in steps):
        figures.append(("mismatch.png", lambda ax: _panels(ax, steps, MISMATCH_PANELS)))
    if any("tail_s" in r for r in steps):
        figures.append(("longtail.png", lambda ax: _panels(ax, _with_waste(steps), LONGTAIL_PANELS)))
    if task_names(steps):
        figures.append(("tasks.png", lambda ax: _tasks(ax, steps)))
    paths = []
    for name, draw in figures:
        paths.append(_save(plt, out / name, draw, _layout(name), _title(run_dir, name)))
    return paths


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError(f"areal-async plot needs matplotlib (pip install -e '.[bench]'): {e}") from None
    return plt


def _layout(name: str) -> tuple[int, int]:
    return {
        "staleness.png": (1, 2),
        "loss.png": (2, 3),
        "tasks.png": (1, 3),
        "health.png": (2, 2),
        "mismatch.png": (1, 3),
        "longtail.png": (1, 2),
    }.get(name, (1, 1))


def _title(run_dir: Path, name: str) -> str:
    what = {
        "reward.png": "Reward",
        "staleness.png": "Staleness",
        "throughput.png": "Throughput per role",
        "loss.png": "Loss statistics",
        "kl.png": "KL",
        "eval.png": "Evaluation",
        "weights.png": "Weight updates",
        "tasks.png": "Tasks of the mixture",
        "health.png": "Health (areal-async doctor)",
        "mismatch.png": "Mismatch block (behaviour vs proximal)",
        "longtail.png": "Long tail",
    }[name]
    return f"{what} - {run_dir.name}"


def _save(plt, path: Path, draw: Callable, layout: tuple[int, int], title: str) -> Path:
    from matplotlib.ticker import MaxNLocator

    rows, cols = layout
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows + 0.4), squeeze=False)
    draw(axes.ravel() if rows * cols > 1 else axes[0][0])
    for ax in axes.ravel():
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are whole numbers
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(ax, xs: list, ys: list, label: str, color: str, window: int) -> None:
    """Raw values thin, their moving average bold."""
    ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8)
    ax.plot(xs, moving_average(ys, window), color=color, linewidth=1.8, label=f"{label} (avg of {window})")


def _xy(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _reward(ax, steps: list[dict]) -> None:
    xs, ys = _xy(steps, "reward_mean")
    _series(ax, xs, ys, "reward_mean", "tab:blue", window_for(len(ys)))
    ax.set(xlabel="trainer step", ylabel="reward (task score, 0 to 1)", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def _staleness(axes, steps: list[dict], trajs: list[dict]) -> None:
    hist, per_step = axes
    trained = [
        t["train_step"] - t["version_min"]
        for t in trajs
        if t.get("status") == "trained" and t.get("train_step") is not None
    ]
    if trained:
        values = sorted(set(trained))
        bars = hist.bar(values, [trained.count(v) for v in values], color="tab:purple")
        hist.bar_label(bars, labels=[f"{trained.count(v)} ({trained.count(v) / len(trained):.1%})" for v in values])
        hist.set(xlabel="staleness (train step - oldest token version)", ylabel="trained samples", xticks=values)
    else:
        xs, ys = _xy(steps, "staleness_max")
        values = sorted(set(ys))
        hist.bar(values, [ys.count(v) for v in values], color="tab:purple")
        hist.set(xlabel="max staleness in the step (versions)", ylabel="trainer steps", xticks=values)
    hist.set_title("distribution")
    w = window_for(len(steps))
    for key, color in (("staleness_max", "tab:gray"), ("staleness_mean", "tab:purple")):
        xs, ys = _xy(steps, key)
        if ys:
            _series(per_step, xs, ys, key, color, w)
    per_step.set(xlabel="trainer step", ylabel="staleness (versions)", title="per step")
    per_step.grid(alpha=0.3)
    per_step.legend(loc="lower right")


def _throughput(ax, steps: list[dict]) -> None:
    w = max(2, window_for(len(steps)))
    # in steady state the three rates are equal: wide, dashed and thin lines keep each one visible
    for key, label, style in (
        ("samples_generated_total", "rollout: generated", dict(color="tab:green", lw=4, alpha=0.4)),
        ("samples_rewarded_total", "reward: scored", dict(color="tab:orange", lw=2, ls="--")),
        ("samples_trained_total", "trainer: trained", dict(color="tab:blue", lw=1)),
    ):
        xs, ys = rates(steps, key, w)
        if ys:
            ax.plot(xs, ys, label=label, **style)
    ax.set(xlabel="wall time since start (s)", ylabel=f"samples / s (over {w} steps)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


LOSS_PANELS = (
    ("loss", "PPO loss", "loss (per token)"),
    ("clip_frac", "clipped tokens", "fraction of tokens"),
    ("imp_weight_mean", "importance weight", "exp(prox - behav), mean"),
    ("rejected_frac", "rejected tokens", "fraction of tokens"),
    ("entropy", "entropy", "nats / token"),
    ("grad_norm", "gradient norm", "global L2 norm"),
)


def _loss(axes, steps: list[dict]) -> None:
    w = window_for(len(steps))
    for ax, (key, title, unit) in zip(axes, LOSS_PANELS):
        xs, ys = _xy(steps, key)
        if ys:
            _series(ax, xs, ys, key, "tab:red", w)
            ax.legend(loc="best", fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no '{key}' in metrics", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel="trainer step", ylabel=unit, title=title)
        ax.grid(alpha=0.3)


def _kl(ax, steps: list[dict]) -> None:
    w = window_for(len(steps))
    for key, label, color in (
        ("behav_approx_kl", "behaviour vs proximal (off-policy)", "tab:brown"),
        ("approx_kl", "proximal vs current (update size)", "tab:cyan"),
    ):
        xs, ys = _xy(steps, key)
        if ys:
            _series(ax, xs, ys, label, color, w)
    ax.set(xlabel="trainer step", ylabel="approx. KL (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def _health(axes, steps: list[dict]) -> None:
    """Four panels of the health columns, each key a line (raw thin, moving average bold)."""
    w, colors = window_for(len(steps)), ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    lags = sorted({k for r in steps for k in r if k.startswith("logp_gap_mean_lag")}, key=lambda k: int(k[17:]))
    panels = (
        (lags + ["logp_gap_p99"], "log-prob gap |prox - behav| by lag", "nats / token"),
        (["truncated_frac", "groups_all_zero_frac", "groups_all_one_frac", "ess_frac"], "fractions", "fraction"),
        (["completion_len_mean", "completion_len_p90"], "completion length", "tokens"),
        (["trainer_idle_frac", "rollout_idle_frac", "reward_idle_frac"], "idle", "fraction of wall time"),
    )
    for ax, (keys, title, unit) in zip(axes, panels):
        for key, color in zip(keys, colors):
            xs, ys = _xy(steps, key)
            if ys:
                _series(ax, xs, ys, key, color, w)
        ax.set(xlabel="trainer step", ylabel=unit, title=title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=7)


MISMATCH_PANELS = (  # (keys, title, unit, log y)
    (["kl_k3"], "k3 KL, behaviour vs proximal", "nats / token", False),
    (["ratio_max", "ratio_p99", "ratio_p1", "ratio_min"], "w = exp(prox - behav)", "weight (log scale)", True),
    (["masked_frac", "masked_frac_rs", "masked_frac_m2po"], "masked by the corrections", "fraction of tokens", False),
)
LONGTAIL_PANELS = (
    (["tail_s"], "the last group of the batch", "seconds the trainer waited", False),
    (["wasted_per_trained"], "generated, never trained", "wasted tokens / trained token", False),
)


def _with_waste(steps: list[dict]) -> list[dict]:
    """Rows with ``wasted_per_trained`` = wasted_tokens / trained_tokens of the step (where both are there)."""
    out = []
    for r in steps:
        w, n = r.get("wasted_tokens"), r.get("trained_tokens")
        out.append(r | ({"wasted_per_trained": w / n} if isinstance(w, (int, float)) and n else {}))
    return out


def _panels(axes, steps: list[dict], panels) -> None:
    """One panel per entry, each key a line (raw thin, moving average bold)."""
    w, colors = window_for(len(steps)), ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for ax, (keys, title, unit, log) in zip(axes, panels):
        for key, color in zip(keys, colors):
            xs, ys = _xy(steps, key)
            if ys:
                _series(ax, xs, ys, key, color, w)
        if log:
            ax.set_yscale("log")
        ax.set(xlabel="trainer step", ylabel=unit, title=title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best", fontsize=7)


def _eval(ax, evals: list[dict]) -> None:
    xs = [r["version"] for r in evals]
    ys = [r["eval_pass1"] for r in evals]
    lo = [y - (r["eval_pass1_ci_low"] if r.get("eval_pass1_ci_low") is not None else y) for r, y in zip(evals, ys)]
    hi = [(r["eval_pass1_ci_high"] if r.get("eval_pass1_ci_high") is not None else y) - y for r, y in zip(evals, ys)]
    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", color="tab:green", capsize=4, label="pass@1, 95% CI")
    k = evals[-1].get("eval_k")
    n = evals[-1].get("eval_n_problems")
    ax.set(
        xlabel="policy version (trainer steps)",
        ylabel=f"pass@1 (mean of {k} samples, {n} problems)",
        ylim=(-0.02, 1.02),
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def _weights(ax, steps: list[dict]) -> None:
    """One stacked bar per weight version (the phases of the rollout that loaded last)."""
    by_version = {r["weight_update_version"]: r for r in steps if "weight_update_s" in r}
    xs = sorted(by_version)
    bottom = [0.0] * len(xs)
    for phase, color in zip(PHASES, ("tab:blue", "tab:gray", "tab:green", "tab:olive", "tab:orange", "tab:red")):
        ys = [max(0.0, float(by_version[v].get(f"weight_update_{phase}", 0.0))) for v in xs]
        ax.bar(xs, ys, bottom=bottom, color=color, label=phase[:-2])
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.plot(xs, [by_version[v]["weight_update_s"] for v in xs], "k.", label="total")
    ax.set(xlabel="weight version", ylabel="seconds (optimizer step end -> all rollouts on it)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=7)


def task_names(steps: list[dict]) -> list[str]:
    """The tasks of a reasoning-gym run: names of its ``task/<name>/samples_total`` columns, first-seen order."""
    keys = dict.fromkeys(k for r in steps for k in r if k.startswith("task/") and k.endswith("/samples_total"))
    return [k[len("task/") : -len("/samples_total")] for k in keys]


def _tasks(axes, steps: list[dict]) -> None:
    reward, share, level = axes
    names, w = task_names(steps), window_for(len(steps))
    colors = [f"C{i % 10}" for i in range(len(names))]
    for name, color in zip(names, colors):
        xs, ys = _xy(steps, f"task/{name}/reward_mean")
        if ys:
            _series(reward, xs, ys, name, color, w)
        totals = [(r["step"], [r.get(f"task/{n}/samples_total", 0) for n in names]) for r in steps]
        pts = [(x, t[names.index(name)] / sum(t)) for x, t in totals if sum(t)]
        share.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=name)
        xs, ys = _xy(steps, f"task/{name}/level")
        if ys:
            level.step(xs, ys, where="post", color=color, label=name)
    reward.set(xlabel="trainer step", ylabel="reward (task score, 0 to 1)", ylim=(-0.02, 1.02), title="reward")
    share.set(xlabel="trainer step", ylabel="fraction of samples trained so far", ylim=(0, 1.02), title="mixture")
    level.set(xlabel="trainer step", ylabel="curriculum level", title="curriculum")
    if not level.get_legend_handles_labels()[0]:
        level.text(0.5, 0.5, "no task has levels", ha="center", va="center", transform=level.transAxes)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7)
