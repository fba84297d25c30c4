"""Plots of the memory-latency plane: a front of plans beside labelled points (peers, or
methods of a comparison), every ratio against eager PyTorch. matplotlib is optional: import
this module only where a plot is asked for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from matplotlib.axes import Axes
from matplotlib.figure import Figure


class Point(Protocol):
    """A labelled point of the plane (a yardstick row has these three)."""

    method: str
    peak_ratio: float
    latency_ratio: float


def plot_front(
    title: str, front: Sequence[tuple[float, float]], path: str | Path, rows: Sequence[Point] = (), label: str = "front"
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
        label_points(ax, rows)
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


def label_points(ax: Axes, rows: Sequence[Point]) -> None:
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
