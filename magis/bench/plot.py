"""The memory-latency plane: a comparison (one marker per method, the Pareto front drawn), or a
rule's front beside the peers' points."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from magis.bench.compare import Comparison, Row, pareto_front

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
    _label_points(ax, comparison.rows)
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


def _label_points(ax: Axes, rows: list[Row]) -> None:
    """One label per distinct point (methods that coincide share it), alternately above and below."""
    points: dict[tuple[float, float], list[str]] = {}
    for row in rows:
        points.setdefault((round(row.peak_ratio, 3), round(row.latency_ratio, 3)), []).append(row.method)
    rightmost = max(x for x, _ in points)
    for i, ((x, y), names) in enumerate(sorted(points.items())):
        left = x == rightmost  # keep the label inside the axes
        ax.annotate(
            "\n".join(names),
            (x, y),
            textcoords="offset points",
            xytext=(-8 if left else 8, 6 if i % 2 == 0 else -6),
            ha="right" if left else "left",
            va="bottom" if i % 2 == 0 else "top",
            fontsize=8,
        )


def plot_front(
    title: str, front: Sequence[tuple[float, float]], path: str | Path, rows: Sequence[Row] = (), label: str = "front"
) -> Path:
    """Write a PNG of a front of ``(peak ratio, latency ratio)`` points (drawn as a step line),
    beside ``rows``' points, each labelled (both against eager)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 5))
    ax = fig.subplots()
    xs, ys = zip(*sorted(front)) if front else ((), ())
    ax.step(xs, ys, where="post", color="C0", marker=".", label=label, zorder=2)
    for i, row in enumerate(rows):
        ax.scatter(row.peak_ratio, row.latency_ratio, s=60, color=f"C{(i + 1) % 10}", zorder=3)
    if rows:
        _label_points(ax, list(rows))
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.axvline(1.0, color="black", linewidth=0.5)
    ax.set_title(title)
    ax.set_xlabel("peak memory / eager")
    ax.set_ylabel("latency / eager")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
