"""The findings of ``areal-async doctor``: each check reads ``RunData`` and returns findings or none.

Windows: trends compare the first quarter of the step rows with the last quarter; levels are read
over the second half (the first steps carry the start-up: SFT warm-up weights, an empty pipeline).
Thresholds, and why each sits where it does. The healthy figures they keep a margin to: ten default
tiny_arith runs (seeds 0-9, 300 steps, eta 1, a shared 2-core machine) measured over the second half
entropy 0.049-0.072 nats/token (last/first quarter 0.45-0.58), truncation 0.4-8.3 %, length flat,
log-prob gap 0.003-0.008 nats/token, ESS >= 0.998, every sample at staleness 1 with the trainer idle
1-2 % and the rollouts idle 75-79 %.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from areal_async.app.commands.doctor_run import RunData

MIN_ROWS = 3  # a level needs a few steps; fewer rows: only the restart / hang / silence checks run
# every trained sample scored exactly 0 for at least this many steps: GRPO-style advantages are all
# 0, so nothing is learned; a random policy on a real task almost never scores 0 on every sample
ZERO_REWARD_MIN_ROWS = 3
# mean entropy (nats per output token, at the sampling temperature) of the second half below this:
# the policy samples one token wherever it is sure of anything, and groups stop differing
ENTROPY_FLOOR = 0.02
ENTROPY_DROP = 0.1  # or the last quarter's mean below a tenth of the first quarter's (a collapse in-run)
TRUNCATED_FRAC = 0.2  # one sample in five cut by max_new_tokens: the reward then scores the budget
LENGTH_GROWTH, LENGTH_NEAR_BUDGET = 1.5, 0.9  # last/first quarter mean length, p90 vs max_new_tokens
# staleness at the bound: three in four trained samples at staleness = eta over the second half while
# the trainer is idle less than FED_IDLE of the time. Only at eta >= 2: at eta = 1 the bound binds
# whenever generation is faster than training (the default preset: 100 % at the bound, trainer idle
# ~1 %) and it is the least overlap that keeps the trainer fed (eta = 0 serialises the two); above
# it, a bound that binds while the trainer never waits buys only staler samples
AT_BOUND_FRAC, FED_IDLE = 0.75, 0.25
# a role idle three quarters of the wall time over the second half, when it holds resources of its
# own (GPUs, or pinned CPUs: cluster.cpu_affinity): idle then is waste. Unpinned CPU workers that
# wait give their core to the others (the default preset's rollouts idle 75-79 % and that speeds
# the trainer up), so there the idle fractions are shown, not found
IDLE_FRAC = 0.75
GAP_GROWTH, GAP_FLOOR = 2.0, 0.05  # last/first quarter mean log-prob gap, and a floor in nats/token
# the off-policy corrections (IcePop, sequence masks, M2PO: docs/objectives.md) took a tenth of the trained
# tokens out of the loss over the second half: the data is too far off-policy for its bounds, and the run
# trains on what the masks leave (healthy tiny_arith runs at eta 1 mask ~0 %; IcePop's paper reports masking
# well under 1 % of tokens on a healthy MoE run)
MASKED_FRAC = 0.1
# the last group of each batch kept the trainer waiting a third of the step over the second half, with no
# over-provisioning: the long tail decides the step time (rollout.over_provision aborts such stragglers)
TAIL_FRAC = 1 / 3
SILENT_FACTOR = 3.0  # a live worker's heartbeat older than this many heartbeat periods


@dataclass
class Finding:
    code: str
    title: str
    evidence: list[str]
    advice: str
    stacks: dict[str, str] = field(default_factory=dict)  # worker -> its dumped stacks (hang captures)

    def as_dict(self) -> dict:
        d = {"code": self.code, "title": self.title, "evidence": self.evidence, "advice": self.advice}
        return d | ({"stacks": self.stacks} if self.stacks else {})


def halves(rows: list[dict]) -> list[dict]:
    return rows[len(rows) // 2 :]


def quarters(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    q = max(1, len(rows) // 4)
    return rows[:q], rows[-q:]


def mean(xs: list[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def check_zero_reward(run: RunData) -> list[Finding]:
    scores = run.series("reward_mean")
    if len(scores) < ZERO_REWARD_MIN_ROWS or any(s != 0 for s in scores):
        return []
    n = int(sum(run.series("samples_trained")))
    ev = [f"reward_mean is 0 in every one of {len(scores)} steps ({n} samples trained, all scored 0)"]
    ev += _reward_sample_lines(run)
    recorded = [
        (b, sc, s.get("solutions", []))
        for s in run.reward_samples
        for b, sc in zip(s.get("boxed", []), s.get("scores", []))
    ]
    matched = [b for b, sc, refs in recorded if sc == 0 and b is not None and any(_same_answer(b, r) for r in refs)]
    boxed = sum(b is not None for b, _, _ in recorded)
    if recorded:
        ev.append(
            f"of {len(recorded)} recorded completions, {boxed} have a \\boxed{{}} answer and {len(matched)} of "
            "those equal the reference, all scored 0"
        )
    fn = run.get("reward.fn", "the default boxed_math_reward")
    cut = mean(run.series("truncated_frac"))
    if cut is not None and cut >= TRUNCATED_FRAC and not matched:
        advice = (
            f"{_pct(cut)} of the samples were cut at gconfig.max_new_tokens={run.get('gconfig.max_new_tokens')} "
            "before their answer: raise it (see the truncation finding)"
        )
    elif matched:
        advice = (
            f"the completions carry the right answer in \\boxed{{}} and still score 0: the reward "
            f"function (reward.fn={fn}) does not read the format the model writes. Make the template "
            "(train_dataset.template, the SFT warm-up's answer format) and the reward's parser agree; "
            "`areal-async check-plugin` runs a reward on a sample"
        )
    else:
        advice = (
            f"no recorded completion has a \\boxed{{}} answer equal to the reference: check the prompt "
            f"template (train_dataset.template) and what reward.fn={fn} parses, on the samples above"
        )
    return [Finding("reward_all_zero", "every trained sample scored 0", ev, advice)]


def _same_answer(a: str, b: str) -> bool:
    def norm(x: str) -> str:
        x = x.strip().strip("$").strip()
        return x.lstrip("0") or "0" if x.isdigit() else x

    return norm(a) == norm(b)


def _reward_sample_lines(run: RunData, k: int = 3) -> list[str]:
    if not run.reward_samples:
        return ["no reward_samples/*.jsonl in the run directory: no completion to show"]
    out = []
    for s in run.reward_samples[:k]:
        for c, b, sc, st in zip(
            s.get("completions", []), s.get("boxed", []), s.get("scores", []), s.get("statuses", [])
        ):
            out.append(
                f"completion {c!r} -> last \\boxed{{}}: {b!r}, reference {s.get('solutions')}, score {sc:g} ({st})"
            )
            break
    return out


def check_entropy(run: RunData) -> list[Finding]:
    ent = run.series("entropy")
    if len(ent) < MIN_ROWS:
        return []
    late = mean(run.series("entropy", halves(run.rows)))
    first, last = (mean(run.series("entropy", q)) for q in quarters(run.rows))
    temp = run.get("gconfig.temperature")
    ev = [
        (
            f"entropy (nats/token at temperature {temp}): first quarter {first:.4f}, last quarter {last:.4f}, "
            f"second half {late:.4f}"
        )
    ]
    uniform = mean(
        [
            a + b
            for a, b in zip(
                run.series("groups_all_zero_frac", halves(run.rows)),
                run.series("groups_all_one_frac", halves(run.rows)),
            )
        ]
    )
    if uniform is not None:
        ev.append(f"groups whose samples all scored the same (no learning signal): {_pct(uniform)}")
    if late < ENTROPY_FLOOR:
        title = f"entropy {late:.4f} nats/token over the second half, below {ENTROPY_FLOOR}"
    elif first > 0 and last < ENTROPY_DROP * first:
        title = f"entropy collapsed during the run: {first:.4f} -> {last:.4f} nats/token"
    else:
        return []
    advice = (
        f"sampling is near greedy: raise gconfig.temperature (now {temp}), lower actor.optimizer.lr, "
        "or add an entropy bonus (actor.entropy_coef)"
    )
    return [Finding("entropy_collapse", title, ev, advice)]


def check_truncation(run: RunData) -> list[Finding]:
    late = halves(run.rows)
    frac = mean(run.series("truncated_frac", late))
    if frac is None or len(run.rows) < MIN_ROWS or frac < TRUNCATED_FRAC:
        return []
    budget = run.get("gconfig.max_new_tokens")
    ev = [
        f"{_pct(frac)} of the samples trained in the second half ended at max_new_tokens={budget} without EOS",
        (
            f"completion length p50 {mean(run.series('completion_len_p50', late)):.1f}, "
            f"p90 {mean(run.series('completion_len_p90', late)):.1f} tokens"
        ),
    ]
    advice = (
        f"raise gconfig.max_new_tokens (now {budget}) above the p90 length the task needs; a cut answer "
        "scores 0 whether it was right or not"
    )
    return [Finding("truncation", f"{_pct(frac)} of samples truncated (no EOS)", ev, advice)]


def check_length_runaway(run: RunData) -> list[Finding]:
    if len(run.rows) < 4 * MIN_ROWS:
        return []
    head, tail = quarters(run.rows)
    first, last = mean(run.series("completion_len_mean", head)), mean(run.series("completion_len_mean", tail))
    p90, budget = mean(run.series("completion_len_p90", tail)), run.get("gconfig.max_new_tokens")
    if first is None or last is None or p90 is None or not budget or first <= 0:
        return []
    if last < LENGTH_GROWTH * first or p90 < LENGTH_NEAR_BUDGET * budget:
        return []
    ev = [
        (
            f"mean completion length {first:.1f} -> {last:.1f} tokens (first to last quarter); "
            f"last quarter p90 {p90:.1f} of max_new_tokens={budget}"
        )
    ]
    advice = (
        "lengths grow toward the budget: check for repetition in the completions; an overlong penalty "
        "(actor.overlong_reward_penalty) or a length-normalised loss (actor.loss_agg_mode) holds them"
    )
    return [Finding("length_runaway", "completion length runs toward max_new_tokens", ev, advice)]


def check_staleness(run: RunData) -> list[Finding]:
    eta = run.eta
    late = halves(run.rows)
    frac, t_idle = mean(run.series("staleness_at_bound_frac", late)), mean(run.series("trainer_idle_frac", late))
    if not eta or eta < 2 or frac is None or t_idle is None or len(run.rows) < MIN_ROWS:
        return []
    if frac < AT_BOUND_FRAC or t_idle >= FED_IDLE:
        return []
    ev = [
        (
            f"{_pct(frac)} of the samples trained in the second half had staleness = eta = {eta} "
            f"(staleness mean {mean(run.series('staleness_mean', late)):.2f})"
        ),
        f"the trainer idle {_pct(t_idle)} of the time: it never waited for data",
    ]
    r_idle = mean(run.series("rollout_idle_frac", late))
    if r_idle is not None:
        ev.append(f"rollout workers idle {_pct(r_idle)} of the time (waiting for admission under the bound)")
    advice = (
        f"generation is faster than training and runs as far ahead as rollout.max_head_offpolicyness={eta} "
        "lets it: a smaller eta (1 keeps a faster generation one batch ahead) trains on fresher samples at "
        "the same speed; or give the trainer more (cluster.cpu_affinity.trainer, trainer ranks)"
    )
    return [Finding("staleness_at_bound", f"staleness sits at the bound eta={eta}", ev, advice)]


def dedicated(run: RunData, role: str) -> bool:
    """Whether ``role`` holds resources of its own: GPUs (cluster.device=cuda) or pinned CPUs."""
    return run.get("cluster.device") == "cuda" or bool(run.get(f"cluster.cpu_affinity.{role}"))


def check_idle(run: RunData) -> list[Finding]:
    late, out = halves(run.rows), []
    if len(run.rows) < MIN_ROWS:
        return []
    eta = run.eta
    knobs = {
        "trainer": f"the trainer waits for data: more generation (cluster.n_rollout_workers, rollout."
        f"max_concurrent_rollouts) or more overlap (rollout.max_head_offpolicyness, now {eta})",
        "rollout": "the rollout workers wait: for admission (the staleness bound rollout.max_head_offpolicyness, "
        f"now {eta}) or for the trainer's weights; fewer rollout workers (cluster.n_rollout_workers) or a "
        "faster trainer (cluster.cpu_affinity.trainer, trainer ranks)",
    }
    for role, advice in knobs.items():
        idle = mean(run.series(f"{role}_idle_frac", late))
        if idle is not None and idle >= IDLE_FRAC and dedicated(run, role):
            ev = [
                (
                    f"{role}_idle_frac {_pct(idle)} over the second half, on resources of its own "
                    f"(cluster.device={run.get('cluster.device')}, cluster.cpu_affinity.{role}="
                    f"{run.get(f'cluster.cpu_affinity.{role}')!r})"
                ),
                (
                    f"step_s mean {mean(run.series('step_s', late)):.2f}s, train_s mean "
                    f"{mean(run.series('train_s', late)):.2f}s"
                ),
            ]
            out.append(Finding(f"{role}_idle", f"the {role} is idle {_pct(idle)} of the time", ev, advice))
    return out


def check_gap(run: RunData) -> list[Finding]:
    if len(run.rows) < 4 * MIN_ROWS:
        return []
    head, tail = quarters(run.rows)
    first, last = mean(run.series("logp_gap_mean", head)), mean(run.series("logp_gap_mean", tail))
    if first is None or last is None or last < GAP_FLOOR or last < GAP_GROWTH * first:
        return []
    ev = [f"mean |log p_prox - log p_behav| {first:.4f} -> {last:.4f} nats/token (first to last quarter)"]
    for key in sorted({k for r in tail for k in r if k.startswith("logp_gap_mean_lag")}):
        ev.append(f"{key}: {mean(run.series(key, head)) or 0:.4f} -> {mean(run.series(key, tail)) or 0:.4f}")
    ess = mean(run.series("ess_frac", tail))
    if ess is not None:
        ev.append(f"effective sample size of the importance weights, last quarter: {_pct(ess)} of the tokens")
    advice = (
        "the rollouts' log-probs drift from the trainer's: a growing gap at lag 0 points at the engine or "
        "the weight update (precision, a missed update); at larger lags, at staleness (lower "
        "rollout.max_head_offpolicyness or actor.optimizer.lr)"
    )
    return [Finding("mismatch_growing", "the behaviour vs proximal log-prob gap grows", ev, advice)]


def check_masking(run: RunData) -> list[Finding]:
    """The mismatch block (``trainer/algo/mismatch.py``, ``trainer/algo/corrections.py``): corrections masking a large
    share of the trained tokens."""
    late = halves(run.rows)
    masked = mean(run.series("masked_frac", late))
    if len(run.rows) < MIN_ROWS or masked is None or masked < MASKED_FRAC:
        return []
    figs = {k: mean(run.series(k, late)) for k in ("masked_frac_rs", "masked_frac_m2po", "kl_k3", "ratio_p99")}
    ev = [f"masked_frac {_pct(masked)} of the trained tokens over the second half"]
    ev += [f"{k} {v:.4g}" for k, v in figs.items() if v is not None]
    rs = run.get("actor.rejection_sampling", {}) or {}
    ev.append(
        f"actor.rejection_sampling level={rs.get('level', 'token')} lower={rs.get('lower')} "
        f"upper={rs.get('upper')} agg={rs.get('agg', 'mean')}, actor.m2_threshold={run.get('actor.m2_threshold')}"
    )
    advice = (
        "the batches are too far off-policy for the corrections' bounds, and the update learns from what they "
        "leave: lower rollout.max_head_offpolicyness or actor.optimizer.lr (staleness), or look at the "
        "version-0 gap (the engine's numerics) before widening the bounds"
    )
    return [Finding("mismatch_masking", f"the corrections mask {_pct(masked)} of the trained tokens", ev, advice)]


def check_long_tail(run: RunData) -> list[Finding]:
    """``tail_s`` against ``step_s`` over the second half, when nothing over-provisions."""
    late = halves(run.rows)
    tail, step = mean(run.series("tail_s", late)), mean(run.series("step_s", late))
    if len(run.rows) < MIN_ROWS or tail is None or not step or tail < TAIL_FRAC * step:
        return []
    if (run.get("rollout.over_provision", 0) or 0) > 0:
        return []
    ev = [
        (
            f"tail_s mean {tail:.2f}s of step_s {step:.2f}s over the second half: the batch's last group kept the "
            "trainer waiting that long after the one before it"
        ),
        f"rollout.max_head_offpolicyness={run.get('rollout.max_head_offpolicyness')}, rollout.over_provision=0",
    ]
    advice = (
        "start a few groups beyond what a step needs and abort the stragglers once the batch is full "
        "(rollout.over_provision, e.g. 0.25; aborted groups are re-issued, their tokens counted in wasted_tokens)"
    )
    return [Finding("long_tail", f"the batch's last group costs {_pct(tail / step)} of the step", ev, advice)]


def check_restarts(run: RunData) -> list[Finding]:
    out = []
    if run.restarts:
        ev = [f"{r.worker} restart {r.count}; its last lines: " + " | ".join(r.last_lines) for r in run.restarts]
        out.append(
            Finding(
                "restarts",
                f"{len(run.restarts)} worker restart(s)",
                ev,
                "read the dead worker's log (logs/<worker>.log) above each restart mark",
            )
        )
    if run.recoveries or run.resumed:
        ev = [
            f"{run.recoveries} in-run recovery(ies) from a checkpoint" if run.recoveries else "",
            "metrics.rolled_back.jsonl: the books were cut back to a checkpoint (a resume)" if run.resumed else "",
        ]
        out.append(
            Finding(
                "recoveries",
                "the fleet was relaunched from a checkpoint",
                [e for e in ev if e],
                "the supervisor's report of why is in its output; the rolled-back steps were trained again",
            )
        )
    return out


def check_silence(run: RunData) -> list[Finding]:
    out = []
    for rec in run.lost:
        out.append(
            Finding(
                "silent_role",
                f"worker {rec.get('worker')} went silent and was declared lost",
                [f"lost.jsonl: {rec}"],
                "see logs/<worker>.log; its work was re-issued",
            )
        )
    if run.status is not None and run.summary is None and run.status_age_s is not None:
        out += _silent_in_status(run)
    return out


def _silent_in_status(run: RunData) -> list[Finding]:
    """Workers whose heartbeat was SILENT_FACTOR periods old in the scheduler's last status.json; when
    that file itself is that old the scheduler stopped writing it (a fleet that ended without a
    summary, or a stuck scheduler): its figures are as of then, and that is a finding too."""
    hb = float(run.get("cluster.heartbeat_s", 2.0))
    live = run.status_age_s <= SILENT_FACTOR * hb
    as_of = "now" if live else f"when status.json was last written, {run.status_age_s:.0f}s ago"
    out = []
    for wid, w in sorted(run.status.get("workers", {}).items()):
        silent = float(w.get("silent_s", 0.0)) + (run.status_age_s if live else 0.0)
        if silent > SILENT_FACTOR * hb:
            ev = [f"last heartbeat {silent:.0f}s old {as_of}; it was waiting for {w.get('waiting_for') or '?'}"]
            advice = f"heartbeats come every cluster.heartbeat_s={hb:g}s; look at logs/{wid}.log"
            out.append(Finding("silent_role", f"{wid} silent for {silent:.0f}s", ev, advice))
    if not live and not run.hangs:
        ev = [f"status.json is {run.status_age_s:.0f}s old (the scheduler rewrites it every heartbeat)"]
        advice = "the fleet is not running (it ended without summary.json: see the supervisor's output) or is stuck"
        out.append(Finding("silent_role", "the scheduler stopped reporting before the run ended", ev, advice))
    return out


def check_hangs(run: RunData) -> list[Finding]:
    out = []
    for cap in run.hangs:
        ev = [f"watchdog: {cap.get('why', '?')}"]
        stacks = {}
        for wid, w in sorted(cap.get("workers", {}).items()):
            state = {"T": "STOPPED (by a signal)", "D": "in uninterruptible I/O", "Z": "a zombie"}.get(
                w.get("state"), w.get("state", "?")
            )
            ev.append(
                f"{wid} (pid {w.get('pid')}): process state {state}; "
                + ("stacks dumped" if w.get("dumped") and w.get("stacks") else w.get("note", "no stacks"))
            )
            if w.get("stacks"):
                stacks[wid] = w["stacks"]
        stopped = [w for w, e in cap.get("workers", {}).items() if e.get("state") == "T"]
        advice = (
            f"{', '.join(stopped)} was stopped by a signal (SIGSTOP/SIGTSTP; a debugger, a job control ^Z): "
            "resume it with SIGCONT"
            if stopped
            else "the stacks below show where each role waited when the watchdog fired"
        )
        out.append(Finding("hang", "the step watchdog fired: stacks captured", ev, advice, stacks))
    return out


CHECKS: list[Callable[[RunData], list[Finding]]] = [
    check_zero_reward,
    check_entropy,
    check_truncation,
    check_length_runaway,
    check_staleness,
    check_idle,
    check_gap,
    check_masking,
    check_long_tail,
    check_restarts,
    check_silence,
    check_hangs,
]
