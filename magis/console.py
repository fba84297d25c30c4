"""What bench scripts and the command line print: timestamped progress lines on
stderr, plain text tables, and a workload captured with progress."""

from __future__ import annotations

import sys
import time
from typing import Any

from magis.frontend.capture import capture_timed
from magis.ir.graph import Graph
from magis.models import build_workload


def log(message: str) -> None:
    """Progress goes to stderr so that --json output stays parseable."""
    print(f"[magis {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_graph(name: str, preset: str, batch: int | None) -> tuple[Graph, float]:
    """Build and capture a workload's training step: the graph and the capture seconds."""
    log(f"building {name} ({preset})")
    built = build_workload(name, preset, batch)
    log(f"capturing {name} ({preset})")
    captured = capture_timed(built.model, built.example_inputs, built.loss_fn)
    log(f"captured {len(captured.graph)} nodes in {captured.seconds:.1f} s")
    return captured.graph, captured.seconds


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain text table of dict rows with the same keys."""
    keys = list(rows[0])
    cells = [[format_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)[:40]
    return str(value)
