"""The pure parts of benchmarks/async_speedup.py on synthetic metrics rows (no fleet is started)."""

import json

import pytest

from tests.support.bench_fixtures import make_rows

from benchmarks import async_speedup as bench
from benchmarks.common.metrics import time_to_threshold


def test_time_to_threshold_never_reached_is_none():
    rows = make_rows(20, step_s=1.0, train_s=0.5, rewards=[0.79] * 20)
    assert time_to_threshold(rows, 0.8, 10) == (None, None)
    assert bench.summarize_run(0, rows, skip=2)["time_to_0.8"] is None


def _runs():
    sync = make_rows(40, step_s=1.0, train_s=0.6, rewards=[0.9] * 40)  # t_gen 0.4, limit 1/0.6
    fast = make_rows(40, step_s=0.65, train_s=0.6, rewards=[0.87] * 40, staleness=2)
    slow = make_rows(40, step_s=0.9, train_s=0.6, rewards=[0.80] * 40, staleness=1)
    return [bench.summarize_run(0, sync), bench.summarize_run(2, fast), bench.summarize_run(1, slow)]


def test_compare_speedup_and_fraction_of_limit():
    runs = _runs()
    cmp = bench.compare(runs)
    assert cmp["limit"] == pytest.approx(1 / 0.6)
    by_eta = {r["eta"]: r for r in runs}
    assert by_eta[0]["speedup"] == pytest.approx(1.0)
    assert by_eta[2]["speedup"] == pytest.approx(1 / 0.65)
    assert by_eta[2]["fraction_of_limit"] == pytest.approx(0.6 / 0.65)
    assert by_eta[2]["reward_drop"] == pytest.approx(0.03)
    assert bench.target_met(by_eta[2])  # 92 % of the limit, reward 0.03 below
    assert not bench.target_met(by_eta[1])  # 67 % of the limit and 0.10 below


def test_the_training_run_ahead_at_eta0_shrinks_the_limit():
    """The η = 0 run hid 0.1 s of each step's 0.7 s training behind its 0.4 s wait: its step is 1.0 s,
    so perfect overlap (a step of max(0.4, 0.7) = 0.7 s) is 1 / 0.7 faster, not 1.1 / 0.7."""
    runs = _runs()
    for r in runs:
        r["phases"] = dict(r["phases"], t_train=0.7, t_ahead=0.1)
    cmp = bench.compare(runs)
    assert cmp["limit"] == pytest.approx(1 / 0.7) and cmp["t_ahead"] == pytest.approx(0.1)
    assert {r["eta"]: r for r in runs}[2]["fraction_of_limit"] == pytest.approx(0.7 / 0.65)


def test_compare_requires_the_sync_baseline():
    with pytest.raises(ValueError, match="η = 0"):
        bench.compare(_runs()[1:])


def test_rows_schema():
    runs = _runs()
    for r, load in zip(runs, (0.1, 0.2, 0.3)):
        r.update(loadavg_before=load, foreign_cpu_frac=0.01, run_dir=f"/tmp/eta{r['eta']}", run_wall_s=60.0)
    rows = bench.to_rows(runs, bench.compare(runs), {"n_rollout_workers": 1, "seed": 1})
    json.dumps(rows)  # plain JSON, no NaN objects or tuples that change on a round trip
    assert [r["eta"] for r in rows] == [0, 2, 1]
    need = {
        "metric",
        "value",
        "unit",
        "eta",
        "samples_per_s",
        "limit",
        "fraction_of_limit",
        "final_reward",
        "t_gen",
        "t_train",
        "t_ahead",
        "time_to_0.8",
        "staleness_max",
        "loadavg_before",
        "foreign_cpu_frac",
        "bound",
        "n_rollout_workers",
        "seed",
    }
    for r in rows:
        assert need <= set(r)
        assert r["metric"] == "trained_samples_per_s" and r["unit"] == "samples/s"
        assert r["value"] == r["samples_per_s"]
        assert r["limit"] == pytest.approx(1 / 0.6)
        assert r["t_gen"] == pytest.approx(0.4) and r["t_train"] == pytest.approx(0.6)
    assert rows[0]["meets_target"] is None and rows[1]["meets_target"] is True
    assert rows[1]["staleness_max"] == 2 and rows[1]["final_reward"] == pytest.approx(0.87)


def test_cli_refuses_eta_override_and_too_few_steps():
    with pytest.raises(SystemExit):
        bench.main(["--steps", "5"])
    with pytest.raises(SystemExit):
        bench.main(["rollout.max_head_offpolicyness=3"])


def test_compare_reports_the_cpu_limit_when_the_baseline_was_sampled():
    runs = _runs()
    runs[0]["cpu_s_per_step"] = {"trainer": 0.7, "rollout-0": 0.5}
    cmp = bench.compare(runs, n_cores=2)
    assert cmp["limit_cpu"] == pytest.approx(1.0 / 0.6)  # 1.2 / 2 = 0.6 = t_train: no tighter
    runs[0]["cpu_s_per_step"] = {"trainer": 0.7, "rollout-0": 0.9}
    cmp = bench.compare(runs, n_cores=2)
    assert cmp["limit_cpu"] == pytest.approx(1.0 / 0.8)
    assert runs[1]["fraction_of_cpu_limit"] == pytest.approx((1 / 0.65) / 1.25)
    assert bench.compare(_runs())["limit_cpu"] is None  # not sampled: not claimed


def test_cli_refuses_existing_run_dirs(tmp_path):
    (tmp_path / "eta0").mkdir()
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--etas", "0"])
    assert not (tmp_path / "eta0.log").exists()  # nothing was started


def test_cli_takes_overrides_after_etas(tmp_path, capsys):
    (tmp_path / "eta0").mkdir()  # stops right after the arguments were understood and validated
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--etas", "0", "2", "seed=2"])
    assert "already exist" in capsys.readouterr().err  # not "invalid int value: 'seed=2'"
    with pytest.raises(SystemExit) as e:  # a bad key is refused before anything starts
        bench.main(["--out", str(tmp_path / "new"), "--etas", "0", "no.such_key=1"])
    assert "config error" in str(e.value) and "'no'" in str(e.value)
    assert not (tmp_path / "new").exists()


def test_median_throughput_ignores_a_burst():
    rows = make_rows(30, step_s=0.5, train_s=0.3, batch=128)
    for r in rows[10:13]:  # a neighbour's burst: three slow steps
        r["step_s"] = 2.0
    for i in range(10, 30):
        rows[i]["wall_s"] += 1.5 * min(3, i - 9)
    run = bench.summarize_run(2, rows, skip=5)
    assert run["samples_per_s_median"] == pytest.approx(128 / 0.5)
    assert run["samples_per_s"] < 0.8 * run["samples_per_s_median"]  # the mean-based headline pays for it


def test_speedup_vs_best_sync_divides_by_the_fastest_synchronous_run():
    """The fixed fleet's η = 0 run trains 128 samples a 1.0 s step; a 2-rollout η = 0 run one a 0.8 s
    step (160 samples/s), the fastest sync run: η = 2 (0.65 s steps, 196.9 samples/s) is 1 / 0.65 =
    1.54x the fixed fleet's but 0.8 / 0.65 = 1.23x the best sync. The limit stays the fixed fleet's."""
    runs = _runs()
    faster = bench.summarize_run(0, make_rows(40, step_s=0.8, train_s=0.6, rewards=[0.88] * 40))
    slower = bench.summarize_run(0, make_rows(40, step_s=1.25, train_s=0.6, rewards=[0.9] * 40))
    sync = [faster | {"sync_config": "2rollout_own"}, slower | {"sync_config": "1rollout_none"}]
    cmp = bench.compare(runs, sync=sync)
    by_eta = {r["eta"]: r for r in runs}
    assert cmp["best_sync_config"] == "2rollout_own" and cmp["best_sync_samples_per_s"] == pytest.approx(160.0)
    assert by_eta[2]["speedup"] == pytest.approx(1 / 0.65)
    assert by_eta[2]["speedup_vs_best_sync"] == pytest.approx(0.8 / 0.65)
    assert by_eta[0]["speedup_vs_best_sync"] == pytest.approx(0.8)  # the fixed fleet's own η = 0 run
    assert cmp["limit"] == pytest.approx(1 / 0.6)
    rows = bench.to_rows(runs, cmp, {"n_rollout_workers": 1, "seed": 1}, sync)
    json.dumps(rows)
    sync_rows = [r for r in rows if r["metric"] == "sync_trained_samples_per_s"]
    assert [r["sync_config"] for r in sync_rows] == ["2rollout_own", "1rollout_none"]
    assert sync_rows[1]["value"] == pytest.approx(128 / 1.25)
    assert all(r["best_sync_config"] == "2rollout_own" for r in rows if r["metric"] == "trained_samples_per_s")


def test_a_fixed_fleet_faster_than_every_sync_configuration_stays_the_baseline():
    runs = _runs()
    slower = bench.summarize_run(0, make_rows(40, step_s=2.0, train_s=0.6))
    cmp = bench.compare(runs, sync=[slower | {"sync_config": "1rollout_none"}])
    assert cmp["best_sync_config"] == "fixed"
    assert {r["eta"]: r for r in runs}[2]["speedup_vs_best_sync"] == pytest.approx(1 / 0.65)


def test_sync_configurations_place_and_size_the_fleet_as_named(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1})
    args = bench.configure(["--out", str(tmp_path), "--sync-sweep", "--steps", "40", "seed=2"])
    assert set(args.sync_runs) == set(bench.SYNC_CONFIGS) - {"fixed"}
    both = args.sync_runs["2rollout_own"]
    assert "cluster.n_rollout_workers=2" in both and "cluster.cpu_affinity.trainer=0" in both
    assert "cluster.cpu_affinity.rollout=1" in both and both[-1] == "seed=2"
    trainer = args.sync_runs["2rollout_trainer"]
    assert "cluster.cpu_affinity.trainer=0" in trainer and not any("affinity.rollout" in o for o in trainer)
    assert not any("affinity" in o for o in args.sync_runs["1rollout_none"])
    assert "actor.forward_ahead=false" in args.sync_runs["1rollout_own_no_ahead"]
    assert bench.configure(["--out", str(tmp_path / "b")]).sync_runs.keys() == {bench.BEST_SYNC}
