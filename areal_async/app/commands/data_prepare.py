"""``areal-async data prepare``: common math datasets -> the training jsonl.

The training jsonl is one object per line, ``{"prompt": str, "solutions": [str, ...]}`` plus an
optional ``"answer"`` (a target completion, used by SFT and the warm-up). Input formats:

    boba   {"prompt", "solutions": [...]} (AReaL-boba-106k; "answer" kept when present)
    gsm8k  {"question", "answer": "...rationale...\\n#### 72"} -> solutions ["72"] (thousands commas
           dropped), answer = the rationale without calculator notes <<...>> and "\\boxed{72}"
    math   {"problem", "solution": "... \\boxed{\\frac12} ..."} -> solutions [the last boxed
           answer], answer = the solution text
    auto   each line by its keys (prompt / question / problem)

A bad line (not JSON, a missing or mistyped field, no "####" or no \\boxed{} to take the
answer from) is reported as ``FILE:LINE: <format>: what is wrong``; every bad line is listed and
nothing is written unless ``skip_bad`` is set (then the good lines are written and the bad
ones counted). The output is written to a temporary file and renamed, so a failed run never
leaves half a file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from areal_async.reward.math_verify_reward import extract_boxed

FORMATS = ("auto", "boba", "gsm8k", "math")
_CALC_NOTE = re.compile(r"<<[^<>]*>>")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
MAX_ERRORS_SHOWN = 20


class BadLine(ValueError):
    """One input line cannot be converted; the message says why (without the file and line)."""


@dataclass
class PrepareReport:
    n_read: int = 0
    n_written: int = 0
    by_format: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)  # "FILE:LINE: format: why"

    def describe(self) -> str:
        formats = ", ".join(f"{k} {v}" for k, v in sorted(self.by_format.items()))
        return f"{self.n_read} lines read, {self.n_written} written ({formats or 'none'}), {len(self.errors)} bad"


def _str_field(obj: dict, key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in obj else f"{type(value).__name__} {value!r:.40}"
        raise BadLine(f"field {key!r} must be a non-empty string, got {got}")
    return value


def from_boba(obj: dict) -> dict:
    prompt = _str_field(obj, "prompt")
    sols = obj.get("solutions")
    if not isinstance(sols, list) or not sols or not all(isinstance(s, str) and s.strip() for s in sols):
        raise BadLine(f"field 'solutions' must be a non-empty list of non-empty strings, got {sols!r:.60}")
    out = {"prompt": prompt, "solutions": list(sols)}
    if isinstance(obj.get("answer"), str) and obj["answer"].strip():
        out["answer"] = obj["answer"]
    return out


def from_gsm8k(obj: dict) -> dict:
    question, text = _str_field(obj, "question"), _str_field(obj, "answer")
    if "####" not in text:
        raise BadLine("field 'answer' has no '#### <final answer>' line")
    rationale, final = text.rsplit("####", 1)
    final = _THOUSANDS.sub("", final.strip())
    if not final:
        raise BadLine("nothing after '####' in field 'answer'")
    steps = _CALC_NOTE.sub("", rationale).strip()
    return {"prompt": question, "solutions": [final], "answer": f"{steps}\n\\boxed{{{final}}}".lstrip()}


def from_math(obj: dict) -> dict:
    problem, solution = _str_field(obj, "problem"), _str_field(obj, "solution")
    boxed = extract_boxed(solution)
    if boxed is None or not boxed.strip():
        raise BadLine("field 'solution' has no complete \\boxed{...} answer")
    return {"prompt": problem, "solutions": [boxed.strip()], "answer": solution}


CONVERTERS: dict[str, Callable[[dict], dict]] = {"boba": from_boba, "gsm8k": from_gsm8k, "math": from_math}
_KEYS = (("prompt", "boba"), ("question", "gsm8k"), ("problem", "math"))


def detect(obj: dict) -> str:
    """The format a line's keys say (boba: prompt, gsm8k: question, math: problem)."""
    for key, name in _KEYS:
        if key in obj:
            return name
    raise BadLine(
        f"cannot tell the format from keys {sorted(obj)[:8]}: expected 'prompt' (boba), "
        "'question' (gsm8k) or 'problem' (math)"
    )


def convert_line(line: str, fmt: str) -> tuple[str, dict]:
    """(format used, training record) for one jsonl line; ``BadLine`` naming the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadLine(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    name = detect(obj) if fmt == "auto" else fmt
    return name, CONVERTERS[name](obj)


def prepare(src: str | Path, dst: str | Path, fmt: str = "auto", skip_bad: bool = False) -> PrepareReport:
    """Convert ``src`` into ``dst``; raises ``ValueError`` listing the bad lines (nothing written)
    unless ``skip_bad``."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {' | '.join(FORMATS)}")
    report, records = PrepareReport(), []
    with open(src, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            report.n_read += 1
            try:
                name, rec = convert_line(line, fmt)
            except BadLine as e:
                report.errors.append(f"{src}:{lineno}: {fmt}: {e}")
                continue
            records.append(rec)
            report.by_format[name] = report.by_format.get(name, 0) + 1
    _refuse_if_bad(report, skip_bad, src)
    _write_atomic(Path(dst), records)
    report.n_written = len(records)
    return report


def _refuse_if_bad(report: PrepareReport, skip_bad: bool, src) -> None:
    if report.n_read == 0:
        raise ValueError(f"{src}: no lines to convert")
    if report.errors and not (skip_bad and len(report.errors) < report.n_read):
        shown = "\n  ".join(report.errors[:MAX_ERRORS_SHOWN])
        more = len(report.errors) - MAX_ERRORS_SHOWN
        tail = f"\n  ... and {more} more" if more > 0 else ""
        hint = "" if skip_bad else " (nothing written; --skip-bad writes the good lines)"
        raise ValueError(f"{len(report.errors)} of {report.n_read} lines are bad{hint}:\n  {shown}{tail}")


def _write_atomic(dst: Path, records: list[dict]) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, dst)
