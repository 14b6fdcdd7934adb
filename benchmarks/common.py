"""What every benchmark shares: the JSON row contract.

Each benchmark writes a list of row objects with at least ``metric``, ``value`` and ``unit``
(transfer rows add transport/bytes/p50_s/..., async rows add eta/limit/...). ``write_rows``
checks the contract before writing, so a benchmark cannot silently emit a row a reader would
choke on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

REQUIRED = ("metric", "value", "unit")


def check_rows(rows: list[dict]) -> None:
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"benchmark row {i} ({row.get('metric', '?')}) lacks {missing}; every row needs {REQUIRED}")
        v = row["value"]
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise ValueError(f"benchmark row {i} ({row['metric']}): value {v!r} is not a finite number or null")


def write_rows(path: str | Path, rows: list[dict]) -> None:
    check_rows(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
