"""trajectories.jsonl's lines: ``sample_text`` writes what ``json.dumps(sample_line(rec))`` writes, byte for
byte (the standard library's encoder is the reference), for the values the books hold and for odd ones
(quotes, control and non-ASCII characters, non-finite scores, ints that are bools, a non-str field), and
``RunLog.samples`` writes the records that end together in one go, one line each, counted."""

import json
import random

import pytest

from areal_async.scheduler.ledger import SampleRecord, SampleState
from areal_async.scheduler.runlog import RunLog, sample_line, sample_text

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
