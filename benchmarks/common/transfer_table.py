"""The transfer_latency benchmark's table and summary lines: the transfer and weight rows (the bound: its
median, sample count n_b and spread, the ratio to it, memmove alone and the ratio to that), LoRA and delta
lines, each gloo row as a fraction of the loopback wire (one stream; and its own streams, interleaved),
the server rows, and the phases of every timed weight update."""

from __future__ import annotations

import math

from benchmarks.common import backends as B
from benchmarks.common.rows import Col, human_bytes, print_table
from benchmarks.common.wire import fraction_lines, of_wire


def _what(r: dict) -> str:
    e2e = {"weight_sync_e2e": " e2e", "weight_sync_lora": f" lora r{r.get('rank')}", "weight_sync_delta": " delta",
           "weight_sync_backend": f" {r.get('backend')}"}  # fmt: skip
    e2e = e2e.get(r["metric"], "")
    return r.get("payload") or f"w:{r['model']}" + ("" if r.get("pipeline", True) else " serial") + e2e


COLUMNS = [
    Col("transport", 9, lambda r: r["transport"], left=True),
    Col("payload", 13, _what, left=True),
    Col("size", 10, lambda r: human_bytes(r["bytes"])),
    Col("p50 ms", 10, lambda r: r["p50_s"] * 1e3, ".3f"),
    Col("p99 ms", 10, lambda r: r["p99_s"] * 1e3, ".3f"),
    Col("GB/s", 8, lambda r: r["gbps"], ".3f"),
    Col("bound", 8, lambda r: r["bound_gbps"], ".3f"),
    Col("n_b", 4, lambda r: len(r["bound_gbps_samples"])),
    Col("spread", 6, lambda r: r["bound_spread"], ".2f"),
    Col("ratio", 6, lambda r: r["ratio"], ".2f"),
    Col("memmove", 7, lambda r: r.get("memmove_gbps", math.nan), ".2f"),
    Col("r_mm", 5, lambda r: r.get("ratio_memmove", math.nan), ".2f"),
]


WEIGHT_METRICS = ("wire_bound", "transfer_latency", "weight_sync", "weight_sync_e2e", "weight_sync_lora",
                  "weight_sync_delta", "weight_sync_backend")  # fmt: skip


def show(rows: list[dict]) -> None:
    print()
    print_table(
        rows,
        COLUMNS,
        where=lambda r: r["metric"] in WEIGHT_METRICS,
    )
    for r in rows:
        if r["metric"] == "weight_sync_lora":
            print(
                f"lora {r['transport']} {r['model']} r{r['rank']}: {r['bytes_ratio']:.0f}x fewer bytes, "
                f"{r['time_ratio']:.1f}x less time than the full weights (p50 {r['full_p50_s'] * 1e3:.1f} ms)"
            )
        if r["metric"] == "weight_sync_delta":
            print(
                f"delta {r['transport']} {r['model']} ({r['changed_fraction']:.0%} of elements moved): "
                f"{r['wire_bytes'] / 2**20:.1f} MiB on the wire, {r['bytes_ratio']:.0f}x fewer bytes; "
                f"{r['time_ratio']:.2f}x the speed of the full weights (p50 {r['full_p50_s'] * 1e3:.1f} ms)"
            )
    for line in of_wire(rows) + fraction_lines(rows):
        print(line)
    for note in rows[0].get("notes", []):
        print("note:", note)
    if any(r["metric"] == "weight_sync_backend" for r in rows):
        print_table(rows, B.COLUMNS, where=lambda r: r["metric"] == "weight_sync_backend")
    for r in rows:
        phased = r["metric"] in ("weight_sync", "weight_sync_e2e", "weight_sync_delta")
        if phased and (r["pub_phases"] or r["recv_phases"]):
            print(f"phases {r['transport']} {_what(r)} (ms): publisher {_ms(r['pub_phases'])}; "
                  f"receiver {_ms(r['recv_phases'])}" + _engine_ms(r))  # fmt: skip


def _ms(phases: dict) -> str:
    return ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in phases.items()) or "-"


def _engine_ms(r: dict) -> str:
    if r["metric"] != "weight_sync_e2e":
        return ""
    return f"; engine load {r['load_s'] * 1e3:.1f}, KV recompute {r['recompute_s'] * 1e3:.1f}"
