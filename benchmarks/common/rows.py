"""What every benchmark shares: the JSON row contract, the writer, and the printed table.

Each benchmark writes a list of row objects with at least ``metric``, ``value`` and ``unit``
(transfer rows add transport/bytes/p50_s/..., async rows add eta/limit/...). ``write_rows``
checks the contract before writing, so a benchmark cannot silently emit a row a reader would
choke on. ``print_table`` prints chosen rows as aligned columns (``Col``), "-" for a missing value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

REQUIRED = ("metric", "value", "unit")


def check_rows(rows: list[dict]) -> None:
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(
                f"benchmark row {i} ({row.get('metric', '?')}) lacks {missing}; every row needs {REQUIRED}"
            )
        v = row["value"]
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise ValueError(f"benchmark row {i} ({row['metric']}): value {v!r} is not a finite number or null")


def write_rows(path: str | Path, rows: list[dict]) -> None:
    check_rows(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


@dataclass(frozen=True)
class Col:
    """One column of a printed table."""

    head: str
    """The header."""
    width: int
    """Characters; cells are right-aligned unless ``left``."""
    get: Callable[[dict], Any]
    """The cell's value from a row (None prints as "-")."""
    spec: str = ""
    """Format spec of the value, e.g. ".3f", ".1%"."""
    left: bool = False
    """Left-align (text columns)."""

    def cell(self, row: dict) -> str:
        v = self.get(row)
        return self.pad("-" if v is None else format(v, self.spec))

    def pad(self, text: str) -> str:
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"


def table(rows: list[dict], cols: list[Col], where: Optional[Callable[[dict], bool]] = None) -> list[str]:
    """Header line then one line per row (those ``where`` accepts), columns joined by one space."""
    lines = [" ".join(c.pad(c.head) for c in cols)]
    return lines + [" ".join(c.cell(r) for c in cols) for r in rows if where is None or where(r)]


def print_table(rows: list[dict], cols: list[Col], where: Optional[Callable[[dict], bool]] = None) -> None:
    print("\n".join(table(rows, cols, where)))


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (4 significant digits; B below 1 KiB)."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.4g} {unit}"
    return f"{n} B"
