"""Side-by-side log-log panels of named series, written to a PNG (matplotlib, headless), and the
benchmarks' plots built from their rows."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Panel:
    """One axes: a title, axis labels, and series {label: (xs, ys, matplotlib style)}."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[list[float], list[float], str]] = field(default_factory=dict)


def loglog_panels(panels: list[Panel], path: str, panel_size: tuple[float, float] = (6.0, 4.5)) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(panel_size[0] * len(panels), panel_size[1]), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for label, (xs, ys, style) in p.series.items():
            ax.plot(xs, ys, style, label=label)
        ax.set(xscale="log", yscale="log", xlabel=p.xlabel, ylabel=p.ylabel, title=p.title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def transfer_plot(rows: list[dict], path: str) -> None:
    """``benchmarks.transfer_latency`` rows: GB/s per payload size (with the memcpy bound as sampled
    next to the transfers, median over channels) and weight-sync seconds per model size."""
    tr = [r for r in rows if r["metric"] == "transfer_latency" and r["payload"] == "bytes"]
    per_size: dict[int, list[float]] = {}
    for r in tr:
        per_size.setdefault(r["bytes"], []).append(r["bound_gbps"])
    sizes = sorted(per_size)
    left = Panel(
        "rollout -> trainer transfer",
        "payload bytes",
        "GB/s (p50)",
        {"memcpy bound": (sizes, [statistics.median(per_size[n]) for n in sizes], "k--")},
    )
    right = Panel("weight sync", "parameters (bf16)", "seconds (p50)")
    for kind in sorted({r["transport"] for r in rows if r["metric"] == "transfer_latency"}):
        pts = [r for r in tr if r["transport"] == kind]
        left.series[kind] = ([r["bytes"] for r in pts], [r["gbps"] for r in pts], "o-")
        w = [r for r in rows if r["metric"] == "weight_sync" and r["transport"] == kind and r["pipeline"]]
        right.series[kind] = ([r["params"] for r in w], [r["p50_s"] for r in w], "o-")
    loglog_panels([left, right], path)
