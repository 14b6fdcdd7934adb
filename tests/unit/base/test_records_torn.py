"""A record reopened by a restarted worker: its predecessor's torn last line is dropped, so the next line
stays a line (read back with the reader: every line parses, none lost but the torn one)."""

from __future__ import annotations

import json

from areal_async.base.records import JsonlRecord, drop_torn_tail, read_jsonl


def test_a_torn_last_line_is_dropped_when_the_record_is_opened_again(tmp_path):
    path = tmp_path / "rollout_records" / "rollout-0.jsonl"
    rec = JsonlRecord(path)
    rec.write({"kind": "start", "pid": 1}, {"kind": "loaded", "version": 0})
    rec.close()
    with open(path, "a") as f:
        f.write('{"kind":"group","ids":["g0.')  # the worker killed mid-line
    again = JsonlRecord(path)
    again.write({"kind": "start", "pid": 2})
    again.close()
    rows, problems = read_jsonl(path)
    assert problems == [] and rows == [
        {"kind": "start", "pid": 1},
        {"kind": "loaded", "version": 0},
        {"kind": "start", "pid": 2},
    ]
    assert drop_torn_tail(path) == 0 and drop_torn_tail(tmp_path / "none.jsonl") == 0


def test_a_file_that_is_only_a_torn_line_is_emptied(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": ')
    assert drop_torn_tail(path) == 6 and path.read_text() == ""
    path.write_text(json.dumps({"a": 1}) + "\n")
    assert drop_torn_tail(path) == 0 and path.read_text() == '{"a": 1}\n'


def test_a_torn_line_longer_than_a_chunk_is_found_back_to_its_start(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n' + "x" * 50)  # 50 torn bytes read back 16 at a time
    assert drop_torn_tail(path, chunk=16) == 50 and path.read_text() == '{"a": 1}\n'
