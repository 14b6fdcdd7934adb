"""``areal-async doctor RUN_DIR [--json]``: is this run healthy, and if not, why.

Reads a run directory, live or finished (``doctor_run.py``: metrics.jsonl with the health columns of
``scheduler/health.py`` and ``trainer/algo/mismatch.py``, the mismatch block and the long tail's columns,
reward_samples/, logs/, lost.jsonl, hangs.jsonl
and stacks/, status.json, summary.json) and runs every check of ``doctor_checks.py``. Each finding
prints its evidence (figures from the run, sample completions, captured stacks) and advice (the
config knob that moves it). Exit 0: no findings; 1: findings; 2: not a run directory. ``--json``
prints one object: ``{"run_dir", "steps", "state", "findings": [{code, title, evidence, advice,
stacks?}], "figures", "version0_gap", "skipped", "notes"}``; ``version0_gap`` (and a line of the text
report) is the rollout engine's version-0 log-probs against the trainer's recompute: step 0's lag-0
gap (tokens, p50, p99, max) and k3 KL. No torch, no zmq: it runs beside a live fleet.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_async.app.commands.doctor_checks import CHECKS, Finding, halves, mean, quarters
from areal_async.app.commands.doctor_run import DoctorError, RunData, read_run

__all__ = ["DoctorError", "diagnose", "render", "doctor_main"]

HEALTH_KEYS = ("truncated_frac", "entropy", "logp_gap_mean", "trainer_idle_frac")
STACK_LINES = 40  # of each worker's dump shown in the text report (--json has all of it)


def diagnose(run_dir: str | Path) -> tuple[RunData, list[Finding]]:
    run = read_run(run_dir)
    return run, [f for check in CHECKS for f in check(run)]


def state(run: RunData) -> str:
    if run.summary is not None:
        return "finished"
    if run.status is not None and run.status_age_s is not None and run.status_age_s < 30:
        return "live"
    return "stopped before its end (no summary.json)"


def skipped(run: RunData) -> list[str]:
    """What the checks could not read: a run of an older version lacks the health columns."""
    have = {k for r in run.rows for k in r}
    out = [f"no {k} column in metrics.jsonl: its check was skipped" for k in HEALTH_KEYS if k not in have]
    if not run.rows:
        out.append("metrics.jsonl has no step rows yet: only restarts, hangs and silence were checked")
    return out


FIGURES = (  # shown on every report (means over the second half; reward also over the first quarter)
    "reward_mean",
    "entropy",
    "truncated_frac",
    "completion_len_p90",
    "groups_all_zero_frac",
    "groups_all_one_frac",
    "staleness_at_bound_frac",
    "trainer_idle_frac",
    "rollout_idle_frac",
    "reward_idle_frac",
    "logp_gap_mean",
    "logp_gap_p99",
    "ess_frac",
    "kl_k3",
    "ratio_p99",
    "masked_frac",
    "tail_s",
)


def figures(run: RunData) -> dict[str, float]:
    """The health figures the checks judged: second-half means (reward: first quarter too)."""
    late = halves(run.rows)
    out = {k: mean(run.series(k, late)) for k in FIGURES}
    out["reward_mean_first_quarter"] = mean(run.series("reward_mean", quarters(run.rows)[0])) if run.rows else None
    wasted, trained = sum(run.series("wasted_tokens", late)), sum(run.series("trained_tokens", late))
    out["wasted_per_trained"] = wasted / trained if trained else None  # generated, never trained (issue 42)
    return {k: round(v, 4) for k, v in out.items() if v is not None}


VERSION0_KEYS = ("tokens", "logp_gap_p50", "logp_gap_p99", "logp_gap_max", "kl_k3")


def version0_gap(run: RunData) -> dict[str, float]:
    """The engine's version-0 log-probs against the trainer's recompute of the same weights: step 0's
    lag-0 columns (``trainer/algo/mismatch.py``); {} without a step 0 row or its proximal log-probs."""
    row = next((r for r in run.rows if r.get("step") == 0), None)
    if row is None or "tokens_lag0" not in row:
        return {}
    out = {k: row.get(f"{k}_lag0") for k in VERSION0_KEYS}
    return {k: v for k, v in out.items() if isinstance(v, (int, float))}


def version0_line(gap: dict[str, float], backend: str) -> str:
    figs = ", ".join(f"{k.removeprefix('logp_gap_')} {gap[k]:.3g}" for k in VERSION0_KEYS[1:4] if k in gap)
    k3 = f"; k3 KL {gap['kl_k3']:.3g} nats/token" if "kl_k3" in gap else ""
    return (
        f"  version 0 ({backend} engine vs the trainer's recompute, step 0's {gap.get('tokens', 0):.0f} tokens): "
        f"|log p_behav - log p_prox| {figs}{k3}"
    )


def as_json(run: RunData, findings: list[Finding]) -> dict:
    return {
        "run_dir": str(run.run_dir),
        "steps": len(run.rows),
        "state": state(run),
        "findings": [f.as_dict() for f in findings],
        "figures": figures(run),
        "version0_gap": version0_gap(run),
        "skipped": skipped(run),
        "notes": run.notes,
    }


def render(run: RunData, findings: list[Finding]) -> str:
    head = f"areal-async doctor: {run.run_dir}: {len(run.rows)} steps, {state(run)}"
    lines = [f"{head}: {len(findings) or 'no'} finding(s)"]
    figs = figures(run)
    if figs:
        lines.append("  figures (second-half means unless named): " + ", ".join(f"{k} {v:g}" for k, v in figs.items()))
    gap = version0_gap(run)
    if gap:
        lines.append(version0_line(gap, str(run.get("rollout.backend", "torch"))))
    for f in findings:
        lines += ["", f"[{f.code}] {f.title}"]
        lines += [f"  evidence: {e}" for e in f.evidence]
        lines.append(f"  advice: {f.advice}")
        for wid, text in sorted(f.stacks.items()):
            body = text.rstrip().splitlines()
            shown = f", first {STACK_LINES}" if len(body) > STACK_LINES else ""
            lines.append(f"  stacks of {wid} ({len(body)} lines{shown}):")
            lines += ["    | " + x for x in body[:STACK_LINES]]
    lines += [f"  (skipped: {s})" for s in skipped(run)] + [f"  (note: {n})" for n in run.notes[:5]]
    return "\n".join(lines)


def doctor_main(run_dir: str, as_json_out: bool) -> int:
    """The command: exit 0 healthy, 1 findings, 2 not a run directory."""
    try:
        run, findings = diagnose(run_dir)
    except DoctorError as e:
        print(f"areal-async doctor: error: {e}")
        return 2
    print(json.dumps(as_json(run, findings), indent=2) if as_json_out else render(run, findings))
    return 1 if findings else 0
