"""End-to-end (issue 42): real tiny fleets with rollout.on_weights and rollout.over_provision; the books stay exact
(check_books: staleness bound, every sample once, ``areal-async verify``) and the new columns say what happened."""

from __future__ import annotations

import pytest

from tests.support.fleet import check_books, read_jsonl, run_ok

pytestmark = pytest.mark.slow


def test_keep_with_over_provisioning_keeps_exact_books(tmp_path):
    """eta 1, keep, F = 0.5 (2 extra groups for a batch of 4): stragglers are cut, re-issued and booked, their
    tokens counted as wasted; the updates recompute nothing; verify agrees."""
    run = tmp_path / "run"
    run_ok(run, "rollout.max_head_offpolicyness=1", "rollout.on_weights=keep", "rollout.over_provision=0.5")
    trained = check_books(run, eta=1)
    trajs = read_jsonl(run / "trajectories.jsonl")
    cut = [t for t in trajs if (t["reason"] or "").startswith("straggler")]
    assert cut, "no straggler was cut"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert sum(m["trained_tokens"] for m in metrics) == sum(t["n_output_tokens"] for t in trained)
    assert metrics[-1]["wasted_tokens_total"] == sum(m["wasted_tokens"] for m in metrics) > 0
    assert all(m["tail_s"] >= 0 for m in metrics)
    updates = [m for m in metrics if "weight_update_recompute_s" in m]
    assert updates and all(m["weight_update_recompute_s"] == 0.0 for m in updates)  # keep: nothing recomputed
    for key in ("kl_k3", "ratio_max", "ratio_p99", "masked_frac", "masked_frac_rs", "masked_frac_m2po"):
        assert all(key in m for m in metrics), key


def test_finish_trains_samples_of_one_version_each(tmp_path):
    """eta 1, finish: an update waits for the running samples, so none spans two versions; the wait is booked
    as drain_s inside the update's queue phase."""
    run = tmp_path / "run"
    run_ok(run, "rollout.max_head_offpolicyness=1", "rollout.on_weights=finish")
    trained = check_books(run, eta=1)
    assert all(t["version_min"] == t["version_max"] for t in trained)
    metrics = read_jsonl(run / "metrics.jsonl")
    pairs = [(m["weight_update_drain_s"], m["weight_update_queue_s"]) for m in metrics if "weight_update_drain_s" in m]
    assert pairs and all(0 <= d <= q + 1e-6 for d, q in pairs)
