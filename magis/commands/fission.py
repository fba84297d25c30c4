"""``magis fission MODEL``: the F-Tree's fission candidates of a workload (MAGIS §4.3).

Captures the workload, orders it for the lowest peak (:func:`magis.schedule.schedule`),
makes it separable along its samples (:mod:`magis.rules.separable`: the backward
seeded by a constant, the mean loss normalised by a count of the labels, dropout
masks drawn ahead), builds the F-Tree from its memory hot-spots (Algorithm 1) and, for every
candidate, simulates the graph with that one node enabled: at the smallest fission
number and at the best one (the lowest peak, then the lowest latency). It also
names the operators without a dimension rule that cut the largest candidates short.
"""

from __future__ import annotations

import argparse

from magis.analysis.ftree import DEFAULT_LEVELS
from magis.commands.common import add_device_argument, add_workload_arguments, emit, load_graph, log, positive_int
from magis.cost.latency import cost_model
from magis.search.single_fission import survey


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--levels", type=positive_int, default=DEFAULT_LEVELS, help="F-Tree levels L (default: 4)")
    parser.add_argument(
        "--schedule-seconds",
        type=float,
        default=10.0,
        help="time for ordering the original graph for its lowest peak (default: 10)",
    )


def run(args: argparse.Namespace) -> int:
    graph, capture_seconds = load_graph(args.model, args.preset, args.batch)
    device = args.device or ("h200" if args.preset == "paper" else "cpu")
    report = survey(graph, cost_model(device), args.levels, args.schedule_seconds, progress=log)
    if not args.json:  # the table shows n=2 and the best n; the JSON has every fission number tried
        report["candidates"] = [{k: v for k, v in row.items() if k != "outcomes"} for row in report["candidates"]]
    emit(
        {"model": args.model, "preset": args.preset, "device": device, "capture_seconds": capture_seconds, **report},
        args.json,
    )
    return 0
