"""Harness parts the benchmarks share; each benchmark reads configure -> measure -> rows -> table.

- ``rows``: the JSON row contract (``metric``, ``value``, ``unit``), its writer, the printed table.
- ``timing``: p50/p99 of samples and the memcpy bound (one warm single-thread copy).
- ``payloads``: synthetic Qwen2-shaped state dicts and boba-shaped trajectory batches.
- ``peers``: a spawned peer process driven over a pipe (msgpack), serving tensor/weight channel ends.
- ``cpu``: /proc CPU time per pid, per process tree and per fleet role; machine-wide busy time.
- ``fleet``: one ``areal-async run`` as a subprocess, its metrics rows, and reading them (steady
  window, time to a reward threshold, phase times).
- ``plot``: log-log panels of named series to a PNG.
"""

from benchmarks.common.rows import REQUIRED, Col, check_rows, print_table, table, write_rows

__all__ = ["REQUIRED", "Col", "check_rows", "print_table", "table", "write_rows"]
