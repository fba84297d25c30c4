"""Recomputation alone against the recompute baselines: the greedy front of recompute-only plans.

For each of the seven workloads (one subprocess each): the front of recompute-only
plans the greedy of :func:`magis.search.rule_front.recompute_front` reaches from the
captured step in its memory-optimal order (Echo's cheap operators first, matrix
products and convolutions where they pay), beside the yardstick's recompute
baselines from :mod:`yardstick.methods`: ``checkpoint-block``, ``checkpoint-sqrt``
and ``compile@B`` (torch.compile's min-cut partitioner under an activation memory
budget B). Everything is simulated: magis' memory simulator and the ``--device``
profile's latency model (``h200`` by default), peaks and latencies as ratios to
eager's (the captured step in captured order).

Per workload: the lowest peak within 10% and 30% latency overhead (of the front, and of
the greedy given that latency as its limit, as ``magis remat --latency-limit`` runs it:
where a round's batch crosses the limit, its prefix at the limit), and the floor of the
issue: for every ``compile@B`` point, the front's lowest peak at no more
latency and the lowest peak of the greedy given compile's latency as its limit (as
``magis remat --latency-limit`` runs it: where a round's batch crosses the limit, its
prefix at the limit), and whether the lower of the two is no higher than compile's. Writes
``<out>/<workload>-<preset>.json`` and ``.png`` (the front and the baselines' points)
and ``<out>/summary.json``; prints the table.

The default preset is ``paper`` (Table 2 of the MAGIS paper, on fake tensors: simulated
only). ``--presets small`` adds the small models, simulated the same way, each front
point also run for real on this machine (measured peak of live tensors, largest
gradient difference from eager PyTorch). No timings are taken: simulated figures
only, so a loaded machine changes how far the greedy gets in ``--time-budget``, not
the figures of the points it reaches.

    python experiments/remat_front.py [--models bert-base,unet] [--presets paper,small] [--device h200]
        [--time-budget 300] [--max-ops 4] [--out results/remat]

The summary reads every ``<workload>-<preset>.json`` in ``--out``, so workloads can be run
by separate invocations (``--models ""`` only prints the summary).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from driver import measure_in_subprocess, write_json

#: the baselines recomputation is compared with
BASELINES = ("checkpoint-block", "checkpoint-sqrt", "compile")
#: latency overheads under which the summary takes the front's lowest peak
OVERHEADS = (0.10, 0.30)
#: the greedy stops once a point is this much slower than eager (past every baseline's point)
LATENCY_LIMIT = 1.40


def front_of(name: str, preset: str, device: str, time_budget: float, max_ops: int, out: Path) -> dict[str, Any]:
    """The recompute-only front of one workload and the baselines' points, in this process
    (its PNG written to ``out``)."""
    from magis.api import measure_against_eager
    from magis.cost.latency import cost_model, estimate_latency
    from magis.cost.memory import simulate_memory
    from magis.plots import plot_front
    from magis.search.rule_front import recompute_front
    from yardstick.compare import Row, best_within, compare
    from yardstick.methods import MAGIS, Subject

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = cost_model(device)
    subject = Subject(name, preset)
    graph, captured = subject.graph, [n.name for n in subject.graph.nodes]
    peak, latency = simulate_memory(graph, captured).peak, estimate_latency(graph, captured, model).total_s
    limit = LATENCY_LIMIT * latency
    result = recompute_front(graph, model, max_ops=max_ops, time_budget=time_budget, latency_limit_s=limit)
    front = []
    for point in result.points:
        row = {
            "peak_bytes": point.peak_bytes,
            "latency_s": point.latency_s,
            "peak_ratio": point.peak_bytes / peak,
            "latency_ratio": point.latency_s / latency,
            "recomputed": list(point.recomputed),
        }
        if preset != "paper":  # real weights: run the plan
            built = subject.built
            measured = measure_against_eager(point.graph, point.order, built.model, built.example_inputs, built.loss_fn)
            row |= {k: measured[k] for k in ("measured_peak_bytes", "max_grad_error")}
        front.append(row)
    peers = compare(name, preset, BASELINES, simulate=True, device=device).rows
    as_rows = [
        Row(f"front #{i}", r["peak_bytes"], r["latency_s"], r["peak_ratio"], r["latency_ratio"], False, MAGIS)
        for i, r in enumerate(front)
    ]

    def at_limit(latency_ratio: float) -> dict[str, float] | None:
        """The lowest point of the greedy given ``latency_ratio`` as its limit (``magis remat
        --latency-limit``), which finds the prefix of a batch at that limit where the
        unlimited front passes over it, as ratios to eager's."""
        limited = recompute_front(
            graph, model, max_ops=max_ops, time_budget=time_budget, latency_limit_s=latency_ratio * latency
        )
        within = [p for p in limited.points if p.latency_s <= latency_ratio * latency]
        lowest = min(within, key=lambda p: p.peak_bytes, default=None)
        return None if lowest is None else ratios(lowest.peak_bytes / peak, lowest.latency_s / latency)

    def ratios(peak_ratio: float, latency_ratio: float) -> dict[str, float]:
        return {"peak_ratio": peak_ratio, "latency_ratio": latency_ratio}

    def lower(*points: dict[str, float] | None) -> dict[str, float] | None:
        return min(filter(None, points), key=lambda p: p["peak_ratio"], default=None)

    best = {}
    for overhead in OVERHEADS:
        reached = best_within(as_rows, overhead, kind=MAGIS)
        on_front = None if reached is None else ratios(reached.peak_ratio, reached.latency_ratio)
        best[f"{overhead:.0%}"] = lower(on_front, at_limit(1.0 + overhead))
    floor = {}
    for peer in (r for r in peers if r.method.startswith("compile@")):
        reached = best_within(as_rows, peer.latency_ratio - 1.0, kind=MAGIS)
        limited = at_limit(peer.latency_ratio)
        best_peak = lower(limited, None if reached is None else ratios(reached.peak_ratio, reached.latency_ratio))
        floor[peer.method] = {
            "compile_peak_ratio": peer.peak_ratio,
            "compile_latency_ratio": peer.latency_ratio,
            "front_peak_ratio": None if reached is None else reached.peak_ratio,
            "at_limit_peak_ratio": None if limited is None else limited["peak_ratio"],
            "met": best_peak is not None and best_peak["peak_ratio"] <= peer.peak_ratio,
        }
    stem = f"{name}-{preset}"
    plot_front(
        f"{name} ({preset}, simulated, {device}): recompute-only front",
        [(r["peak_ratio"], r["latency_ratio"]) for r in front],
        out / f"{stem}.png",
        [r for r in peers if r.method != "eager"],
        label="magis recompute-only (greedy)",
    )
    return {
        "model": name,
        "preset": preset,
        "device": device,
        "nodes": len(graph),
        "baseline_peak_bytes": peak,
        "baseline_latency_s": latency,
        "greedy": {"rounds": len(result.visited) - 1, "stopped_by": result.stopped_by, "seconds": result.seconds},
        "best_within": best,
        "floor": floor,
        "baselines": [
            {"method": r.method, "peak_ratio": r.peak_ratio, "latency_ratio": r.latency_ratio} for r in peers
        ],
        "front": front,
    }


def summary_row(result: dict[str, Any]) -> dict[str, str]:
    """One line of the table: the front's best within each overhead, compile's points and the
    front's answer to each, the checkpointing points."""

    def point(p: dict[str, float] | None) -> str:
        return "-" if p is None else f"{p['peak_ratio']:.3f} @{p['latency_ratio']:.3f}"

    row = {"model": result["model"], "preset": result["preset"]}
    row |= {f"front <={k}": point(p) for k, p in result["best_within"].items()}
    for method, f in result["floor"].items():
        answer = "-" if f["front_peak_ratio"] is None else f"{f['front_peak_ratio']:.3f}"
        if f.get("at_limit_peak_ratio") is not None:
            answer += f" / {f['at_limit_peak_ratio']:.3f} at its latency"
        row[method] = f"{f['compile_peak_ratio']:.3f} @{f['compile_latency_ratio']:.3f} vs {answer}" + (
            "" if f["met"] else " NOT MET"
        )
    for b in result["baselines"]:
        if b["method"].startswith("checkpoint"):
            row[b["method"]] = point(b)
    return row


def main() -> int:
    from magis.models import WORKLOADS
    from magis.rules.remat import MAX_OPS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/remat"), help="results folder")
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--presets", default="paper", help="paper (simulated), small (simulated, fronts run too)")
    parser.add_argument("--device", default="h200", help="device profile of the simulated latencies")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds of greedy per workload")
    parser.add_argument(
        "--max-ops", type=int, default=MAX_OPS, help=f"operators one recomputation may copy (default {MAX_OPS})"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one workload, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(front_of(args.one, args.presets, args.device, args.time_budget, args.max_ops, args.out)))
        return 0
    presets = args.presets.split(",")
    for preset in presets:
        for name in filter(None, args.models.split(",")):
            print(f"[remat] {name} ({preset}) ...", file=sys.stderr, flush=True)
            options = ["--presets", preset, "--device", args.device, "--time-budget", str(args.time_budget)]
            options += ["--max-ops", str(args.max_ops)]
            result = measure_in_subprocess(__file__, name, *options, "--out", str(args.out))
            write_json(args.out / f"{name}-{preset}.json", result)
            print(f"[remat] {name}: {summary_row(result)}", file=sys.stderr, flush=True)
    done = [args.out / f"{name}-{preset}.json" for preset in presets for name in WORKLOADS]
    rows = [summary_row(json.loads(path.read_text())) for path in done if path.exists()]
    write_json(args.out / "summary.json", rows)
    print("peak ratio @latency ratio against eager; compile@B: its point vs the front's lowest peak, no slower")
    for row in rows:
        print("  ".join(f"{k}: {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
