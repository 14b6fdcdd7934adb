"""The benchmark JSON row contract."""

import json

import pytest

from benchmarks.common import Col, table, write_rows
from benchmarks.common.rows import human_bytes


def test_rows_are_written_when_they_keep_the_contract(tmp_path):
    rows = [{"metric": "x", "value": 1.5, "unit": "s", "extra": 1}, {"metric": "y", "value": None, "unit": "s"}]
    write_rows(tmp_path / "a" / "r.json", rows)
    assert json.loads((tmp_path / "a" / "r.json").read_text()) == rows


@pytest.mark.parametrize(
    "row, needle",
    [
        ({"metric": "x", "value": 1}, r"lacks \['unit'\]"),
        ({"metric": "x", "value": float("nan"), "unit": "s"}, "not a finite number"),
        ({"metric": "x", "value": "fast", "unit": "s"}, "not a finite number"),
    ],
)
def test_rows_breaking_the_contract_are_refused(tmp_path, row, needle):
    with pytest.raises(ValueError, match=needle):
        write_rows(tmp_path / "r.json", [row])
    assert not (tmp_path / "r.json").exists()


def test_table_aligns_columns_filters_rows_and_prints_missing_values_as_dash():
    cols = [
        Col("name", 6, lambda r: r["name"], left=True),
        Col("ms", 7, lambda r: r.get("s") and r["s"] * 1e3, ".2f"),
        Col("share", 6, lambda r: r.get("f"), ".0%"),
    ]
    rows = [{"name": "a", "s": 0.0123, "f": 0.5}, {"name": "bb", "f": None}, {"name": "skip", "s": 1.0}]
    assert table(rows, cols, where=lambda r: r["name"] != "skip") == [
        "name        ms  share",
        "a        12.30    50%",
        "bb           -      -",
    ]


def test_human_bytes():
    assert [human_bytes(n) for n in (1000, 1024, 1536, 256 << 20, 3 << 30)] == [
        "1000 B",
        "1 KiB",
        "1.5 KiB",
        "256 MiB",
        "3 GiB",
    ]
