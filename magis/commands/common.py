"""What every CLI command shares: loading a workload, capturing it, printing a report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from magis.frontend.capture import capture_timed
from magis.ir.graph import Graph
from magis.models import PRESETS, build_workload


def add_workload_arguments(parser: argparse.ArgumentParser, presets: tuple[str, ...] = PRESETS) -> None:
    """MODEL, --preset, --batch and --json, the same for every command."""
    parser.add_argument("model", metavar="MODEL", help="a workload name (see `magis models`)")
    parser.add_argument("--preset", choices=presets, default="tiny", help="model size (default: tiny)")
    parser.add_argument("--batch", type=positive_int, default=None, help="batch size (default: the preset's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """--device: the latency cost model."""
    parser.add_argument(
        "--device",
        default=None,
        help="latency cost model: cpu/cuda (profiled here) or a device profile (h200, h100, a100, rtx3090); "
        "default: this machine, or h200 for the paper preset",
    )


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


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


def emit(report: dict[str, Any], as_json: bool) -> None:
    """Print a report: one JSON object, or aligned ``key: value`` lines (lists as tables)."""
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    for key, value in report.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            print(f"{key}:")
            print(format_table(value))
        else:
            print(f"{key:>24}: {format_value(key, value)}")


def format_value(key: str, value: Any) -> str:
    if isinstance(value, int) and key.endswith("bytes"):
        return f"{value} ({value / 2**20:.1f} MiB)"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


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
