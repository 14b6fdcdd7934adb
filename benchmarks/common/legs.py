"""Ratios of a measured run to in-process legs, framed the ways a skeptic asks for.

A benchmark that compares runs (the fleet at each η) with an in-process baseline measures the
baseline in legs: one before the first run and one after each, ``legs[k]`` and ``legs[k + 1]``
around the k-th run. Each run then gets four ratios, one row each:

- ``<subject>_vs_inprocess_ms_per_step_ratio``: wall ms per step over the mean of the two legs
  around it (``framing`` "legs_around");
- ``<subject>_vs_inprocess_ms_per_step_first_leg_ratio``: over the first leg alone, measured
  before any run could leave the machine in another state (``framing`` "first_leg");
- ``<subject>_vs_inprocess_cpu_ms_per_step_ratio`` and ``..._cpu_ms_per_step_first_leg_ratio``:
  the same in CPU ms per step (every process of the run over the loop's own process): what a
  step costs in CPU, which other processes' load does not stretch the way it stretches wall time.

``subject`` is "fleet" for real runs and "null" for a null run: the same sequence of legs with an
in-process leg of the same loop (a stand-in) where each fleet run was. A stand-in is the baseline
itself, so its ratios are 1 up to noise and drift; how far they are from 1 is how far the legs
alone move a ratio. Rows carry ``baseline`` (which in-process loop) and ``eta``; wall-ratio rows
are judged against ``targets[eta]`` when there is one (``meets_target``: ratio <= target).
"""

from __future__ import annotations

import statistics
from typing import Optional

QUANTITIES = (("ms", "step"), ("cpu_ms", "cpu"))  # (metric word, key of a run or leg dict)


def legs_around(legs: list[dict], k: int, key: str) -> Optional[float]:
    """Mean of ``legs[k][key]`` and ``legs[k + 1][key]``: the legs before and after the k-th run."""
    vals = [legs[k].get(key), legs[k + 1].get(key)]
    return None if None in vals else statistics.fmean(vals)


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or den is None or den <= 0 else num / den


def ratio_rows(
    subject: str,
    runs: dict[int, dict],
    legs: list[dict],
    baseline: str,
    targets: dict[int, float],
    meta: dict,
) -> list[dict]:
    """Four ratio rows per run (see the module docstring). ``runs``: {eta: {"step": ms, "cpu": ms or
    None}}, run k (in sorted eta order) measured between ``legs[k]`` and ``legs[k + 1]``."""
    if len(legs) != len(runs) + 1:
        raise ValueError(f"{len(runs)} runs need {len(runs) + 1} legs around them; got {len(legs)}")
    rows = []
    for k, eta in enumerate(sorted(runs)):
        for word, key in QUANTITIES:
            num = runs[eta].get(key)
            for framing, den in (("legs_around", legs_around(legs, k, key)), ("first_leg", legs[0].get(key))):
                suffix = "" if framing == "legs_around" else "_first_leg"
                value = _ratio(num, den)
                target = targets.get(eta) if word == "ms" and subject == "fleet" else None
                rows.append(
                    {
                        "metric": f"{subject}_vs_inprocess_{word}_per_step{suffix}_ratio",
                        "value": value,
                        "unit": "ratio",
                        "eta": eta,
                        "baseline": baseline,
                        "framing": framing,
                        "numerator": num,
                        "denominator": den,
                        "target": target,
                        "meets_target": None if target is None or value is None else value <= target,
                        **meta,
                    }
                )
    return rows


def find(rows: list[dict], metric: str, eta: int, baseline: str) -> Optional[float]:
    """The value of the row with this metric, eta and baseline (None when there is none)."""
    got = [r["value"] for r in rows if r["metric"] == metric and r.get("eta") == eta and r.get("baseline") == baseline]
    return got[0] if got else None
