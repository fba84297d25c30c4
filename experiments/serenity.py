"""Serenity's evaluation (MLSys'20, §4, Fig. 9-11) on its own networks: inference plans of
irregularly wired networks, batch 1, the paper's input sizes.

For every inference workload of ``magis models`` (Serenity's Table 1: DARTS' ImageNet normal
cell network, SwiftNet cell A, RandWire on CIFAR-10 and CIFAR-100), built with random weights
at ``--preset`` (``paper``: batch 1) and captured forward-only
(:func:`magis.frontend.capture.capture_forward`, eval mode), the peak of live activations
(the simulated peak less the resident weights and input, the arena TensorFlow Lite sizes) of:

- ``pytorch``: the captured order, the order eager PyTorch runs the forward in;
- ``kahn``: Kahn's topological order, FIFO (TensorFlow Lite's stand-in, as in Serenity);
- ``serenity``: :func:`magis.schedule.schedule` (Serenity's DP under adaptive soft budgeting);
- ``serenity+rewrites``: the same after every identity rewrite (Serenity §3.3: channel-wise
  partitioning of a convolution over a concatenation, kernel-wise of a depthwise one), when it
  lowers the scheduled peak;
- ``all-rewrites``: the DP after every rewrite of magis that costs no time, applied wherever
  it can be (:func:`magis.rules.canonical.canonical`: concatenations moved past per-channel
  operators and partitioned, repeated operators computed once, multiply-adds, in-place
  operators), no search;
- ``magis``: ``magis.optimize(..., inference=True)`` in latency-limit mode (``--latency-limit``):
  the M-Optimizer's search (scheduling, fission, rewrites) on the same graph.

Each order is also run for real on this CPU (``--device cuda``: on the GPU, ``magis`` priced by
the ``--cost-model`` profile, h200 by default): measured peak (:mod:`magis.backend.meter`) against
simulated, outputs against eager's forward; ``magis``' plan is also timed against eager's forward
(:func:`yardstick.protocol.interleaved_timings`; its latency as planned is the one it was chosen
by: on a CPU timed beside eager's forward while planning, :mod:`magis.search.timed_choice`).
Unless ``--allocator default``, glibc's malloc keeps freed memory (:func:`driver.steady_allocator`),
for eager as for the plans: otherwise page faults make batch-1 timings bimodal.
Prints and writes, per network and on average, the
reduction factors (PyTorch's peak over each), and the identity rewrites' share (the factor with
rewrites over the factor without). Writes ``<out>/serenity-<preset>.json`` and ``.png``.

    python experiments/serenity.py [--preset paper] [--models darts-imagenet,...] [--time-limit 20]
                                   [--latency-limit 1.10] [--time-budget 60] [--device cpu|cuda]
                                   [--cost-model h200] [--allocator steady|default] [--out results/serenity]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from driver import kahn_order, steady_allocator, write_json

import magis
from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture_forward
from magis.ir.graph import Graph
from magis.models import PRESETS, ZOO, Built
from magis.rules.canonical import canonical
from magis.rules.identity import apply_concat_conv, apply_concat_depthwise, find_concat_conv, find_concat_depthwise
from magis.schedule import schedule
from yardstick.protocol import Estimate, interleaved_timings

ORDERS = ("pytorch", "kahn", "serenity", "serenity+rewrites", "all-rewrites", "magis")


def rewritten(graph: Graph) -> tuple[Graph, int]:
    """``graph`` after every identity rewrite Serenity §3.3 offers, applied until none is left,
    and how many were applied."""
    applied = 0
    while True:
        channel_wise, kernel_wise = find_concat_conv(graph), find_concat_depthwise(graph)
        if channel_wise:
            graph = apply_concat_conv(graph, channel_wise[0])
        elif kernel_wise:
            graph = apply_concat_depthwise(graph, kernel_wise[0])
        else:
            return graph, applied
        applied += 1


def measured_latency(model: torch.nn.Module, inputs: tuple, plan: magis.Plan, device: torch.device) -> dict:
    """magis' plan timed against eager's forward by the yardstick's protocol (rounds of eager,
    plan, eager; the trimmed mean of the plan's ratios, and its standard error)."""

    def timed(forward) -> Callable:
        def step(_context):
            with torch.no_grad():
                forward(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return step

    timings = interleaved_timings({"eager": timed(model), "magis": timed(plan)}, "eager")
    ratio = Estimate.trimmed_mean(timings["magis"].ratios)
    return {"ratio": ratio.value, "stderr": ratio.stderr, "rounds": len(timings["magis"].ratios)}


def measure_network(name: str, preset: str, args: argparse.Namespace) -> dict:
    """Every order of one network: simulated and measured activation peaks, output errors."""
    built: Built = ZOO[name].build(preset)
    model = built.model.to(args.device)
    inputs = tuple(x.to(args.device) if isinstance(x, torch.Tensor) else x for x in built.example_inputs)
    graph = capture_forward(model, inputs).graph
    plans: dict[str, tuple[Graph, tuple[str, ...]]] = {"pytorch": (graph, tuple(n.name for n in graph.nodes))}
    plans["kahn"] = (graph, tuple(kahn_order(graph)))
    plans["serenity"] = (graph, schedule(graph, args.time_limit).order)
    rewritten_graph, rewrites = rewritten(graph)
    with_rewrites = (rewritten_graph, schedule(rewritten_graph, args.time_limit).order)
    better = simulate_memory(*with_rewrites).peak < simulate_memory(*plans["serenity"]).peak
    plans["serenity+rewrites"] = with_rewrites if better else plans["serenity"]
    every = canonical(graph)
    plans["all-rewrites"] = (every, schedule(every, args.time_limit).order)
    plan = magis.optimize(
        model,
        inputs,
        inference=True,
        latency_limit=args.latency_limit,
        time_budget=args.time_budget,
        device=args.cost_model,
        progress=False,
    )
    plans["magis"] = (plan.graph, plan.order)
    rows = {}
    for order_name, (g, order) in plans.items():
        memory = simulate_memory(g, order)
        measured = measure_against_eager(g, order, model, inputs, None)
        rows[order_name] = {
            "simulated_peak_bytes": memory.peak,
            "activation_peak_bytes": memory.peak - memory.persistent_bytes,
            "measured_peak_bytes": measured["measured_peak_bytes"],
            "max_output_error": measured["max_output_error"],
        }
        print(
            f"[serenity] {name} {order_name}: activations {rows[order_name]['activation_peak_bytes'] / 2**20:.2f} MiB, "
            f"measured {measured['measured_peak_bytes']} B vs simulated {memory.peak} B",
            file=sys.stderr,
            flush=True,
        )
    base = rows["pytorch"]["activation_peak_bytes"]
    return {
        "network": name,
        "preset": preset,
        "nodes": len(graph),
        "eager_peak_bytes": measured["eager_peak_bytes"],
        "identity_rewrites": rewrites,
        "rewrites_kept": better,
        "magis_latency_ratio": plan.report().latency_ratio,
        "magis_timed": plan.report().search["timed"],  # what timing the plans nearest the choice decided
        "magis_measured_latency": measured_latency(model, inputs, plan, args.device),
        "magis_steps": [s.rule for s in plan.search.best.steps],
        "orders": rows,
        "reduction_vs_pytorch": {k: base / r["activation_peak_bytes"] for k, r in rows.items()},
        "reduction_vs_kahn": {
            k: rows["kahn"]["activation_peak_bytes"] / r["activation_peak_bytes"] for k, r in rows.items()
        },
        "measured_equals_simulated": all(r["measured_peak_bytes"] == r["simulated_peak_bytes"] for r in rows.values()),
    }


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars: each order's reduction factor over PyTorch's order, per network."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(7, 1.6 * len(rows)), 4.5))
    ax = fig.subplots()
    width = 0.8 / len(ORDERS)
    for i, order in enumerate(ORDERS):
        xs = [j + (i - (len(ORDERS) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r["reduction_vs_pytorch"][order] for r in rows], width, label=order)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r["network"] for r in rows])
    ax.set_ylabel("peak activation memory reduction (x, vs PyTorch's order)")
    ax.set_title("Inference, batch 1: Serenity's networks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    inference = [name for name, w in ZOO.items() if w.inference]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(inference), help="inference workloads (default: all)")
    parser.add_argument("--preset", choices=PRESETS, default="paper")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per scheduling call (default: 20)")
    parser.add_argument("--latency-limit", type=float, default=1.10, help="magis' latency limit (default: 1.10)")
    parser.add_argument("--time-budget", type=float, default=60.0, help="magis' search seconds (default: 60)")
    parser.add_argument("--device", default="cpu", help="where the orders run: cpu or cuda (default: cpu)")
    parser.add_argument(
        "--cost-model", default=None, help="magis' latency model (default: profiled on this CPU; h200 on cuda)"
    )
    parser.add_argument(
        "--allocator",
        choices=("steady", "default"),
        default="steady",
        help="glibc malloc keeping what is freed (driver.steady_allocator), or as it is (default: steady)",
    )
    parser.add_argument("--out", default="results/serenity")
    args = parser.parse_args()
    steady = args.allocator == "steady" and steady_allocator()
    args.device = torch.device(args.device)
    if args.cost_model is None and args.device.type == "cuda":
        args.cost_model = "h200"
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in inference]
    if unknown:
        parser.error(f"not an inference workload: {', '.join(unknown)} (choose from {', '.join(inference)})")
    torch.manual_seed(0)
    rows = [measure_network(n, args.preset, args) for n in names]
    summary = {
        f"mean_reduction_{order}": sum(r["reduction_vs_pytorch"][order] for r in rows) / len(rows) for order in ORDERS
    }
    summary["rewrites_share"] = summary["mean_reduction_serenity+rewrites"] / summary["mean_reduction_serenity"]
    summary["measured_equals_simulated"] = all(r["measured_equals_simulated"] for r in rows)
    summary["max_output_error"] = max(o["max_output_error"] for r in rows for o in r["orders"].values())
    summary["allocator"] = "steady" if steady else "default"
    out = write_json(Path(args.out) / f"serenity-{args.preset}.json", {"summary": summary, "networks": rows})
    plot(rows, out.with_suffix(".png"))
    for r in rows:
        factors = ", ".join(f"{k} {v:.2f}x" for k, v in r["reduction_vs_pytorch"].items())
        latency = r["magis_measured_latency"]
        print(
            f"{r['network']}: {r['nodes']} nodes; reduction vs PyTorch's order: {factors}; magis' latency "
            f"{r['magis_latency_ratio']:.3f} as planned, {latency['ratio']:.3f} ± {latency['stderr']:.3f} measured"
        )
    print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
