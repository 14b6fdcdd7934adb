"""reward/samples.py: which groups a reward worker records, and what a line holds."""

import json

from areal_async.reward import samples as rs
from areal_async.reward.pool import RewardOutcome


def outcome(score, status="ok", detail=""):
    return RewardOutcome(score, status, detail, 0.01)


def test_the_first_groups_then_one_in_every_50(tmp_path):
    log = rs.RewardSampleLog(tmp_path, "reward-0")
    for k in range(120):
        log.group(f"g{k}", ["a", "b"], ["1"], [outcome(0.0), outcome(1.0)])
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "reward_samples" / "reward-0.jsonl").read_text().splitlines()]
    assert [x["group_id"] for x in lines] == [f"g{k}" for k in list(range(16)) + [50, 100]]


def test_a_line_holds_the_parse_and_is_cut(tmp_path):
    long = "x" * 1000 + " \\boxed{12}"
    line = rs.sample_line(
        "g", [long, "no box", "third"], ["12"], [outcome(1.0), outcome(0.0, "timeout", "killed"), outcome(0.0)]
    )
    assert line["boxed"] == ["12", None]  # parsed from the whole completion (what the reward saw), not the cut
    line = rs.sample_line("g", ["7 \\boxed{7}", "no box"], ["7"], [outcome(1.0), outcome(0.0, "timeout", "killed")])
    assert line["boxed"] == ["7", None] and line["scores"] == [1.0, 0.0]
    assert line["statuses"] == ["ok", "timeout"] and line["details"] == ["", "killed"]
    assert line["group_scores"] == [1.0, 0.0]
    cut = rs.sample_line("g", [long], ["12"], [outcome(1.0)])
    assert len(cut["completions"][0]) == rs.MAX_CHARS and len(cut["completions"]) == 1


def test_at_most_max_lines_and_a_failed_write_stops_recording(tmp_path):
    log = rs.RewardSampleLog(tmp_path, "r")
    log.n_lines = rs.MAX_LINES
    assert not log.due()
    (tmp_path / "reward_samples").write_text("a file, not a directory")
    bad = rs.RewardSampleLog(tmp_path, "r")
    bad.group("g", ["a"], ["1"], [outcome(0.0)])  # logged, no raise
    assert bad.n_lines == rs.MAX_LINES
