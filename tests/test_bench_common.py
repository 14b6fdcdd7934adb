"""The benchmark JSON row contract."""

import json

import pytest

from benchmarks.common import write_rows


def test_rows_are_written_when_they_keep_the_contract(tmp_path):
    rows = [{"metric": "x", "value": 1.5, "unit": "s", "extra": 1}, {"metric": "y", "value": None, "unit": "s"}]
    write_rows(tmp_path / "a" / "r.json", rows)
    assert json.loads((tmp_path / "a" / "r.json").read_text()) == rows


@pytest.mark.parametrize("row, needle", [({"metric": "x", "value": 1}, r"lacks \['unit'\]"),
                                         ({"metric": "x", "value": float("nan"), "unit": "s"}, "not a finite number"),
                                         ({"metric": "x", "value": "fast", "unit": "s"}, "not a finite number")])
def test_rows_breaking_the_contract_are_refused(tmp_path, row, needle):
    with pytest.raises(ValueError, match=needle):
        write_rows(tmp_path / "r.json", [row])
    assert not (tmp_path / "r.json").exists()
