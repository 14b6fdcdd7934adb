"""scripts/code_sizes.py: the size table of the closing notes, on a tree whose sizes are counted by hand."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("code_sizes", ROOT / "scripts" / "code_sizes.py")
code_sizes = sys.modules["code_sizes"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(code_sizes)


def fn(name: str, body_lines: int, indent: str = "") -> str:
    return f"{indent}def {name}():\n" + "".join(f"{indent}    x = {i}\n" for i in range(body_lines))


def test_sizes_of_a_tree_counted_by_hand(tmp_path):
    # a.py: f (3 lines), g (6 lines); b.py: class C whose method m (3 lines) holds n (2 lines)
    (tmp_path / "a.py").write_text(fn("f", 2) + fn("g", 5))  # 3 + 6 = 9 lines
    (tmp_path / "b.py").write_text("class C:\n" + "    def m(self):\n        def n():\n            pass\n" + "\n" * 3)
    s = code_sizes.measure([tmp_path], over_file=8, over_fn=2, top=1)
    assert (s.files, s.lines, s.files_over) == (2, 9 + 7, 1)  # b.py: 4 lines + 3 blank = 7
    assert s.largest_files == [(str(tmp_path / "a.py"), 9)]
    # functions: f 3, g 6, C.m 3 (def m .. pass), C.m.n 2
    assert s.functions == 4 and s.fn_max == 6 and s.fn_median == 3.0 and s.fn_p90 == 6 and s.fns_over == 3
    assert s.largest_functions == [(f"{tmp_path / 'a.py'}:g", 6)]


def test_percentile_is_nearest_rank_and_refuses_nothing():
    assert code_sizes.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9) == 9
    assert code_sizes.percentile([5], 0.9) == 5 and code_sizes.median([1, 2, 3, 10]) == 2.5
    with pytest.raises(ValueError, match="no values"):
        code_sizes.percentile([], 0.9)


def test_no_python_files_is_a_clear_error(tmp_path, capsys):
    assert code_sizes.main([str(tmp_path)]) == 2
    assert f"code_sizes: error: no .py files under {tmp_path}" in capsys.readouterr().err
