"""The memory-latency plane of a comparison: one marker per method, the Pareto front drawn."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from magis.plots import label_points
from yardstick.compare import Comparison, pareto_front

_MARKERS = {"peer": "o", "magis": "*"}


def plot_tradeoff(comparison: Comparison, path: str | Path) -> Path:
    """Write a PNG of ``comparison``: x = peak ratio, y = latency ratio (both against eager)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 5))  # no pyplot: no GUI backend, no global figure state
    ax = fig.subplots()
    for i, row in enumerate(comparison.rows):
        color = f"C{i % 10}"  # matplotlib's default color cycle
        if row.latency_ratio_stderr is not None:
            bar = 2 * row.latency_ratio_stderr  # about a 95% confidence interval
            ax.errorbar(row.peak_ratio, row.latency_ratio, yerr=bar, color=color, alpha=0.5, zorder=2)
        ax.scatter(row.peak_ratio, row.latency_ratio, marker=_MARKERS.get(row.kind, "o"), s=80, color=color, zorder=3)
    label_points(ax, comparison.rows)
    front = pareto_front(comparison.rows)
    ax.step(
        [r.peak_ratio for r in front],
        [r.latency_ratio for r in front],
        where="post",
        color="gray",
        linestyle="--",
        marker="o",
        markersize=16,
        markerfacecolor="none",
        label="Pareto front",
        zorder=1,
    )
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.axvline(1.0, color="black", linewidth=0.5)
    how = "measured" if comparison.measured else f"simulated, {comparison.settings.get('device')}"
    ax.set_title(f"{comparison.workload} ({comparison.preset}, {how})")
    ax.set_xlabel("peak memory / eager")
    ax.set_ylabel("latency / eager" + (" (bars: ±2 standard errors)" if comparison.measured else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
