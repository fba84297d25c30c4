"""Capture + simulate the seven paper-size training graphs on fake tensors.

For each workload (one subprocess each, so peak RSS is the workload's own):
node count, capture and simulation seconds, simulated peak of the captured order,
and the process's peak resident memory. Targets on a 2-core machine: under 60 s
and under 4 GiB RSS per workload.

    python experiments/capture.py [--out results/capture.json] [--models bert-base,unet]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from driver import measure_in_subprocess, write_json


def measure_one(name: str, preset: str) -> dict:
    """Build, capture and simulate one workload in this process."""
    from magis.cost.memory import simulate_memory
    from magis.frontend.capture import capture_timed
    from magis.models import build_workload

    start = time.perf_counter()
    built = build_workload(name, preset, None)
    build_s = time.perf_counter() - start
    captured = capture_timed(built.model, built.example_inputs, built.loss_fn)
    sim_start = time.perf_counter()
    graph = captured.graph
    memory = simulate_memory(graph, [n.name for n in graph.nodes])
    simulate_s = time.perf_counter() - sim_start
    return {
        "model": name,
        "preset": preset,
        "nodes": len(graph),
        "weight_bytes": graph.summary()["weight_bytes"],
        "build_seconds": build_s,
        "capture_seconds": captured.seconds,
        "simulate_seconds": simulate_s,
        "capture_simulate_seconds": captured.seconds + simulate_s,
        "simulated_peak_bytes": memory.peak,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    from magis.models import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/capture.json")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one workload, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.preset)))
        return
    rows = []
    for name in args.models.split(","):
        print(f"[capture] {name} ({args.preset}) ...", file=sys.stderr, flush=True)
        row = measure_in_subprocess(__file__, name, "--preset", args.preset)
        row["under_60s"] = row["capture_simulate_seconds"] < 60
        row["under_4GiB_rss"] = row["peak_rss_bytes"] < 4 * 2**30
        rows.append(row)
        print(
            f"[capture] {name}: {row['nodes']} nodes, capture+simulate {row['capture_simulate_seconds']:.1f} s, "
            f"simulated peak {row['simulated_peak_bytes'] / 2**30:.2f} GiB, "
            f"RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
    out = write_json(args.out, {"preset": args.preset, "workloads": rows})
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
