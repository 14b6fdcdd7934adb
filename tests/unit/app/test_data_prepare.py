"""``areal-async data prepare``: one small handmade file per format, and a bad line in each named in the error."""

import json
from pathlib import Path

import pytest

from areal_async.app.commands.data_prepare import prepare
from areal_async.data.prompts import load_jsonl

ROOT = Path(__file__).resolve().parents[3]

BOBA = [
    {"prompt": "What is 2+3?", "solutions": ["\\boxed{5}", "5"]},
    {"prompt": "Solve x+1=3.", "solutions": ["2"], "answer": "x=2, so \\boxed{2}"},
]
GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs 1,200 dollars. Twice that?", "answer": "2*1200=<<2*1200=2400>>2400\n#### 2,400"},
]
MATH = [
    {"problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.", "solution": "The sum is $\\boxed{1}$."},
    {"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\sqrt{8}=\\boxed{2\\sqrt{2}}$ since $8=4\\cdot 2$."},
]


def write(path: Path, rows: list, bad: str | None = None, bad_at: int = 2) -> Path:
    lines = [json.dumps(r) for r in rows]
    if bad is not None:
        lines.insert(bad_at - 1, bad)
    path.write_text("\n".join(lines) + "\n")
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_boba_lines_pass_through(tmp_path):
    out = tmp_path / "out.jsonl"
    report = prepare(write(tmp_path / "boba.jsonl", BOBA), out, "boba")
    assert read(out) == [
        {"prompt": "What is 2+3?", "solutions": ["\\boxed{5}", "5"]},
        {"prompt": "Solve x+1=3.", "solutions": ["2"], "answer": "x=2, so \\boxed{2}"},
    ]
    assert (report.n_read, report.n_written, report.by_format) == (2, 2, {"boba": 2})
    assert [p.solutions for p in load_jsonl(out)] == [("\\boxed{5}", "5"), ("2",)]  # the trainer reads it


def test_gsm8k_final_answer_after_hashes_commas_dropped(tmp_path):
    out = tmp_path / "out.jsonl"
    prepare(write(tmp_path / "gsm8k.jsonl", GSM8K), out, "gsm8k")
    assert read(out) == [
        {"prompt": "Tom has 3 apples and buys 4. How many?", "solutions": ["7"], "answer": "3+4=7\n\\boxed{7}"},
        {
            "prompt": "A car costs 1,200 dollars. Twice that?",
            "solutions": ["2400"],
            "answer": "2*1200=2400\n\\boxed{2400}",
        },
    ]


def test_math_last_boxed_answer(tmp_path):
    out = tmp_path / "out.jsonl"
    prepare(write(tmp_path / "math.jsonl", MATH), out, "math")
    assert [r["solutions"] for r in read(out)] == [["1"], ["2\\sqrt{2}"]]
    assert read(out)[1]["answer"] == MATH[1]["solution"]


def test_auto_detects_each_line(tmp_path):
    out = tmp_path / "out.jsonl"
    report = prepare(write(tmp_path / "mixed.jsonl", [BOBA[0], GSM8K[0], MATH[0]]), out)
    assert report.by_format == {"boba": 1, "gsm8k": 1, "math": 1}
    assert [r["solutions"] for r in read(out)] == [["\\boxed{5}", "5"], ["7"], ["1"]]


@pytest.mark.parametrize(
    "fmt, rows, bad, why",
    [
        ("boba", BOBA, '{"prompt": "1+1?", "solutions": []}', "boba: field 'solutions' must be a non-empty list"),
        ("gsm8k", GSM8K, '{"question": "How many?", "answer": "I think 4"}', "gsm8k: field 'answer' has no '#### "),
        (
            "math",
            MATH,
            '{"problem": "Find x.", "solution": "x is \\\\boxed{3"}',
            "math: field 'solution' has no complete \\boxed{...} answer",
        ),
        ("auto", BOBA, '{"prompt": "2+2?", "solutions": ["4"]', "auto: not valid JSON"),
        ("auto", BOBA, '{"text": "hello"}', "auto: cannot tell the format from keys ['text']"),
    ],
)
def test_a_bad_line_is_named_and_nothing_is_written(tmp_path, fmt, rows, bad, why):
    src, out = write(tmp_path / f"{fmt}.jsonl", rows, bad, bad_at=2), tmp_path / "out.jsonl"
    with pytest.raises(ValueError) as e:
        prepare(src, out, fmt)
    assert f"{src}:2: {why}" in str(e.value) and "1 of 3 lines are bad (nothing written" in str(e.value)
    assert not out.exists() and not (tmp_path / "out.jsonl.tmp").exists()


def test_cli_skip_bad_writes_the_good_lines_and_reports_the_bad(tmp_path, cli):
    src = write(tmp_path / "gsm8k.jsonl", GSM8K, '{"question": "Q", "answer": 5}', bad_at=1)
    out = tmp_path / "out.jsonl"
    cmd = ["data", "prepare", src, "-o", out, "--format", "gsm8k"]
    refused = cli(*cmd)
    assert (
        refused.returncode == 2
        and f"{src}:1: gsm8k: field 'answer' must be a non-empty string, got int 5" in refused.stderr
        and not out.exists()
    )
    done = cli(*cmd, "--skip-bad")
    assert done.returncode == 0, done.stderr
    assert "3 lines read, 2 written (gsm8k 2), 1 bad" in done.stdout and f"skipped {src}:1:" in done.stderr
    assert [r["solutions"] for r in read(out)] == [["7"], ["2400"]]
