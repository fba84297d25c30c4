"""How many candidates each scheduling-based rule (MAGIS §5.2) proposes per workload.

For each of the seven workloads (one subprocess each): the captured training step on
fake tensors, its hot-spots in the captured order, the tensors saved past the peak
that the rules target, and the number of candidates of remat (cheap operators, and
with matmul/conv allowed), swap, Echo's compaction, and the dual rules (de-remat,
de-swap) on the graph after the first remat and swap candidate. Counts and simulated
bytes only: no timings (they are not figures on a shared machine).

    python experiments/rules.py [--preset paper|small|tiny] [--device h200] [--models bert-base,unet]
        [--out results/rules.json]
"""

from __future__ import annotations

import argparse
import json
import sys

from driver import measure_in_subprocess, write_json


def count_one(name: str, preset: str, device: str) -> dict:
    """Capture one workload in this process and count every rule's candidates."""
    from magis.cost.latency import cost_model
    from magis.cost.memory import simulate_memory
    from magis.frontend.capture import capture
    from magis.models import build_workload
    from magis.rules.compact import compact
    from magis.rules.remat import de_remat, remat
    from magis.rules.rewrite import Timeline, saved_tensors
    from magis.rules.swap import de_swap, swap

    built = build_workload(name, preset, None)
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    order = [n.name for n in graph.nodes]
    profile = simulate_memory(graph, order)
    rules = {
        "remat": remat(graph, order),
        "remat_heavy": remat(graph, order, heavy=True),
        "swap": swap(graph, order, cost_model(device)),
        "compact": compact(graph, order),
    }
    row = {
        "model": name,
        "preset": preset,
        "device": device,
        "nodes": len(graph),
        "peak_bytes": profile.peak,
        "hotspot_storages": len(profile.hotspots),
        "saved_past_peak": len(saved_tensors(graph, Timeline.of(graph, order))),
        "candidates": {rule: len(found) for rule, found in rules.items()},
        "largest_saving_bytes": {rule: max((c.saving for c in found), default=0) for rule, found in rules.items()},
    }
    first_remat = rules["remat"][0] if rules["remat"] else None
    first_swap = rules["swap"][0] if rules["swap"] else None
    row["candidates"]["de_remat_after_one_remat"] = len(de_remat(first_remat.graph)) if first_remat else 0
    row["candidates"]["de_swap_after_one_swap"] = len(de_swap(first_swap.graph)) if first_swap else 0
    row["candidates"]["de_remat_captured"] = len(de_remat(graph, order))
    return row


def main() -> None:
    from magis.models import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON file (default results/rules_<preset>.json)")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--device", default="h200", help="latency model that places swap Loads")
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: count one workload, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(count_one(args.one, args.preset, args.device)))
        return
    rows = []
    for name in args.models.split(","):
        print(f"[rules] {name} ({args.preset}) ...", file=sys.stderr, flush=True)
        row = measure_in_subprocess(__file__, name, "--preset", args.preset, "--device", args.device)
        rows.append(row)
        print(f"[rules] {name}: {row['nodes']} nodes, candidates {row['candidates']}", file=sys.stderr, flush=True)
    out = write_json(args.out or f"results/rules_{args.preset}.json", {"preset": args.preset, "workloads": rows})
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
