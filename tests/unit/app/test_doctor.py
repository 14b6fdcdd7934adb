"""areal-async doctor on synthetic run directories: hand-written metrics rows, reward samples, logs,
lost/hang records. Each finding is provoked alone on top of a healthy run and must name its evidence."""

import json
import os
import time

import pytest

from areal_async.app.commands.doctor import as_json, diagnose, doctor_main
from areal_async.app.commands.doctor_run import read_run
from areal_async.base.manifest import RunManifest

CFG = """\
gconfig: {max_new_tokens: 12, temperature: 1.0}
rollout: {max_head_offpolicyness: 2}
reward: {fn: my_pkg.rewards:tagged}
cluster: {heartbeat_s: 2.0}
"""


def healthy_row(step):
    return {
        "step": step,
        "version": step + 1,
        "reward_mean": 0.5,
        "samples_trained": 128,
        "step_s": 1.0,
        "train_s": 0.7,
        "publish_s": 0.05,
        "staleness_mean": 0.8,
        "staleness_max": 2,
        "entropy": 0.3,
        "truncated_frac": 0.01,
        "completion_len_mean": 7.0,
        "completion_len_p50": 7.0,
        "completion_len_p90": 9.0,
        "groups_all_zero_frac": 0.1,
        "groups_all_one_frac": 0.2,
        "staleness_at_bound_frac": 0.3,
        "trainer_idle_frac": 0.05,
        "rollout_idle_frac": 0.2,
        "logp_gap_mean": 0.01,
        "logp_gap_mean_lag0": 0.002,
        "logp_gap_mean_lag1": 0.02,
        "ess_frac": 0.98,
    }


def make_run(tmp_path, n=40, change=None, finished=True):
    """A run directory of ``n`` healthy rows; ``change(step, row)`` edits each row."""
    (tmp_path / "config.yaml").write_text(CFG)
    rows = []
    for k in range(n):
        row = healthy_row(k)
        if change:
            change(k, row)
        rows.append(row)
    rows.insert(5, {"kind": "eval", "step": 5, "pass@1": 0.4})  # evaluation rows are not steps
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (tmp_path / "summary.json").write_text(json.dumps({"steps": n, "restarts": 0, "recoveries": 0}))
    return tmp_path


def codes(run_dir):
    return [f.code for f in diagnose(run_dir)[1]]


def test_a_healthy_run_has_no_findings_and_exits_0(tmp_path, capsys):
    assert doctor_main(str(make_run(tmp_path)), False) == 0
    out = capsys.readouterr().out
    assert "40 steps, finished: no finding(s)" in out


def test_not_a_run_directory_exits_2(tmp_path, capsys):
    assert doctor_main(str(tmp_path), False) == 2
    assert "neither metrics.jsonl nor config.yaml" in capsys.readouterr().out


def test_zero_rewards_with_the_right_answer_boxed_is_a_format_mismatch(tmp_path, capsys):
    run = make_run(tmp_path, change=lambda k, r: r.update(reward_mean=0.0))
    (run / "reward_samples").mkdir()
    line = {
        "group_id": "g1",
        "solutions": ["7"],
        "completions": ["3+4 \\boxed{07}"],
        "boxed": ["07"],
        "scores": [0.0],
        "statuses": ["ok"],
        "details": [""],
        "group_scores": [0.0] * 4,
    }
    (run / "reward_samples" / "reward-0.jsonl").write_text(json.dumps(line) + "\n")
    assert doctor_main(str(run), False) == 1
    out = capsys.readouterr().out
    assert "[reward_all_zero]" in out and "0 in every one of 40 steps (5120 samples" in out
    assert "'3+4 \\\\boxed{07}' -> last \\boxed{}: '07', reference ['7'], score 0 (ok)" in out
    assert "reward.fn=my_pkg.rewards:tagged) does not read the format" in out
    assert "of 1 recorded completions, 1 have a \\boxed{} answer and 1 of those equal the reference" in out


def test_zero_rewards_without_a_boxed_answer_points_at_the_template(tmp_path):
    run = make_run(tmp_path, change=lambda k, r: r.update(reward_mean=0.0))
    (run / "reward_samples").mkdir()
    line = {"solutions": ["7"], "completions": ["seven"], "boxed": [None], "scores": [0.0], "statuses": ["ok"]}
    (run / "reward_samples" / "r.jsonl").write_text(json.dumps(line) + "\n")
    (f,) = diagnose(run)[1]
    assert f.code == "reward_all_zero" and "no recorded completion has a \\boxed{} answer" in f.advice


def test_one_nonzero_step_is_not_all_zero(tmp_path):
    assert codes(make_run(tmp_path, change=lambda k, r: r.update(reward_mean=0.01 if k == 30 else 0.0))) == []


def test_low_entropy(tmp_path):
    (f,) = diagnose(make_run(tmp_path, change=lambda k, r: r.update(entropy=0.004)))[1]
    assert f.code == "entropy_collapse" and "0.0040 nats/token over the second half" in f.title
    assert "gconfig.temperature (now 1.0)" in f.advice


def test_entropy_that_falls_to_a_tenth_in_the_run(tmp_path):
    (f,) = diagnose(make_run(tmp_path, change=lambda k, r: r.update(entropy=0.5 if k < 10 else 0.04)))[1]
    assert f.title == "entropy collapsed during the run: 0.5000 -> 0.0400 nats/token"
    # a fall to 0.06 of 0.5 is a fall to more than a tenth: healthy
    assert codes(make_run(tmp_path, change=lambda k, r: r.update(entropy=0.5 if k < 10 else 0.06))) == []


def test_truncation(tmp_path):
    (f,) = diagnose(make_run(tmp_path, change=lambda k, r: r.update(truncated_frac=0.6, completion_len_p90=12)))[1]
    assert f.code == "truncation" and f.title == "60% of samples truncated (no EOS)"
    assert "max_new_tokens=12" in f.evidence[0] and "p90 12.0" in f.evidence[1]
    assert codes(make_run(tmp_path, change=lambda k, r: r.update(truncated_frac=0.15))) == []


def test_length_runaway(tmp_path):
    def grow(k, r):
        r.update(completion_len_mean=4.0 + k * 0.2, completion_len_p90=min(12.0, 5.0 + k * 0.3))

    (f,) = diagnose(make_run(tmp_path, change=grow))[1]
    # first quarter (steps 0-9) mean 4.9, last (30-39) mean 10.9; p90 of the last quarter 12
    assert f.code == "length_runaway" and "4.9 -> 10.9 tokens" in f.evidence[0]


def test_staleness_at_the_bound(tmp_path):
    (f,) = diagnose(make_run(tmp_path, change=lambda k, r: r.update(staleness_at_bound_frac=0.9)))[1]
    assert f.code == "staleness_at_bound" and "90% of the samples" in f.evidence[0] and "eta = 2" in f.evidence[0]
    assert "trainer idle 5%" in f.evidence[1] and "rollout workers idle 20%" in f.evidence[2]
    assert "a smaller eta" in f.advice


@pytest.mark.parametrize("eta, trainer_idle", [(0, 0.05), (1, 0.05), (2, 0.3)])
def test_staleness_at_the_bound_is_no_finding(tmp_path, eta, trainer_idle):
    """eta 0: every sample is at the bound; eta 1: the least overlap that feeds the trainer; a trainer
    that waits for data needs the headroom."""
    run = make_run(tmp_path, change=lambda k, r: r.update(staleness_at_bound_frac=1.0, trainer_idle_frac=trainer_idle))
    (run / "config.yaml").write_text(CFG.replace("max_head_offpolicyness: 2", f"max_head_offpolicyness: {eta}"))
    assert codes(run) == []


@pytest.mark.parametrize("role", ["trainer", "rollout"])
@pytest.mark.parametrize("cluster", ["{device: cuda}", "{cpu_affinity: {trainer: '0', rollout: '1'}}"])
def test_an_idle_role_on_resources_of_its_own(tmp_path, role, cluster):
    run = make_run(tmp_path, change=lambda k, r: r.update({f"{role}_idle_frac": 0.8}))
    (run / "config.yaml").write_text(CFG.replace("cluster: {heartbeat_s: 2.0}", f"cluster: {cluster}"))
    (f,) = diagnose(run)[1]
    assert f.code == f"{role}_idle" and "80%" in f.title
    assert "rollout.max_head_offpolicyness" in f.advice


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_an_idle_role_on_shared_unpinned_cpus_is_shown_not_found(tmp_path, role):
    run = make_run(tmp_path, change=lambda k, r: r.update({f"{role}_idle_frac": 0.8}))
    assert codes(run) == []
    assert as_json(*diagnose(run))["figures"][f"{role}_idle_frac"] == 0.8


def test_a_growing_log_prob_gap(tmp_path):
    (f,) = diagnose(make_run(tmp_path, change=lambda k, r: r.update(logp_gap_mean=0.01 + 0.005 * k)))[1]
    # first quarter mean 0.01 + 0.005 * 4.5 = 0.0325, last 0.01 + 0.005 * 34.5 = 0.1825
    assert f.code == "mismatch_growing" and "0.0325 -> 0.1825" in f.evidence[0]
    assert "ess" in f.evidence[-1] or "effective sample size" in f.evidence[-1]
    # a gap that doubles but stays below the floor (0.05 nats) is numerics
    assert codes(make_run(tmp_path, change=lambda k, r: r.update(logp_gap_mean=0.01 + 0.0005 * k))) == []


def test_restarts_and_recoveries(tmp_path):
    run = make_run(tmp_path)
    (run / "logs").mkdir()
    (run / "logs" / "rollout-1.log").write_text(
        "x INFO started\nx ERROR engine thread failed\nTraceback: boom\n\n"
        "----- restarted by the supervisor (1/2) -----\nx INFO started\n"
    )
    RunManifest("ipc:///c", "ipc:///t", recoveries=1).save(run)
    found = {f.code: f for f in diagnose(run)[1]}
    assert set(found) == {"restarts", "recoveries"}
    assert (
        "rollout-1 restart 1; its last lines: x INFO started | x ERROR engine thread failed | Traceback: boom"
        == found["restarts"].evidence[0]
    )
    assert "1 in-run recovery" in found["recoveries"].evidence[0]


def test_a_manifest_of_another_version_is_a_note_not_a_crash(tmp_path):
    run = make_run(tmp_path)
    (run / "endpoints.json").write_text(json.dumps({"extra": {"recoveries": 1}}))  # the layout before RunManifest
    data = read_run(run)
    assert data.recoveries == 0
    assert any(n.startswith("endpoints.json: ") and "unknown key(s) extra" in n for n in data.notes), data.notes


def test_a_lost_worker_and_a_silent_one_in_a_live_run(tmp_path):
    run = make_run(tmp_path, finished=False)
    (run / "lost.jsonl").write_text(json.dumps({"worker": "reward-0", "pid": 9, "why": "no heartbeat 30s"}) + "\n")
    status = {
        "workers": {
            "rollout-0": {"silent_s": 20.0, "waiting_for": "weights v3"},
            "trainer": {"silent_s": 0.5, "waiting_for": ""},
        }
    }
    (run / "status.json").write_text(json.dumps(status))
    fs = diagnose(run)[1]
    assert [f.code for f in fs] == ["silent_role", "silent_role"]
    assert "reward-0 went silent" in fs[0].title
    assert fs[1].title.startswith("rollout-0 silent for 2") and "weights v3" in fs[1].evidence[0]


def test_a_stale_status_reports_what_it_recorded(tmp_path):
    """A fleet that ended without summary.json: status.json is as of its last write, not now."""
    run = make_run(tmp_path, finished=False)
    status = {
        "workers": {
            "trainer": {"silent_s": 29.0, "waiting_for": "its own train_step (step 4)"},
            "rollout-0": {"silent_s": 1.0, "waiting_for": "weights"},
        }
    }
    (run / "status.json").write_text(json.dumps(status))
    old = time.time() - 600
    os.utime(run / "status.json", (old, old))
    fs = diagnose(run)[1]
    assert [f.title for f in fs] == ["trainer silent for 29s", "the scheduler stopped reporting before the run ended"]
    assert fs[0].evidence[0].startswith("last heartbeat 29s old when status.json was last written, 60")
    assert "status.json is 60" in fs[1].evidence[0]


def test_zero_rewards_of_truncated_samples_point_at_the_budget(tmp_path):
    run = make_run(tmp_path, change=lambda k, r: r.update(reward_mean=0.0, truncated_frac=0.9))
    f = diagnose(run)[1][0]
    assert f.code == "reward_all_zero" and f.advice.startswith(
        "90% of the samples were cut at gconfig.max_new_tokens=12"
    )


def test_a_hang_capture_shows_the_stopped_trainer_and_the_stacks(tmp_path, capsys):
    run = make_run(tmp_path, finished=False)
    (run / "stacks").mkdir()
    (run / "stacks" / "scheduler.txt").write_text("old dump\n" + "Thread 0x1 (most recent call first):\n  File x\n")
    (run / "stacks" / "trainer.txt").write_text("Current thread 0x2 (most recent call first):\n  File train\n")
    cap = {
        "t": 1.0,
        "why": "no trainer step for 30s: overdue: trainer",
        "workers": {
            "scheduler": {"pid": 10, "state": "S", "offset": 9, "dumped": True},
            "trainer": {"pid": 11, "state": "T", "offset": 0, "dumped": True},
            "reward-0": {"pid": 12, "state": "S", "offset": 0, "dumped": False, "note": "no stack handler registered"},
        },
    }
    (run / "hangs.jsonl").write_text(json.dumps(cap) + "\n")
    assert doctor_main(str(run), False) == 1
    out = capsys.readouterr().out
    assert "[hang] the step watchdog fired" in out and "trainer (pid 11): process state STOPPED" in out
    assert "trainer was stopped by a signal" in out and "resume it with SIGCONT" in out
    assert "    | Thread 0x1 (most recent call first):" in out and "old dump" not in out  # its own capture only
    assert "reward-0 (pid 12): process state S; no stack handler registered" in out


def test_json_output(tmp_path, capsys):
    run = make_run(tmp_path, change=lambda k, r: r.update(truncated_frac=0.5))
    assert doctor_main(str(run), True) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == 40 and doc["state"] == "finished" and doc["skipped"] == []
    assert [f["code"] for f in doc["findings"]] == ["truncation"]
    assert set(doc["findings"][0]) == {"code", "title", "evidence", "advice"}


def test_a_run_without_the_health_columns_says_what_was_skipped(tmp_path):
    run = make_run(tmp_path, change=lambda k, r: [r.pop(c) for c in ("entropy", "truncated_frac")])
    doc = as_json(*diagnose(run))
    assert doc["findings"] == []
    assert "no truncated_frac column in metrics.jsonl: its check was skipped" in doc["skipped"]
    assert "no entropy column in metrics.jsonl: its check was skipped" in doc["skipped"]


def test_the_version_0_gap_of_step_0_is_shown(tmp_path, capsys):
    """Step 0's lag-0 columns are the engine's version-0 log-probs against the trainer's recompute; shown as
    one line (text) and ``version0_gap`` (json). Later steps' lag-0 columns are not version 0."""
    v0 = {"tokens_lag0": 1200.0, "logp_gap_p50_lag0": 2e-6, "logp_gap_p99_lag0": 3e-5, "logp_gap_max_lag0": 6e-5}
    v0["kl_k3_lag0"] = 1e-10

    def change(k, r):
        r.update(v0 if k == 0 else {"tokens_lag0": 50.0, "logp_gap_max_lag0": 0.3})

    run = make_run(tmp_path, change=change)
    assert doctor_main(str(run), False) == 0
    out = capsys.readouterr().out
    assert (
        "  version 0 (torch engine vs the trainer's recompute, step 0's 1200 tokens): "
        "|log p_behav - log p_prox| p50 2e-06, p99 3e-05, max 6e-05; k3 KL 1e-10 nats/token"
    ) in out.splitlines()
    doc = as_json(*diagnose(run))
    assert doc["version0_gap"] == {k.removesuffix("_lag0"): v for k, v in v0.items()} | {"tokens": 1200.0}
    (tmp_path / "old").mkdir()
    assert as_json(*diagnose(make_run(tmp_path / "old")))["version0_gap"] == {}  # no such columns: nothing shown


def test_corrections_masking_a_tenth_of_the_tokens(tmp_path):
    def masked(k, r):
        r.update(masked_frac=0.15, masked_frac_rs=0.05, masked_frac_m2po=0.1, kl_k3=0.02, ratio_p99=4.5)

    (f,) = diagnose(make_run(tmp_path, change=masked))[1]
    assert f.code == "mismatch_masking" and "15%" in f.title
    assert f.evidence[:2] == ["masked_frac 15% of the trained tokens over the second half", "masked_frac_rs 0.05"]
    assert "rollout.max_head_offpolicyness" in f.advice
    figs = as_json(*diagnose(tmp_path))["figures"]
    assert (figs["masked_frac"], figs["kl_k3"], figs["ratio_p99"]) == (0.15, 0.02, 4.5)
    # a few percent masked is what the bounds are for: shown, not found
    assert codes(make_run(tmp_path, change=lambda k, r: r.update(masked_frac=0.03))) == []


def test_a_long_tail_without_over_provisioning(tmp_path):
    def tail(k, r):
        r.update(tail_s=0.5, wasted_tokens=10, trained_tokens=1000)  # step_s 1.0: half the step

    (f,) = diagnose(make_run(tmp_path, change=tail))[1]
    assert f.code == "long_tail" and "50%" in f.title and "rollout.over_provision" in f.advice
    assert as_json(*diagnose(tmp_path))["figures"]["wasted_per_trained"] == 0.01
    (tmp_path / "config.yaml").write_text(CFG.replace("rollout: {", "rollout: {over_provision: 0.25, "))
    assert codes(tmp_path) == []  # already over-provisioned: shown, not found
    assert codes(make_run(tmp_path, change=lambda k, r: r.update(tail_s=0.2))) == []
