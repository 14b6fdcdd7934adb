"""``areal-async verify``: each fault injected on purpose into a hand-built run directory is caught,
with its message; the clean directory passes. The expected problems are written out by hand
from the sources below (not computed by the checker's code).

The clean run (eta 1): rollout-0 loaded versions 0 and 1 and produced groups g0, g1, g2 (prompts of 2
tokens); reward-0 scored them (SCORES); the trainer trained g0 at step 0 and g1 at step 1; the books
say the same, and g2 aborted as stale. resumes.json: one start, books new.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from areal_async.app.commands.verify import Problem, verify_run
from areal_async.base.records import roll_back_steps, token_digest
from areal_async.cli import main as cli_main
from protocols.trajectories import TrajectoryBatch
from areal_async.trainer.persist.record import TrainerRecord, sample_versions, step_line
from areal_async.trainer.buffer import TrajectoryBuffer
from protocols.trajectories import Trajectory

PRODUCED = [  # (group, ids, vmin, vmax, n_tokens)
    ("g0", ["g0.0", "g0.1"], [0, 0], [0, 0], [3, 2]),
    ("g1", ["g1.0", "g1.1"], [0, 1], [1, 1], [4, 3]),
    ("g2", ["g2.0", "g2.1"], [0, 0], [0, 0], [2, 2]),
]
SCORES = {"g0.0": 1.0, "g0.1": 0.0, "g1.0": 0.0, "g1.1": 1.0, "g2.0": 1.0, "g2.1": 1.0}
SCORES |= {"g3.0": 0.0, "g3.1": 0.0, "g4.0": 0.0, "g4.1": 1.0}  # groups some tests add
PROMPT = 2  # tokens of every prompt


def step(k: int, ids, vmin, vmax, ntok, skipped=()) -> dict:
    return {
        "kind": "step",
        "step": k,
        "version": k + 1,
        "ids": list(ids),
        "vmin": list(vmin),
        "vmax": list(vmax),
        "n_tokens": list(ntok),
        "n_out": list(ntok),
        "n_prompt": [PROMPT] * len(ids),
        "scores": [SCORES.get(i, 0.0) for i in ids],
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
        "reward": SCORES.get(sid),
        "reason": reason,
    }


def made(gid: str, ids, vmin, vmax, ntok) -> dict:
    """A rollout record's group line."""
    return {"kind": "group", "group_id": gid, "ids": ids, "vmin": vmin, "vmax": vmax, "n_tokens": ntok, "n_prompt": 2}


def scored(gid: str, ids) -> dict:
    """A reward record's line: the group's SCORES."""
    return {"group_id": gid, "ids": ids, "scores": [SCORES[i] for i in ids], "statuses": ["ok"] * len(ids)}


STALE = "stale: oldest token version 0 < step 2 - eta 1"
NO_LINE = "trajectories.jsonl has no line for it, and no start in resumes.json rolled it back"
FIRST_START = {"attempt": 0, "books": "new", "checkpoint": None}


def clean() -> dict:
    g0, g1, g2 = (made(*x) for x in PRODUCED)
    return {
        "rollout": [{"kind": "start", "pid": 1}, {"kind": "loaded", "version": 0}, g0]
        + [{"kind": "loaded", "version": 1}, g1, g2],
        "rewards": [scored(g, ids) for g, ids, *_ in PRODUCED],
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
        "resumes": {"resumes": 0, "starts": [FIRST_START]},
    }


def write(run_dir: Path, src: dict, eta: int = 1) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"rollout:\n  max_head_offpolicyness: {eta}\n")
    (run_dir / "rollout_records").mkdir(exist_ok=True)
    (run_dir / "reward_records").mkdir(exist_ok=True)
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    (run_dir / "rollout_records" / "rollout-0.jsonl").write_text(jsonl(src["rollout"]))
    (run_dir / "reward_records" / "reward-0.jsonl").write_text(jsonl(src["rewards"]))
    (run_dir / "trainer_steps.jsonl").write_text(jsonl(src["trainer"]))
    (run_dir / "trajectories.jsonl").write_text(jsonl(src["books"]))
    (run_dir / "metrics.jsonl").write_text(jsonl(src["metrics"]))
    (run_dir / "summary.json").write_text(json.dumps(src["summary"]))
    (run_dir / "resumes.json").write_text(json.dumps(src["resumes"]))
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
    assert check(tmp_path, src) == [Problem("lost", f"sample 'g2.0' produced by rollout-0; {NO_LINE}")]


def test_the_summary_lost_count_is_reported(tmp_path):
    src = clean()
    src["summary"]["samples_lost"] = 3
    assert check(tmp_path, src) == [Problem("lost", "summary.json: samples_lost = 3 (issued minus lines written)")]


def test_a_group_booked_but_never_trained(tmp_path):
    src = clean()
    src["rollout"].append(made("g3", ["g3.0", "g3.1"], [1, 1], [1, 1], [2, 2]))
    src["rewards"].append(scored("g3", ["g3.0", "g3.1"]))
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
    src["rollout"] += [{"kind": "loaded", "version": 2}, made("g4", ["g4.0", "g4.1"], [0, 1], [2, 2], [5, 5])]
    src["rewards"].append(scored("g4", ["g4.0", "g4.1"]))
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
        Problem("lost", f"sample 'g1.0' produced by rollout-0; {NO_LINE}"),
    ]


def test_an_id_changed_in_trajectories_jsonl(tmp_path):
    src = clean()
    src["books"][1]["id"] = "g0.7"
    assert check(tmp_path, src) == [
        Problem("booked_not_trained", "sample 'g0.7' booked trained at step 0; the trainer never trained it"),
        Problem("trained_not_booked", "sample 'g0.1' trained at step 0; trajectories.jsonl has no line for it"),
        Problem("not_scored", "sample 'g0.7': the books say reward 0.0; no reward record holds it"),
        Problem("lost", f"sample 'g0.1' produced by rollout-0; {NO_LINE}"),
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
    src["rollout"][2]["ids"] = ["g0.0", "x"]
    assert check(tmp_path, src) == [
        Problem("not_produced", "sample 'g0.1' trained at step 0; no rollout record holds it"),
        Problem("lost", f"sample 'x' produced by rollout-0; {NO_LINE}"),
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


def cut_to(attempt: int, prefix: str, groups: int) -> dict:
    """A start of resumes.json that cut the books to a checkpoint of ``prefix`` that had issued ``groups``."""
    ckpt = {"checkpoint": "ckpt/step_1", "id_prefix": prefix, "groups_issued": groups, "next_step": 2}
    return {"attempt": attempt, "books": "cut", **ckpt, "in_flight": ["g4"]}


def test_a_sample_in_no_book_is_rolled_back_only_where_resumes_json_says_its_checkpoint_preceded_it(tmp_path):
    """g5 (group 5 of the first epoch) and r1-g7 (of the second) were produced and are in no book."""
    src = clean()
    src["rollout"] += [made("g5", ["g5.0", "g5.1"], [1, 1], [1, 1], [2, 2]), made("r1-g7", ["r1-g7.0"], [1], [1], [2])]
    lost = [f"sample '{i}' produced by rollout-0; {NO_LINE}" for i in ("g5.0", "g5.1", "r1-g7.0")]
    assert check(tmp_path, src) == [Problem("lost", m) for m in lost]  # one start: nothing rolled back
    src["resumes"]["starts"] += [{"attempt": 1, "books": "kept", "checkpoint": None}]  # a rerun that kept its books
    assert [p.kind for p in verify_run(write(tmp_path / "kept", src)).problems] == ["lost"] * 3
    # start 1 cut back to a checkpoint of the first epoch that had issued 6 groups: g5 was issued before it
    src["resumes"]["starts"][1] = cut_to(1, "", 6)
    assert [p.message for p in verify_run(write(tmp_path / "six", src)).problems] == lost
    # ... that had issued 5: g5 was issued after it; r1-g7 is of start 1's own epoch
    src["resumes"]["starts"][1] = cut_to(1, "", 5)
    rep = verify_run(write(tmp_path / "five", src))
    assert rep.problems == [Problem("lost", lost[2])] and rep.counts["rolled_back"] == 2
    # start 2 cut back to a checkpoint of the first epoch (prefix ''): every id of epoch 1 goes with it
    src["resumes"]["starts"].append(cut_to(2, "", 3))
    rep = verify_run(write(tmp_path / "two", src))
    assert rep.ok and rep.counts["rolled_back"] == 3 and rep.counts["resumes"] == 2
    assert rep.rollback_lines() == [
        (
            "start 1: books cut back to ckpt/step_1 (next step 2): ids of prefix (none) from group 5 on, and of every "
            "earlier prefix; 2 produced sample(s) in no book excused"
        ),
        (
            "start 2: books cut back to ckpt/step_1 (next step 2): ids of prefix (none) from group 3 on, and of every "
            "earlier prefix; 1 produced sample(s) in no book excused"
        ),
    ]
    # start 2 cut back to a checkpoint of its predecessor's epoch that had issued 8 groups: r1-g7 preceded it
    src["resumes"]["starts"][2] = cut_to(2, "r1-", 8)
    assert verify_run(write(tmp_path / "r1", src)).problems == [Problem("lost", lost[2])]
    # ... to nothing (no checkpoint): every earlier id
    src["resumes"]["starts"][2] = {"attempt": 2, "books": "cut", "checkpoint": None}
    rep = verify_run(write(tmp_path / "nothing", src))
    assert rep.ok and rep.rollback_lines()[1] == (
        "start 2: books cut back to nothing (no checkpoint): every earlier id; 1 produced sample(s) in no book excused"
    )


def test_resumes_json_without_starts_is_a_source_problem(tmp_path):
    src = clean()
    src["resumes"] = {"resumes": 0}  # as written before the starts were kept
    run_dir = write(tmp_path / "run", src)
    assert verify_run(run_dir).problems == [
        Problem("source", f"{run_dir}/resumes.json records no starts (KeyError: 'starts'): no rollback is known")
    ]


def test_a_truncated_tensor_is_caught_by_its_token_counts(tmp_path):
    src = clean()
    src["trainer"][1]["n_out"] = [4, 2]  # g1.1's tensors: 2 of its 3 tokens (the trainer trained 2)
    src["trainer"][1]["n_tokens"] = [4, 2]
    src["trainer"][0]["n_prompt"] = [2, 1]  # g0.1's prompt cut to 1 token
    assert check(tmp_path, src) == [
        Problem(
            "token_count",
            "sample 'g0.1' trained at step 0 with prompt tokens 1 (the trainer's tensors); rollout-0 produced 2",
        ),
        Problem(
            "token_count",
            "sample 'g1.1' trained at step 1 with output tokens 2 (the trainer's tensors); rollout-0 produced 3; "
            "trained tokens 2 (the trainer's tensors); rollout-0 produced 3",
        ),
    ]


def test_a_workflows_trained_tokens_are_compared_with_its_loss_tokens(tmp_path):
    src = clean()
    src["rollout"][4]["n_loss"] = [2, 3]  # g1.0: 2 of its 4 output tokens are the model's (a workflow episode)
    assert check(tmp_path, src) == [
        Problem(
            "token_count",
            "sample 'g1.0' trained at step 1 with trained tokens 4 (the trainer's tensors); rollout-0 produced 2",
        )
    ]
    src["trainer"][1]["n_tokens"] = [2, 3]  # the trainer's loss mask trains those 2
    assert verify_run(write(tmp_path / "run2", src)).ok


def test_a_misaligned_score_is_caught_against_the_reward_record(tmp_path):
    src = clean()
    src["books"][0]["reward"], src["books"][1]["reward"] = 0.0, 1.0  # g0's scores swapped in the books
    src["trainer"][1]["scores"] = [1.0, 1.0]  # g1.0 trained with 1.0; reward-0 scored it 0.0
    assert check(tmp_path, src) == [
        Problem("score_mismatch", "sample 'g0.0': the books say reward 0.0; scored 1.0 (ok) by reward-0"),
        Problem("score_mismatch", "sample 'g0.1': the books say reward 1.0; scored 0.0 (ok) by reward-0"),
        Problem("score_mismatch", "sample 'g1.0': trained at step 1 with score 1.0; scored 0.0 (ok) by reward-0"),
    ]


def test_a_score_no_reward_record_holds_and_a_trained_sample_without_reward(tmp_path):
    src = clean()
    src["rewards"] = src["rewards"][:2]  # g2 (aborted) was scored by nobody who recorded it
    src["books"][4]["reward"] = None  # g1.0 booked trained without a reward
    assert check(tmp_path, src) == [
        Problem("not_scored", "sample 'g2.0': the books say reward 1.0; no reward record holds it"),
        Problem("not_scored", "sample 'g2.1': the books say reward 1.0; no reward record holds it"),
        Problem("not_scored", "sample 'g1.0' booked trained with no reward"),
    ]


def test_a_version_stamp_the_engine_never_acknowledged_loading(tmp_path):
    src = clean()
    src["rollout"][3] = {"kind": "loaded", "version": 2}  # the engine loaded 2, never 1; g1 says it ran on 1
    assert check(tmp_path, src) == [
        Problem(
            "version_unloaded",
            "sample 'g1.0' stamped versions [0, 1] by rollout-0, whose engine had acknowledged loading 0, 2 "
            "(this process, before the group)",
        ),
        Problem(
            "version_unloaded",
            "sample 'g1.1' stamped versions [1, 1] by rollout-0, whose engine had acknowledged loading 0, 2 "
            "(this process, before the group)",
        ),
    ]


def test_a_restarted_rollout_worker_judges_its_stamps_by_its_own_loads(tmp_path):
    src = clean()
    # the worker restarted before g2 (a new start line) and loaded only version 1: g2's version 0 is not its own
    src["rollout"][5:5] = [{"kind": "start", "pid": 2}, {"kind": "loaded", "version": 1}]
    assert check(tmp_path, src) == [
        Problem(
            "version_unloaded",
            f"sample 'g2.{k}' stamped versions [0, 0] by rollout-0, whose engine had acknowledged loading 1 "
            "(this process, before the group)",
        )
        for k in (0, 1)
    ]
    src["rollout"][1:] = [src["rollout"][2], *src["rollout"][3:]]  # g0 before any load of the first process
    assert [p.message.split(", whose")[0] for p in check(tmp_path / "b", src)][:2] == [
        "sample 'g0.0' stamped versions [0, 0] by rollout-0",
        "sample 'g0.1' stamped versions [0, 0] by rollout-0",
    ]


def test_records_written_before_the_new_fields_are_source_problems(tmp_path):
    src = clean()
    del src["rollout"][0]  # no start line: a record written before the loads were recorded
    for r in src["trainer"]:
        del r["n_out"], r["scores"]
    run_dir = write(tmp_path / "run", src)
    assert verify_run(run_dir).problems == [
        Problem(
            "source",
            "trainer_steps.jsonl: step 0 lacks n_out, scores (one per sample id); a record written before these "
            "were recorded cannot be compared",
        ),
        Problem("source", "rollout_records/rollout-0.jsonl:2: a group before any start line"),
    ]


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
        Problem("source", f"{run_dir} has no trajectories.jsonl (the scheduler's books per sample)"),
        Problem("source", f"{run_dir} has no metrics.jsonl (the scheduler's books per step)"),
        Problem("source", f"{run_dir} has no resumes.json (the scheduler's starts)"),
        Problem("source", f"{run_dir} has no trainer_steps.jsonl (the trainer's record)"),
        Problem("source", f"{run_dir} has no rollout_records/*.jsonl (the rollout workers' records)"),
        Problem("source", f"{run_dir} has no reward_records/*.jsonl (the reward workers' records)"),
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
    assert out.startswith(f"areal-async verify: {ok_dir}: the sources agree: 2 trainer steps, 4 samples trained")
    # compared: 4 trained samples' counts; 6 books' rewards + 4 trained scores; 6 stamps, 2 loads
    assert out.rstrip().endswith(
        "compared: token counts and ids of 4, scores of 10 against 1 reward record(s), version stamps of 6 against 2 "
        "acknowledged load(s)"
    )
    src = clean()
    del src["books"][4]
    bad_dir = write(tmp_path / "bad", src)
    assert cli_main(["verify", str(bad_dir)]) == 1
    cap = capsys.readouterr()
    assert cap.out.splitlines() == [
        "trained_not_booked: sample 'g1.0' trained at step 1; trajectories.jsonl has no line for it",
        f"lost: sample 'g1.0' produced by rollout-0; {NO_LINE}",
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
    batch = TrajectoryBatch.group(
        gid, sids, [1, 2], [2] * n, torch.arange(2 * n), torch.zeros(2 * n), torch.full((2 * n,), version)
    )
    key, tensors, meta = batch.encode()
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


def _blake(ids: list[int]) -> str:
    """token_digest by hand: blake2b-64 of the ids packed as little-endian int32."""
    return hashlib.blake2b(struct.pack(f"<{len(ids)}i", *ids), digest_size=8).hexdigest()


def test_the_token_digest_by_hand_for_every_id_type():
    want = _blake([5, 49151, 2])
    assert token_digest([5, 49151, 2]) == want
    assert (
        token_digest(torch.tensor([5, 49151, 2]))
        == token_digest(torch.tensor([5, 49151, 2], dtype=torch.int32))
        == want
    )
    assert token_digest([5, 2, 49151]) != want and token_digest([]) == _blake([])


def test_trained_ids_that_differ_from_the_generated_ones_are_caught_by_their_digests(tmp_path):
    """The counts agree (a re-encoded completion can keep its length) but the ids do not."""
    src = clean()
    for rec in src["rollout"]:
        if rec["kind"] == "group":
            rec["tok_digest"] = [_blake([i] * n) for i, n in zip(range(len(rec["ids"])), rec["n_tokens"])]
    for st, g in zip(src["trainer"], (src["rollout"][2], src["rollout"][4])):
        st["tok_digest"] = list(g["tok_digest"])
    assert verify_run(write(tmp_path / "ok", src)).ok
    src["trainer"][1]["tok_digest"][0] = _blake([7, 7, 7, 7])  # g1.0 trained with other ids of its length
    assert check(tmp_path, src) == [
        Problem(
            "token_ids",
            f"sample 'g1.0' trained at step 1 with output ids of digest {_blake([7, 7, 7, 7])} (the trainer's "
            f"tensors); rollout-0 generated ids of digest {_blake([0] * 4)}",
        )
    ]


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
        "n_out": [3, 1, 2],
        "n_prompt": [1, 1, 1],
        "tok_digest": [_blake([0, 1, 2]), _blake([0]), _blake([0, 1])],  # outputs range(n)
        "scores": [1.0, 1.0, 1.0],
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
