"""The file:line links of docs/loop.md, kept pointing at what they name.

A link there is ``[`SYMBOL`](../PATH.py#LN)``: SYMBOL a function, a class or ``Class.method`` of PATH.
This script finds each symbol's ``def``/``class`` line with ``ast`` and rewrites N:

    python scripts/loop_links.py            # rewrite docs/loop.md's line numbers
    python scripts/loop_links.py --check    # exit 1 naming each link whose symbol is gone or moved

tests/unit/house/test_docs.py holds every symbol to exist (a renamed or removed one fails CI); a moved
line (an edit above it) is what this script fixes.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "loop.md"
LINK = re.compile(r"\[`([A-Za-z_][\w.]*)`\]\(\.\./([\w/.]+\.py)#L(\d+)\)")


def symbol_line(path: Path, symbol: str) -> int | None:
    """The line of ``symbol``'s def or class statement in ``path`` (``Class.method`` allowed), or None."""
    body = ast.parse(path.read_text()).body
    node = None
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for part in symbol.split("."):
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node.lineno if node is not None else None


def resolve(text: str) -> tuple[str, list[str], list[str]]:
    """(the page with each link's line set, links whose symbol is gone, links whose line moved)."""
    gone, moved = [], []

    def fix(m: re.Match) -> str:
        symbol, rel, line = m.group(1), m.group(2), int(m.group(3))
        path = ROOT / rel
        found = symbol_line(path, symbol) if path.is_file() else None
        if found is None:
            gone.append(f"{rel}: {symbol}")
            return m.group(0)
        if found != line:
            moved.append(f"{rel}: {symbol} L{line} -> L{found}")
        return f"[`{symbol}`](../{rel}#L{found})"

    return LINK.sub(fix, text), gone, moved


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    new, gone, moved = resolve(text)
    for g in gone:
        print(f"docs/loop.md links a symbol that is gone: {g}", file=sys.stderr)
    if "--check" in argv:
        for m in moved:
            print(f"docs/loop.md: moved: {m}", file=sys.stderr)
        return 1 if gone or moved else 0
    if new != text:
        PAGE.write_text(new)
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
