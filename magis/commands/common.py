"""What every CLI command shares: its arguments and printing a report (progress lines,
tables and loading a workload come from :mod:`magis.console`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from magis.console import format_table, load_graph, load_workload, log
from magis.models import PRESETS

__all__ = [
    "add_device_argument",
    "add_inference_argument",
    "add_workload_arguments",
    "emit",
    "format_table",
    "load_graph",
    "load_workload",
    "log",
    "positive_int",
]


def add_workload_arguments(parser: argparse.ArgumentParser, presets: tuple[str, ...] = PRESETS) -> None:
    """MODEL, --preset, --batch and --json, the same for every command."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a workload name (see `magis models`), or your own as MODULE:FUNCTION (a module name or a .py "
        "file; FUNCTION() returns (model, batch) or (model, batch, training_step))",
    )
    parser.add_argument("--preset", choices=presets, default="tiny", help="workload size (default: tiny)")
    parser.add_argument("--batch", type=positive_int, default=None, help="batch size (default: the preset's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_inference_argument(parser: argparse.ArgumentParser) -> None:
    """--inference: the forward alone (a workload whose model returns no loss always is)."""
    parser.add_argument(
        "--inference",
        action="store_true",
        help="plan the model's forward alone, without gradients (optimize(..., inference=True)); "
        "an inference workload of `magis models` always is",
    )


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
