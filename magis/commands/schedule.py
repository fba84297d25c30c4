"""``magis schedule MODEL``: a memory-optimal operator order for a workload's training step
(``--inference``: its forward alone, as Serenity schedules an inference).

Captures the workload and runs :func:`magis.schedule.schedule` (Serenity's DP on
narrow-waist pieces under adaptive soft budgeting); prints the simulated peak of
the captured order and of the optimized one, and the seconds it took.
"""

from __future__ import annotations

import argparse

from magis.commands.common import add_inference_argument, add_workload_arguments, emit, load_graph, log
from magis.schedule import schedule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_inference_argument(parser)
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds the scheduler may take (default: 20)")


def run(args: argparse.Namespace) -> int:
    if args.time_limit <= 0:
        raise ValueError(f"--time-limit must be positive, got {args.time_limit}")
    graph, capture_seconds = load_graph(args.model, args.preset, args.batch, args.inference)
    log(f"scheduling {len(graph)} nodes (at most {args.time_limit:g} s)")
    result = schedule(graph, args.time_limit, progress=log)
    captured = result.stats["captured_peak"]
    report = {
        "model": args.model,
        "preset": args.preset,
        "step": "inference" if graph.signature.inference else "training",
        "nodes": len(graph),
        "captured_peak_bytes": captured,
        "optimized_peak_bytes": result.peak,
        "reduction": 1 - result.peak / captured if captured else 0.0,
        "seconds": result.seconds,
        "capture_seconds": capture_seconds,
        "method": result.method,
        **{k: v for k, v in result.stats.items() if k != "captured_peak"},
    }
    emit(report, args.json)
    return 0
