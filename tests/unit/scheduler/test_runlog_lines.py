"""trajectories.jsonl's lines: ``sample_text`` writes what ``json.dumps(sample_line(rec))`` writes, byte for
byte (the standard library's encoder is the reference), for the values the books hold and for odd ones
(quotes, control and non-ASCII characters, non-finite scores, ints that are bools, a non-str field), and
``RunLog.samples`` writes the records that end together in one go, one line each, counted."""

import json
import random

import pytest

from areal_async.scheduler.ledger import SampleRecord, SampleState
from areal_async.scheduler.runlog import RunLog, sample_line, sample_text, samples_text

ODD_STRINGS = ["", "g12.3", 'say "hi"', "back\\slash", "line\nbreak\ttab", "ünïcode", "\u2028", "emoji 😀", "\x00"]
ODD_SCORES = [None, 1.0, 0.0, -0.0, 0.1, 1e300, 5e-324, float("nan"), float("inf"), float("-inf"), 1, True]
ODD_INTS = [-1, 0, 7, 2**70, True, 3.0]


def test_a_trained_sample_line_is_the_encoders_to_the_byte():
    rec = SampleRecord("g3.1", "g3", "p7", 7, SampleState.TRAINED, "rollout-0", 4, 5, 12, "stop", 1.0, "ok", 5)
    expected = (
        '{"id": "g3.1", "prompt_id": "p7", "group_id": "g3", "status": "trained", "train_step": 5, '
        '"version_min": 4, "version_max": 5, "reward": 1.0, "reward_status": "ok", "n_output_tokens": 12, '
        '"finish_reason": "stop", "turns": 1, "worker": "rollout-0", "reason": null}'
    )
    assert sample_text(rec) == expected == json.dumps(sample_line(rec))


def test_random_records_with_odd_values_match_json_dumps():
    rng = random.Random(40)
    for _ in range(5000):
        rec = SampleRecord(
            rng.choice(ODD_STRINGS),
            rng.choice(ODD_STRINGS),
            rng.choice(ODD_STRINGS),
            3,
            status=rng.choice(list(SampleState)),
            worker=rng.choice(ODD_STRINGS + [7]),  # a non-str field: json.dumps writes it as it is
            version_min=rng.choice(ODD_INTS),
            version_max=rng.choice(ODD_INTS),
            n_output_tokens=rng.choice(ODD_INTS),
            finish_reason=rng.choice(ODD_STRINGS),
            score=rng.choice(ODD_SCORES),
            reward_status=rng.choice(ODD_STRINGS),
            train_step=rng.choice(ODD_INTS + [None]),
            reason=rng.choice(ODD_STRINGS),
            turns=rng.choice(ODD_INTS),
        )
        assert sample_text(rec) == json.dumps(sample_line(rec)), rec


@pytest.mark.parametrize("dump", [True, False])
def test_samples_that_end_together_are_one_line_each(tmp_path, dump):
    log = RunLog(tmp_path, dump_trajectories=dump)
    recs = [SampleRecord(f"g1.{k}", "g1", "p1", 1, SampleState.ABORTED, "r0", reason=f"why {k}") for k in range(3)]
    log.samples(recs)
    log.sample(SampleRecord("g2.0", "g2", "p2", 2, SampleState.ABORTED, "r0", reason="alone"))
    log.samples([])
    log.close()
    assert log.n_sample_lines == 4
    if not dump:
        assert not (tmp_path / "trajectories.jsonl").exists()
        return
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert [json.loads(x)["reason"] for x in lines] == ["why 0", "why 1", "why 2", "alone"]
    assert [json.loads(x)["id"] for x in lines] == ["g1.0", "g1.1", "g1.2", "g2.0"]


def _odd_group(rng: random.Random) -> list[SampleRecord]:
    """A group's records as the ledger makes them (its shared fields the very same objects), some
    with odd values, some fields of one record replaced by equal objects of another type."""
    gid, pid, worker, why = rng.choice(ODD_STRINGS), rng.choice(ODD_STRINGS), rng.choice(ODD_STRINGS + [7]), "why"
    status, step = rng.choice(list(SampleState)), rng.choice(ODD_INTS + [None])
    recs = []
    for j in range(rng.randint(1, 5)):
        rec = SampleRecord(f"{gid}.{j}", gid, pid, 3, status, worker, train_step=step, reason=rng.choice([why, ""]))
        rec.version_min, rec.version_max = rng.choice(ODD_INTS), rng.choice(ODD_INTS)
        rec.n_output_tokens, rec.turns, rec.score = rng.choice(ODD_INTS), rng.choice(ODD_INTS), rng.choice(ODD_SCORES)
        rec.finish_reason, rec.reward_status = rng.choice(ODD_STRINGS), rng.choice(ODD_STRINGS)
        if rng.random() < 0.2:  # an equal value of another type, or an equal str that is another object
            rec.train_step = {1: True, 0: False}.get(step, step)
            rec.group_id = "".join(list(gid))
        recs.append(rec)
    return recs


def test_the_lines_of_records_that_end_together_match_json_dumps():
    """``samples_text`` (a group's shared fields formatted once) against the standard library's encoder."""
    rng = random.Random(41)
    for _ in range(2000):
        recs = [r for k in range(rng.randint(0, 4)) for r in _odd_group(rng)]
        assert samples_text(recs) == "".join(json.dumps(sample_line(r)) + "\n" for r in recs), recs


def test_a_step_of_plain_records_is_the_encoders_lines():
    """The common case: 3 groups of 4 trained samples, every field of the books' types."""
    recs = [
        SampleRecord(f"g{g}.{k}", f"g{g}", f"p{g}", g, SampleState.TRAINED, f"rollout-{g % 2}", 6, 7, 10 + k, "stop")
        for g in range(3)
        for k in range(4)
    ]
    for k, rec in enumerate(recs):
        rec.score, rec.reward_status, rec.train_step = float(k % 2), "ok", 7
    text = samples_text(recs)
    assert text.splitlines()[5] == (
        '{"id": "g1.1", "prompt_id": "p1", "group_id": "g1", "status": "trained", "train_step": 7, '
        '"version_min": 6, "version_max": 7, "reward": 1.0, "reward_status": "ok", "n_output_tokens": 11, '
        '"finish_reason": "stop", "turns": 1, "worker": "rollout-1", "reason": null}'
    )
    assert text == "".join(json.dumps(sample_line(r)) + "\n" for r in recs)
