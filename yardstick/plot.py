"""The memory-latency plane of a comparison: one marker per method, the Pareto front drawn."""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from magis.plots import label_points
from yardstick.compare import Comparison, pareto_front

_MARKERS = {"peer": "o", "magis": "*"}


def plot_tradeoff(comparison: Comparison, path: str | Path) -> Path:
    """Write a PNG of ``comparison``: x = peak ratio, y = latency ratio (both against its reference)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 5))  # no pyplot: no GUI backend, no global figure state
    draw_tradeoff(fig.subplots(), comparison)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def draw_tradeoff(ax: Axes, comparison: Comparison, fontsize: float | None = None) -> None:
    """Draw ``comparison``'s plane on ``ax``: every row's point, labelled, and the Pareto front."""
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
    ax.set_title(f"{comparison.workload} ({comparison.preset}, {how})", fontsize=fontsize)
    reference = comparison.rows[0].method if comparison.rows else "eager"
    ax.set_xlabel(f"peak memory / {reference}", fontsize=fontsize)
    bars = " (bars: ±2 standard errors)" if comparison.measured else ""
    ax.set_ylabel(f"latency / {reference}{bars}", fontsize=fontsize)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=fontsize)
