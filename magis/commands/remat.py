"""``magis remat MODEL``: the peak/latency front of recompute-only (or swap-only) plans.

Captures the workload's training step and runs the greedy of
:mod:`magis.search.rule_front` over MAGIS' scheduling-based rules (§5.2): from the step
in its memory-optimal order, the recomputation (``--swap``: the swap) that lowers the
peak most per second it adds, again and again, every step a point; prints the Pareto
front of those points. Swapping needs a device whose memory is not host memory: with
``--swap``, a ``cpu`` cost model is an error (use ``--device h200``, or ``cuda``).
``--run`` (tiny and small presets) runs every plan of the front with the magis runtime
and eager PyTorch from the same seed: measured peak and largest gradient difference.
"""

from __future__ import annotations

import argparse
from typing import Any

from magis.api import measure_against_eager
from magis.commands.common import add_device_argument, add_workload_arguments, emit, load_workload, log, positive_int
from magis.cost.latency import cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.rules.remat import MAX_OPS
from magis.search.rule_front import DEFAULT_TIME_BUDGET_S, recompute_front, require_device_memory, swap_front


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--swap", action="store_true", help="swap-only plans instead of recompute-only ones")
    parser.add_argument(
        "--cheap-only",
        action="store_true",
        help="recompute only cheap operators (pointwise, normalisation, softmax, views), never matmul/conv",
    )
    parser.add_argument(
        "--max-ops",
        type=positive_int,
        default=MAX_OPS,
        help=f"operators one recomputation may copy, a segment's length (default: {MAX_OPS})",
    )
    parser.add_argument(
        "--latency-limit",
        type=float,
        default=None,
        help="stop once a plan is this many times slower than the captured step (default: no limit)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        help=f"seconds of greedy search (default: {DEFAULT_TIME_BUDGET_S:g})",
    )
    parser.add_argument("--run", action="store_true", help="run every plan of the front and eager PyTorch, measure")
    parser.add_argument("--plot", metavar="F.png", default=None, help="write the front to this PNG")


def run(args: argparse.Namespace) -> int:
    if args.run and args.preset == "paper":
        raise ValueError("--run needs real weights: the paper preset is traced on fake tensors; use tiny or small")
    device = args.device or ("h200" if args.preset == "paper" else "cpu")
    model = cost_model(device)
    if args.swap:
        require_device_memory(model)  # before the capture: a CPU cost model is a bad option
    built = load_workload(args.model, args.preset, args.batch)
    log(f"capturing {args.model} ({args.preset})")
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    captured = [n.name for n in graph.nodes]
    peak = simulate_memory(graph, captured).peak
    latency = estimate_latency(graph, captured, model).total_s
    limit = None if args.latency_limit is None else args.latency_limit * latency
    log(f"{len(graph)} nodes; greedy over the {'swap' if args.swap else 'remat'} rule")
    if args.swap:
        result = swap_front(graph, model, None, args.time_budget, latency_limit_s=limit, progress=not args.json)
    else:
        heavy = not args.cheap_only
        result = recompute_front(
            graph, model, None, heavy, args.max_ops, args.time_budget, latency_limit_s=limit, progress=not args.json
        )
    front: list[dict[str, Any]] = []
    for i, point in enumerate(result.points):
        row: dict[str, Any] = {
            "peak_bytes": point.peak_bytes,
            "latency_s": point.latency_s,
            "peak_ratio": point.peak_bytes / peak,
            "latency_ratio": point.latency_s / latency,
            "recomputed": list(point.recomputed),
            "swapped": list(point.swapped),
            "merged": list(point.merged),  # duplicate operators merged before the first round
        }
        if args.run:
            log(f"running plan {i + 1}/{len(result.points)} and eager PyTorch")
            measured = measure_against_eager(point.graph, point.order, built.model, built.example_inputs, built.loss_fn)
            row |= {key: measured[key] for key in ("measured_peak_bytes", "max_grad_error")}
        front.append(row)
    report: dict[str, Any] = {
        "model": args.model,
        "preset": args.preset,
        "device": device,
        "rule": "swap" if args.swap else "remat",
        "baseline_peak_bytes": peak,
        "baseline_latency_s": latency,
        "rounds": len(result.visited) - 1,
        "stopped_by": result.stopped_by,
        "front": front,
    }
    if args.plot:
        from magis.plots import plot_front  # matplotlib is optional

        points = [(r["peak_ratio"], r["latency_ratio"]) for r in front]
        title = f"{args.model} ({args.preset}, simulated, {device}): {report['rule']}-only front"
        report["plot"] = str(plot_front(title, points, args.plot, label=f"{report['rule']}-only (greedy)"))
    if not args.json:  # the table counts the tensors; the JSON names them
        report["front"] = [{**r, "recomputed": len(r["recomputed"]), "swapped": len(r["swapped"])} for r in front]
    emit(report, args.json)
    return 0
