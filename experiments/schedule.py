"""Memory-optimal ordering on the seven paper-size training graphs and on random irregular graphs.

For every workload of ``magis.models.WORKLOADS`` (captured on fake tensors, one
subprocess each) and for 10 random graphs (5 NASNet-like, 5 RandWire-like, from
``magis.models.random_graphs``): the simulated peak of the captured order, of a
plain Kahn topological order (FIFO, ties in node order: what a framework without
memory-aware scheduling runs) and of :func:`magis.schedule.schedule`, and the
seconds scheduling took. Floors: magis is never worse than the captured order, and
every paper-size workload is scheduled in under 30 s. Writes JSON and a PNG bar
chart (peaks relative to the captured order) next to it.

    python experiments/schedule.py [--out results/schedule.json] [--models bert-base,unet] [--time-limit 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from driver import kahn_order, measure_in_subprocess, write_json

from magis.cost.memory import peak_memory
from magis.ir.graph import Graph
from magis.models.random_graphs import random_nasnet_graph, random_randwire_graph
from magis.schedule import schedule

PAPER_SECONDS = 30.0  # floor: a paper-size workload is scheduled in under this


def measure(name: str, graph: Graph, time_limit: float) -> dict:
    """Peaks of the captured, Kahn and magis orders of one graph, and the scheduling time."""
    result = schedule(graph, time_limit, progress=lambda m: print(f"[schedule] {name}: {m}", file=sys.stderr))
    captured = result.stats["captured_peak"]
    kahn = peak_memory(graph, kahn_order(graph))
    return {
        "graph": name,
        "nodes": len(graph),
        "captured_peak_bytes": captured,
        "kahn_peak_bytes": kahn,
        "magis_peak_bytes": result.peak,
        "magis_vs_captured": result.peak / captured,
        "magis_vs_kahn": result.peak / kahn,
        "seconds": result.seconds,
        "method": result.method,
        "stats": result.stats,
        "never_worse": result.peak <= captured,
    }


def measure_workload(name: str, time_limit: float) -> dict:
    """Capture a paper-size workload on fake tensors and :func:`measure` it (run in a subprocess)."""
    from magis.console import load_graph

    graph, capture_seconds = load_graph(name, "paper", None)
    row = measure(name, graph, time_limit)
    row.update(kind="workload", capture_seconds=capture_seconds, under_30s=row["seconds"] < PAPER_SECONDS)
    return row


def random_graphs() -> list[tuple[str, Graph]]:
    """Five NASNet-like and five RandWire-like graphs of a few hundred to a few thousand nodes."""
    nasnet = [
        (f"nasnet-{cells}c-s{seed}", random_nasnet_graph(cells, seed)) for seed, cells in enumerate((8, 16, 24, 40, 80))
    ]
    randwire = [
        (f"randwire-{n}-s{seed}", random_randwire_graph(n, seed)) for seed, n in enumerate((100, 200, 400, 800, 2000))
    ]
    return nasnet + randwire


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars: Kahn and magis peaks relative to the captured order, per graph."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["graph"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows)), 4.5))
    ax.bar([x - 0.2 for x in xs], [r["kahn_peak_bytes"] / r["captured_peak_bytes"] for r in rows], 0.4, label="Kahn")
    ax.bar([x + 0.2 for x in xs], [r["magis_vs_captured"] for r in rows], 0.4, label="magis (DP)")
    ax.axhline(1.0, color="black", linewidth=0.8, label="captured order")
    ax.set_xticks(list(xs), names, rotation=45, ha="right")
    ax.set_ylabel("peak memory / captured order's")
    ax.set_title("Operator ordering: simulated peak relative to the captured order")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from magis.models import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/schedule.json")
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per scheduling call (default: 20)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one workload, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_workload(args.one, args.time_limit)))
        return
    rows = []
    for name in filter(None, args.models.split(",")):
        print(f"[schedule] {name} (paper) ...", file=sys.stderr, flush=True)
        rows.append(measure_in_subprocess(__file__, name, "--time-limit", str(args.time_limit)))
        _report(rows[-1])
    for name, graph in random_graphs():
        rows.append({"kind": "random", **measure(name, graph, args.time_limit)})
        _report(rows[-1])
    workloads = [r for r in rows if r["kind"] == "workload"]
    summary = {
        "never_worse_than_captured": all(r["never_worse"] for r in rows),
        "workloads_under_30s": all(r["under_30s"] for r in workloads),
        "max_workload_seconds": max((r["seconds"] for r in workloads), default=0.0),
        "mean_magis_vs_captured": sum(r["magis_vs_captured"] for r in rows) / len(rows),
        "mean_magis_vs_kahn": sum(r["magis_vs_kahn"] for r in rows) / len(rows),
    }
    out = write_json(args.out, {"time_limit_s": args.time_limit, "summary": summary, "graphs": rows})
    plot(rows, out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


def _report(row: dict) -> None:
    print(
        f"[schedule] {row['graph']}: {row['nodes']} nodes, captured {row['captured_peak_bytes'] / 2**20:.1f} MiB, "
        f"Kahn {row['kahn_peak_bytes'] / 2**20:.1f} MiB, magis {row['magis_peak_bytes'] / 2**20:.1f} MiB "
        f"({row['magis_vs_captured']:.3f}x captured) in {row['seconds']:.1f} s",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    main()
