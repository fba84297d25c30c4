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
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from magis.analysis.dgraph import DGraph, build_dgraph
from magis.analysis.ftree import DEFAULT_LEVELS, Candidate, FTree, build_ftree
from magis.commands.common import add_device_argument, add_workload_arguments, emit, load_graph, log, positive_int
from magis.cost.latency import CostModel, cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.ir.graph import Graph
from magis.rules.separable import make_separable
from magis.schedule import schedule
from magis.search.single_fission import single_fissions

#: how many of the largest candidates name the operators that blocked them.
BLOCKED_SHOWN = 5


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
    report = survey(graph, cost_model(device), args.levels, args.schedule_seconds)
    if not args.json:  # the table shows n=2 and the best n; the JSON has every fission number tried
        report["candidates"] = [{k: v for k, v in row.items() if k != "outcomes"} for row in report["candidates"]]
    emit(
        {"model": args.model, "preset": args.preset, "device": device, "capture_seconds": capture_seconds, **report},
        args.json,
    )
    return 0


@dataclass(frozen=True)
class Outcome:
    """The simulated effect of enabling one candidate with ``parts`` parts."""

    parts: int
    peak_bytes: int
    latency_s: float


def survey(
    graph: Graph, model: CostModel, levels: int = DEFAULT_LEVELS, schedule_seconds: float = 10.0
) -> dict[str, Any]:
    """The report of ``magis fission``: baseline, F-Tree build time, and every candidate's outcomes.

    The baseline is ``graph`` in its lowest-peak order; the candidates are those of
    ``graph`` made separable along its samples (:func:`magis.rules.separable.make_separable`:
    the same values, with the loss no longer tying the samples together), ordered anew.
    """
    log(f"ordering {len(graph)} nodes for the lowest peak")
    baseline_order = schedule(graph, time_limit_s=schedule_seconds).order
    baseline_peak = simulate_memory(graph, baseline_order).peak
    baseline_latency = estimate_latency(graph, baseline_order, model).total_s
    graph = make_separable(graph)
    order = schedule(graph, time_limit_s=schedule_seconds).order
    profile = simulate_memory(graph, order)
    start = time.perf_counter()
    dgraph = build_dgraph(graph)
    tree = build_ftree(graph, profile, levels, dgraph=dgraph)
    ftree_seconds = time.perf_counter() - start
    log(f"F-Tree: {len(tree)} candidates in {ftree_seconds:.2f} s; simulating each")
    rows = [_row(graph, order, dgraph, tree, i, model) for i in range(len(tree))]
    largest = sorted(tree.candidates, key=lambda c: -len(c.nodes))[:BLOCKED_SHOWN]
    return {
        "nodes": len(graph),
        "dimensions": len(dgraph.dimensions),
        "baseline_peak_bytes": baseline_peak,
        "baseline_latency_s": baseline_latency,
        "separable_peak_bytes": profile.peak,
        "ftree_seconds": ftree_seconds,
        "blocked_by": dict(Counter(op for c in largest for op in c.blocked_by).most_common()),
        "candidates": rows,
    }


def _row(graph: Graph, order: tuple[str, ...], dgraph: DGraph, tree: FTree, i: int, model: CostModel) -> dict[str, Any]:
    candidate = tree.candidates[i]
    outcomes = outcomes_of(graph, order, dgraph, candidate, model)
    first = outcomes[0]
    best = min(outcomes, key=lambda o: (o.peak_bytes, o.latency_s))
    return {
        "index": i,
        "parent": candidate.parent,
        "dimension": candidate.label,
        "length": candidate.length,
        "nodes": len(candidate.nodes),
        "score": candidate.score,
        "n2_peak_bytes": first.peak_bytes,
        "n2_latency_s": first.latency_s,
        "n": best.parts,
        "simulated_peak_bytes": best.peak_bytes,
        "simulated_latency_s": best.latency_s,
        "blocked_by": list(candidate.blocked_by),
        "outcomes": [{"n": o.parts, "peak_bytes": o.peak_bytes, "latency_s": o.latency_s} for o in outcomes],
    }


def outcomes_of(
    graph: Graph, order: tuple[str, ...], dgraph: DGraph, candidate: Candidate, model: CostModel
) -> list[Outcome]:
    """Peak and latency with ``candidate`` enabled, for fission numbers 2 (or the smallest
    divisor of its length), 4, 8... (:func:`magis.search.single_fission.fission_numbers`)."""
    return [
        Outcome(option.parts, option.peak_bytes, estimate_latency(option.graph, option.order, model).total_s)
        for option in single_fissions(graph, order, dgraph, candidate)
    ]
