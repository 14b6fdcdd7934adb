"""File and function sizes of a Python tree: the table the closing notes quote.

    python scripts/code_sizes.py [ROOT ...] [--over-file 500] [--over-fn 50] [--top 5] [--json]

Per file: physical lines (``wc -l``), how many files exceed ``--over-file``, the largest ``--top``.
Per function (every ``def`` and ``async def``, methods and nested functions included, each counted on
its own): lines from the ``def`` line to its last line (``end_lineno - lineno + 1``, decorators not
counted), with the median, the 90th percentile (nearest rank), the largest and how many exceed
``--over-fn``. ``ROOT`` defaults to ``areal_async``; run it from the repository root, or at another
commit with ``git worktree add /tmp/x COMMIT && python scripts/code_sizes.py /tmp/x/areal_async``.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Sizes:
    files: int
    lines: int
    files_over: int
    largest_files: list[tuple[str, int]]
    functions: int
    fn_median: float
    fn_p90: int
    fn_max: int
    fns_over: int
    largest_functions: list[tuple[str, int]]


def file_lines(path: Path) -> int:
    """Newline count, as ``wc -l`` gives it."""
    return path.read_bytes().count(b"\n")


def function_lines(source: str, name: str = "<src>") -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in ``source``, in source order."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{prefix}{child.name}", child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, name), "")
    return out


def percentile(values: list[int], q: float) -> int:
    """The nearest-rank percentile: the smallest value with at least ``q`` of the values at or below it."""
    if not values:
        raise ValueError("percentile of no values")
    ranked = sorted(values)
    return ranked[max(1, math.ceil(q * len(ranked))) - 1]


def median(values: list[int]) -> float:
    ranked, n = sorted(values), len(values)
    if not n:
        raise ValueError("median of no values")
    return float(ranked[n // 2]) if n % 2 else (ranked[n // 2 - 1] + ranked[n // 2]) / 2


def measure(roots: list[Path], over_file: int = 500, over_fn: int = 50, top: int = 5) -> Sizes:
    paths = sorted(p for root in roots for p in (root.rglob("*.py") if root.is_dir() else [root]))
    if not paths:
        raise ValueError(f"no .py files under {', '.join(map(str, roots))}")
    per_file = [(str(p), file_lines(p)) for p in paths]
    fns = [(f"{p}:{q}", n) for p in paths for q, n in function_lines(p.read_text(), str(p))]
    counts = [n for _, n in fns]
    by_size = lambda rows: sorted(rows, key=lambda r: (-r[1], r[0]))[:top]  # noqa: E731
    return Sizes(
        files=len(paths),
        lines=sum(n for _, n in per_file),
        files_over=sum(n > over_file for _, n in per_file),
        largest_files=by_size(per_file),
        functions=len(fns),
        fn_median=median(counts),
        fn_p90=percentile(counts, 0.9),
        fn_max=max(counts),
        fns_over=sum(n > over_fn for n in counts),
        largest_functions=by_size(fns),
    )


def render(s: Sizes, over_file: int, over_fn: int) -> str:
    rows = [
        f"files {s.files}, lines {s.lines}, files over {over_file} lines: {s.files_over}",
        "largest files: " + ", ".join(f"{p} {n}" for p, n in s.largest_files),
        (
            f"functions {s.functions}: median {s.fn_median:g} lines, p90 {s.fn_p90}, max {s.fn_max}, "
            f"over {over_fn}: {s.fns_over}"
        ),
        "largest functions: " + ", ".join(f"{q} {n}" for q, n in s.largest_functions),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("roots", nargs="*", default=["areal_async"], help="directories or files (default areal_async)")
    p.add_argument("--over-file", type=int, default=500, help="count files longer than this (lines)")
    p.add_argument("--over-fn", type=int, default=50, help="count functions longer than this (lines)")
    p.add_argument("--top", type=int, default=5, help="how many of the largest files and functions to list")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the text table")
    args = p.parse_args(argv)
    try:
        s = measure([Path(r) for r in args.roots], args.over_file, args.over_fn, args.top)
    except (ValueError, OSError, SyntaxError) as e:
        print(f"code_sizes: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(s)) if args.json else render(s, args.over_file, args.over_fn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
