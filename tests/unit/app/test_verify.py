"""``areal-async verify``: each fault injected on purpose into a hand-built run directory is caught,
with its message; the clean directory passes. The expected problems are written out by hand
from the three sources below (not computed by the checker's code).

The clean run (eta 1): rollout-0 produced groups g0, g1, g2; the trainer trained g0 at step 0
and g1 at step 1; the books say the same, and g2 aborted as stale.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from areal_async.app.verify import Problem, verify_run
from areal_async.base.records import roll_back_steps
from areal_async.cli import main as cli_main
from areal_async.rollout.engine import PackedSamples
from areal_async.trainer.record import TrainerRecord, sample_versions, step_line
from areal_async.trainer.buffer import TrajectoryBuffer
from areal_async.trainer.types import Trajectory

PRODUCED = [  # (group, ids, vmin, vmax, n_tokens)
    ("g0", ["g0.0", "g0.1"], [0, 0], [0, 0], [3, 2]),
    ("g1", ["g1.0", "g1.1"], [0, 1], [1, 1], [4, 3]),
    ("g2", ["g2.0", "g2.1"], [0, 0], [0, 0], [2, 2]),
]


def step(k: int, ids, vmin, vmax, ntok, skipped=()) -> dict:
    return {
        "kind": "step",
        "step": k,
        "version": k + 1,
        "ids": list(ids),
        "vmin": list(vmin),
        "vmax": list(vmax),
        "n_tokens": list(ntok),
        "n_loss_tokens": sum(n for i, n in zip(ids, ntok) if i not in skipped),
        "version_min": min(vmin),
        "version_max": max(vmax),
        "optimizer_steps": 0 if skipped else 1,
        "skipped_minibatches": 1 if skipped else 0,
        "skipped_ids": list(skipped),
        "applied": not skipped,
    }


def line(sid: str, status: str, k, vmin: int, vmax: int, reason=None) -> dict:
    return {
        "id": sid,
        "group_id": sid.split(".")[0],
        "status": status,
        "train_step": k,
        "version_min": vmin,
        "version_max": vmax,
        "reason": reason,
    }


STALE = "stale: oldest token version 0 < step 2 - eta 1"


def clean() -> dict:
    return {
        "rollout": [
            {"group_id": g, "ids": ids, "vmin": lo, "vmax": hi, "n_tokens": n} for g, ids, lo, hi, n in PRODUCED
        ],
        "trainer": [
            step(0, ["g0.0", "g0.1"], [0, 0], [0, 0], [3, 2]),
            step(1, ["g1.0", "g1.1"], [0, 1], [1, 1], [4, 3]),
        ],
        "books": [
            line("g0.0", "trained", 0, 0, 0),
            line("g0.1", "trained", 0, 0, 0),
            line("g2.0", "aborted", None, 0, 0, STALE),
            line("g2.1", "aborted", None, 0, 0, STALE),
            line("g1.0", "trained", 1, 0, 1),
            line("g1.1", "trained", 1, 1, 1),
        ],
        "metrics": [
            {"step": 0, "version": 1, "samples_trained": 2},
            {"kind": "eval", "step": 1, "version": 1, "pass@1": 0.5},  # the evaluator's row: not a step
            {"step": 1, "version": 2, "samples_trained": 2},
        ],
        "summary": {"steps": 2, "samples_issued": 6, "samples_trained": 4, "samples_lost": 0},
    }


def write(run_dir: Path, src: dict, eta: int = 1) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"rollout:\n  max_head_offpolicyness: {eta}\n")
    (run_dir / "rollout_records").mkdir(exist_ok=True)
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    (run_dir / "rollout_records" / "rollout-0.jsonl").write_text(jsonl(src["rollout"]))
    (run_dir / "trainer_steps.jsonl").write_text(jsonl(src["trainer"]))
    (run_dir / "trajectories.jsonl").write_text(jsonl(src["books"]))
    (run_dir / "metrics.jsonl").write_text(jsonl(src["metrics"]))
    (run_dir / "summary.json").write_text(json.dumps(src["summary"]))
    return run_dir


def check(tmp_path: Path, src: dict) -> list[Problem]:
    return verify_run(write(tmp_path / "run", src)).problems


def test_the_clean_run_passes_with_its_counts(tmp_path):
    rep = verify_run(write(tmp_path / "run", clean()))
    assert rep.ok and rep.problems == []
    assert {k: rep.counts[k] for k in ("steps", "trained", "booked_trained", "booked_aborted", "produced")} == {
        "steps": 2,
        "trained": 4,
        "booked_trained": 4,
        "booked_aborted": 2,
        "produced": 6,
    }
    assert rep.counts["eta"] == 1 and rep.counts["rolled_back"] == 0 and rep.trained_per_step == {0: 2, 1: 2}


def test_a_sample_the_trainer_dropped_is_booked_but_not_trained(tmp_path):
    src = clean()
    src["trainer"][1] = step(1, ["g1.0"], [0], [1], [4])
    assert check(tmp_path, src) == [
        Problem("step_count", "step 1: metrics.jsonl books 2 samples trained; the trainer's record trained 1"),
        Problem("booked_not_trained", "sample 'g1.1' booked trained at step 1; the trainer never trained it"),
    ]


def test_a_sample_the_books_dropped_is_lost(tmp_path):
    src = clean()
    del src["books"][2]  # g2.0's aborted line: the scheduler's own count (summary) still says 0 lost
    assert check(tmp_path, src) == [
        Problem("lost", "sample 'g2.0' produced by rollout-0; trajectories.jsonl has no line for it")
    ]


def test_the_summary_lost_count_is_reported(tmp_path):
    src = clean()
    src["summary"]["samples_lost"] = 3
    assert check(tmp_path, src) == [Problem("lost", "summary.json: samples_lost = 3 (issued minus lines written)")]


def test_a_group_booked_but_never_trained(tmp_path):
    src = clean()
    src["rollout"].append(
        {"group_id": "g3", "ids": ["g3.0", "g3.1"], "vmin": [1, 1], "vmax": [1, 1], "n_tokens": [2, 2]}
    )
    src["books"] += [line("g3.0", "trained", 1, 1, 1), line("g3.1", "trained", 1, 1, 1)]
    src["metrics"][2]["samples_trained"] = 4
    assert check(tmp_path, src) == [
        Problem("step_count", "step 1: metrics.jsonl books 4 samples trained; the trainer's record trained 2"),
        Problem("booked_not_trained", "sample 'g3.0' booked trained at step 1; the trainer never trained it"),
        Problem("booked_not_trained", "sample 'g3.1' booked trained at step 1; the trainer never trained it"),
    ]


def test_a_skipped_optimizer_step_booked_as_trained(tmp_path):
    src = clean()
    src["trainer"][1] = step(1, ["g1.0", "g1.1"], [0, 1], [1, 1], [4, 3], skipped=["g1.0", "g1.1"])
    assert check(tmp_path, src) == [
        Problem("step_count", "step 1: metrics.jsonl books 2 samples trained; the trainer's record trained 0"),
        Problem("skipped_booked", "sample 'g1.0' booked trained at step 1, whose optimizer step skipped it"),
        Problem("skipped_booked", "sample 'g1.1' booked trained at step 1, whose optimizer step skipped it"),
    ]
    # booked as the scheduler now books them (aborted, not trained): the sources agree
    why = "optimizer_step_skipped: step 1's optimizer step was not applied to this sample's minibatch"
    src["books"][4:6] = [line("g1.0", "aborted", None, 0, 1, why), line("g1.1", "aborted", None, 1, 1, why)]
    src["metrics"][2]["samples_trained"] = 0
    rep = verify_run(write(tmp_path / "run2", src))
    assert rep.ok and rep.counts["skipped_steps"] == 1 and rep.counts["trained"] == 2
    assert rep.trained_per_step == {0: 2, 1: 0}


def stale_run() -> dict:
    src = clean()
    src["rollout"].append(
        {"group_id": "g4", "ids": ["g4.0", "g4.1"], "vmin": [0, 1], "vmax": [2, 2], "n_tokens": [5, 5]}
    )
    src["trainer"].append(step(2, ["g4.0", "g4.1"], [0, 1], [2, 2], [5, 5]))
    src["books"] += [line("g4.0", "trained", 2, 0, 2), line("g4.1", "trained", 2, 1, 2)]
    src["metrics"].append({"step": 2, "version": 3, "samples_trained": 2})
    return src


def test_a_stale_tensor_is_caught_from_the_trainers_versions(tmp_path):
    msg = (
        "sample 'g4.0' trained at step 2 with a token of version 0 < step - eta = 1 "
        "(eta 1, from the tensors the trainer used)"
    )
    assert check(tmp_path, stale_run()) == [Problem("stale", msg)]
    # eta 2 (the run's config): version 0 is fresh enough at step 2
    assert verify_run(write(tmp_path / "run2", stale_run(), eta=2)).ok


def test_books_that_claim_fresh_versions_for_stale_tensors_disagree_twice(tmp_path):
    src = stale_run()
    src["books"][-2] = line("g4.0", "trained", 2, 1, 2)  # the scheduler's word: fresh
    kinds = [p.kind for p in check(tmp_path, src)]
    assert kinds == ["stale", "version_mismatch"]


def test_other_tensors_trained_under_a_planned_id(tmp_path):
    src = clean()
    src["trainer"][1] = step(1, ["g1.0", "g1.1"], [0, 0], [1, 0], [4, 3])  # g1.1's tensors: [0, 0]
    assert check(tmp_path, src) == [
        Problem(
            "version_mismatch", "sample 'g1.1' trained at step 1 with versions [0, 0]; produced [1, 1] by rollout-0"
        ),
        Problem("version_mismatch", "sample 'g1.1' trained at step 1 with versions [0, 0]; the books say [1, 1]"),
    ]


def test_a_sample_trained_twice(tmp_path):
    src = clean()
    src["trainer"][1] = step(1, ["g1.0", "g1.1", "g0.0"], [0, 1, 0], [1, 1, 0], [4, 3, 3])
    assert check(tmp_path, src) == [
        Problem("trained_twice", "sample 'g0.0' trained in steps 0, 1"),
        Problem("step_count", "step 1: metrics.jsonl books 2 samples trained; the trainer's record trained 3"),
        Problem("trained_not_booked", "sample 'g0.0' trained at step 1; the books say trained at step 0"),
    ]


def test_a_trained_line_removed_from_trajectories_jsonl(tmp_path):
    src = clean()
    del src["books"][4]  # g1.0
    assert check(tmp_path, src) == [
        Problem("trained_not_booked", "sample 'g1.0' trained at step 1; trajectories.jsonl has no line for it"),
        Problem("lost", "sample 'g1.0' produced by rollout-0; trajectories.jsonl has no line for it"),
    ]


def test_an_id_changed_in_trajectories_jsonl(tmp_path):
    src = clean()
    src["books"][1]["id"] = "g0.7"
    assert check(tmp_path, src) == [
        Problem("booked_not_trained", "sample 'g0.7' booked trained at step 0; the trainer never trained it"),
        Problem("trained_not_booked", "sample 'g0.1' trained at step 0; trajectories.jsonl has no line for it"),
        Problem("lost", "sample 'g0.1' produced by rollout-0; trajectories.jsonl has no line for it"),
    ]


def test_a_trained_line_turned_aborted_and_a_repeated_line(tmp_path):
    src = clean()
    src["books"][0] = line("g0.0", "aborted", None, 0, 0, "edited")
    src["books"].append(copy.deepcopy(src["books"][1]))
    assert check(tmp_path, src) == [
        Problem("booked_twice", "sample 'g0.1' has more than one line in trajectories.jsonl"),
        Problem("trained_not_booked", "sample 'g0.0' trained at step 0; the books say aborted (edited)"),
    ]


def test_a_sample_trained_that_no_rollout_produced(tmp_path):
    src = clean()
    src["rollout"][0]["ids"] = ["g0.0", "x"]
    assert check(tmp_path, src) == [
        Problem("not_produced", "sample 'g0.1' trained at step 0; no rollout record holds it"),
        Problem("lost", "sample 'x' produced by rollout-0; trajectories.jsonl has no line for it"),
    ]


def test_per_step_counts_in_metrics_jsonl_that_disagree_with_the_trainer(tmp_path):
    src = clean()
    src["metrics"][0]["samples_trained"] = 3
    del src["metrics"][2]
    src["metrics"].append({"step": 5, "samples_trained": 0})
    assert check(tmp_path, src) == [
        Problem("step_count", "step 0: metrics.jsonl books 3 samples trained; the trainer's record trained 2"),
        Problem("step_count", "step 1: metrics.jsonl has no row; the trainer's record trained 2"),
        Problem("step_count", "step 5: metrics.jsonl books 0 samples trained; the trainer's record has no step 5"),
    ]


def test_samples_of_an_epoch_a_resume_rolled_back_are_not_lost(tmp_path):
    src = clean()
    src["rollout"].append(
        {"group_id": "g5", "ids": ["g5.0", "g5.1"], "vmin": [1, 1], "vmax": [1, 1], "n_tokens": [2, 2]}
    )
    lost = check(tmp_path, src)
    assert [p.kind for p in lost] == ["lost", "lost"]  # no resume: they are lost
    src["rollout"].append({"group_id": "r1-g0", "ids": ["r1-g0.0"], "vmin": [1], "vmax": [1], "n_tokens": [2]})
    src["books"].append(line("r1-g0.0", "aborted", None, 1, 1, "run_end"))
    rep = verify_run(write(tmp_path / "run2", src))
    assert rep.ok and rep.counts["rolled_back"] == 2 and rep.counts["resumes"] == 1


def test_a_step_recorded_twice_and_a_wrong_version(tmp_path):
    src = clean()
    src["trainer"][1]["version"] = 7
    src["trainer"].append(step(1, ["g1.0"], [0], [1], [4]))
    assert check(tmp_path, src) == [
        Problem("step_record", "trainer_steps.jsonl holds step 1 2 times; expected once"),
        Problem("step_record", "step 1 produced version 7; expected 2"),
        Problem("trained_twice", "sample 'g1.0' trained in steps 1, 1"),
        Problem("step_count", "step 1: metrics.jsonl books 2 samples trained; the trainer's record trained 3"),
    ]


def test_missing_sources_are_named(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert verify_run(run_dir).problems == [
        Problem(
            "source",
            f"{run_dir} has no trajectories.jsonl (the scheduler's books per sample (written with "
            "rollout.dump_to_file=true))",
        ),
        Problem("source", f"{run_dir} has no metrics.jsonl (the scheduler's books per step)"),
        Problem("source", f"{run_dir} has no trainer_steps.jsonl (the trainer's record)"),
        Problem("source", f"{run_dir} has no rollout_records/*.jsonl (the rollout workers' records)"),
    ]
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        verify_run(tmp_path / "nope")


def test_a_torn_last_line_is_skipped_and_a_bad_middle_line_is_named(tmp_path):
    run_dir = write(tmp_path / "run", clean())
    with open(run_dir / "trainer_steps.jsonl", "a") as f:
        f.write('{"kind": "step", "st')  # a writer killed mid-line
    assert verify_run(run_dir).ok
    text = (run_dir / "trajectories.jsonl").read_text().splitlines()
    (run_dir / "trajectories.jsonl").write_text("\n".join(text[:2] + ["{oops"] + text[2:]) + "\n")
    assert verify_run(run_dir).problems == [
        Problem(
            "source",
            f"{run_dir / 'trajectories.jsonl'}:3: not JSON (Expecting property name enclosed in double quotes)",
        )
    ]


def test_the_cli_exits_0_when_the_sources_agree_and_1_naming_each_disagreement(tmp_path, capsys):
    ok_dir = write(tmp_path / "ok", clean())
    assert cli_main(["verify", str(ok_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"areal-async verify: {ok_dir}: the three sources agree: 2 trainer steps, 4 samples trained")
    src = clean()
    del src["books"][4]
    bad_dir = write(tmp_path / "bad", src)
    assert cli_main(["verify", str(bad_dir)]) == 1
    cap = capsys.readouterr()
    assert cap.out.splitlines() == [
        "trained_not_booked: sample 'g1.0' trained at step 1; trajectories.jsonl has no line for it",
        "lost: sample 'g1.0' produced by rollout-0; trajectories.jsonl has no line for it",
    ]
    assert "2 disagreement(s)" in cap.err
    assert cli_main(["verify", str(tmp_path / "nope")]) == 2


# ---- the trainer's side: its buffer and its record ------------------------------------------


class ListChannel:
    """A tensor channel that hands out the messages put in it (recv raises TimeoutError when empty)."""

    def __init__(self):
        self.queue: list = []
        self.lock = threading.Lock()

    def put(self, key, meta, tensors):
        with self.lock:
            self.queue.append((key, meta, tensors))

    def recv(self, timeout_s: float):
        with self.lock:
            if self.queue:
                return self.queue.pop(0)
        time.sleep(0.01)
        raise TimeoutError

    def close(self):
        pass


def group(gid: str, sids: list[str], version: int) -> tuple[str, dict, dict]:
    """One group's message as the channel hands it out: (key, meta, tensors)."""
    n = len(sids)
    packed = PackedSamples(
        output_ids=torch.arange(2 * n),
        logprobs=torch.zeros(2 * n),
        versions=torch.full((2 * n,), version),
        lengths=[2] * n,
        finish_reasons=["stop"] * n,
    )
    key, tensors, meta = packed.to_batch(gid, sids, [1, 2]).encode()
    return key, meta, tensors


def drain(buf: TrajectoryBuffer, ch: ListChannel) -> None:
    deadline = time.monotonic() + 5
    while ch.queue:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)  # the last message is handled after it leaves the queue


def dup(sid: str, key: str, where: str) -> str:
    return (
        f"sample id {sid!r} arrived again at the trainer buffer (message {key!r}; its first copy is {where}): "
        "the new copy is refused, the first kept; expected every id once"
    )


def test_an_id_arriving_twice_at_the_buffer_is_refused_recorded_and_caught(tmp_path, caplog):
    taken = "already taken by a step"
    ch, run_dir = ListChannel(), write(tmp_path / "run", clean())
    record = TrainerRecord(run_dir, start_step=2)
    buf = TrajectoryBuffer(ch, on_duplicate=record.duplicate)
    buf.thread.start()
    try:
        ch.put(*group("g7", ["a", "b"], 3))
        ch.put(*group("g8", ["b", "c", "c"], 9))
        drain(buf, ch)
        got = buf.take(["a", "b", "c"], timeout_s=1)
        ch.put(*group("g9", ["a"], 5))
        drain(buf, ch)
    finally:
        buf.stopping.set()
        buf.thread.join(5)
        record.close()
    assert got["b"].versions.tolist() == [3, 3]  # the first copy kept, not overwritten
    assert got["c"].versions.tolist() == [9, 9] and got["c"].output_ids.tolist() == [2, 3]
    assert buf.duplicates == 3 and buf.items == {}
    msgs = [dup("c", "g8", "in the same message"), dup("b", "g8", "waiting in the buffer"), dup("a", "g9", taken)]
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == msgs
    assert verify_run(run_dir).problems == [Problem("duplicate_at_buffer", m) for m in msgs]


def traj(sid: str, versions: list[int], mask=None) -> Trajectory:
    n = len(versions)
    return Trajectory(sid, "g", [1], list(range(n)), [0.0] * n, versions, 1.0, loss_mask=mask)


def test_the_step_line_reads_versions_and_loss_tokens_from_the_tensors():
    trajs = [traj("a", [3, 1, 2]), traj("b", [4]), traj("c", [5, 5])]
    assert sample_versions(trajs) == ([1, 4, 5], [3, 4, 5], [3, 1, 2])
    wire = traj("d", [8, 6, 7])  # as received: int32 views of the message (the others are int64)
    wire.versions = wire.versions.to(torch.int32)
    assert sample_versions([*trajs, wire]) == ([1, 4, 5, 6], [3, 4, 5, 8], [3, 1, 2, 3])
    line = step_line(4, 5, trajs, skipped=[1], steps=(1, 1))
    assert line == {
        "kind": "step",
        "step": 4,
        "version": 5,
        "ids": ["a", "b", "c"],
        "vmin": [1, 4, 5],
        "vmax": [3, 4, 5],
        "n_tokens": [3, 1, 2],
        "n_loss_tokens": 5,
        "version_min": 1,
        "version_max": 5,
        "optimizer_steps": 1,
        "skipped_minibatches": 1,
        "skipped_ids": ["b"],
        "applied": False,
    }
    # a workflow's environment tokens (mask 0, version -1) are not trained: not counted
    masked = [traj("a", [-1, 2, 3, -1], mask=[0, 1, 1, 0]), traj("b", [7, 6])]
    assert sample_versions(masked) == ([2, 6], [3, 7], [2, 2])


def test_a_resumed_trainer_rolls_its_record_back_to_its_checkpoint(tmp_path):
    path = tmp_path / "trainer_steps.jsonl"
    rows = [{"kind": "step", "step": k} for k in range(4)] + [{"kind": "duplicate", "id": "x", "message": "m"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "st')
    assert roll_back_steps(tmp_path, 2) == 3  # steps 2, 3 and the torn line
    assert [json.loads(x) for x in path.read_text().splitlines()] == [rows[0], rows[1], rows[4]]
    rolled = (tmp_path / "trainer_steps.rolled_back.jsonl").read_text().splitlines()
    assert rolled == [json.dumps(rows[2]), json.dumps(rows[3]), '{"kind": "st']
    assert roll_back_steps(tmp_path, 2) == 0 and roll_back_steps(tmp_path / "none", 0) == 0
