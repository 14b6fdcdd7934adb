"""The control plane at scale: the scheduler's messages a second for a fleet of N GPUs, and the share of
one core they take at a measured rate (``benchmarks.scale_model --scheduler-from``).

The fleet (as ``docs/architecture.md`` "The scheduler at scale" counts it): one worker process per GPU,
each heart-beating every ``heartbeat_s``; a boba step of ``groups`` groups every ``step_s`` seconds,
about 3 messages per group (its generate request, trajectory report and reward result) and 2 per worker
(weights published to it, loaded by it). The rate is ``scheduler_service_messages_per_s``'s messages per
CPU second (``benchmarks.data_path``: the real ``SchedulerService`` on one core under a real run's mix),
the lowest of the rows given. A MODEL: the mix at scale is not the measured one (there heartbeats, the
cheapest messages, dominate; the measured mix's messages carry ~11 groups each), so the share is an
estimate, not a measurement.
"""

from __future__ import annotations

CONTROL_GPUS = (1000, 10_000)
HEARTBEAT_S = 2.0  # cluster.heartbeat_s
BOBA_GROUPS, BOBA_STEP_S = 512, 30.0
MESSAGES_PER_GROUP, MESSAGES_PER_WORKER_STEP = 3, 2
ASSUMED = f"1 worker a GPU, a heartbeat each {HEARTBEAT_S:g} s, {BOBA_GROUPS} groups every {BOBA_STEP_S:g} s"


def control_messages(
    gpus: int, heartbeat_s: float = HEARTBEAT_S, groups: int = BOBA_GROUPS, step_s: float = BOBA_STEP_S
):
    """Messages a second to the scheduler, by kind, for ``gpus`` workers."""
    return {
        "heartbeats": gpus / heartbeat_s,
        "groups": MESSAGES_PER_GROUP * groups / step_s,
        "weights": MESSAGES_PER_WORKER_STEP * gpus / step_s,
    }


def service_rate(rows: list[dict]) -> tuple[float, dict]:
    """The lowest messages per CPU second among ``scheduler_service_messages_per_s`` rows, and its row."""
    service = [r for r in rows if r.get("metric") == "scheduler_service_messages_per_s" and r.get("messages_per_cpu_s")]
    if not service:
        raise ValueError("no scheduler_service_messages_per_s row with messages_per_cpu_s (benchmarks.data_path)")
    row = min(service, key=lambda r: r["messages_per_cpu_s"])
    return row["messages_per_cpu_s"], row


def control_rows(rows: list[dict], source: str = "") -> list[dict]:
    """``predict_scheduler_core_frac`` at each of ``CONTROL_GPUS``: the fleet's messages a second over the
    service's measured messages per CPU second (see the module docstring)."""
    rate, measured = service_rate(rows)
    out = []
    for gpus in CONTROL_GPUS:
        parts = control_messages(gpus)
        total = sum(parts.values())
        out.append(
            {
                "metric": "predict_scheduler_core_frac",
                "value": total / rate,
                "unit": "cores",
                "gpus": gpus,
                "messages_per_s": total,
                "parts": parts,
                "rate_messages_per_cpu_s": rate,
                "rate_messages_per_s": measured.get("value"),
                "rate_source": source or measured.get("commit", ""),
                "assumptions": ASSUMED,
            }
        )
    return out


def control_rows_by_kind(rows: list[dict], source: str = "") -> list[dict]:
    """``predict_scheduler_core_frac_by_kind`` at each of ``CONTROL_GPUS`` whose heartbeat rate was measured on
    its own (``scheduler_service_heartbeat_core_frac`` at ``gpus / heartbeat_s`` a second, within 1 %): that
    measured share for the heartbeats, plus the group and weight messages at the mix's rate (``service_rate``:
    its messages carry ~11 groups each; a lone weight message, like a lone heartbeat at a few hundred a
    second, pays its own loop wakeup and costs about as much: an estimate, not a bound). None measured: no rows."""
    beats = [r for r in rows if r.get("metric") == "scheduler_service_heartbeat_core_frac"]
    if not beats:
        return []
    rate, measured = service_rate(rows)
    out = []
    for gpus in CONTROL_GPUS:
        parts = control_messages(gpus)
        hb = [r for r in beats if abs(r["heartbeats_per_s"] - parts["heartbeats"]) <= 0.01 * parts["heartbeats"]]
        if not hb:
            continue
        beat_frac = max(r["value"] for r in hb)  # the costliest of the measurements at this rate
        rest = parts["groups"] + parts["weights"]
        out.append(
            {
                "metric": "predict_scheduler_core_frac_by_kind",
                "value": beat_frac + rest / rate,
                "unit": "cores",
                "gpus": gpus,
                "messages_per_s": sum(parts.values()),
                "parts": parts,
                "heartbeat_core_frac": beat_frac,
                "rest_core_frac": rest / rate,
                "rate_messages_per_cpu_s": rate,
                "rate_source": source or measured.get("commit", ""),
                "assumptions": ASSUMED,
            }
        )
    return out
