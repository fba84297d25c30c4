"""Incremental vs full rescheduling after local rewrites (MAGIS §7.3, Fig. 14).

For each of ``--graphs`` random NASNet-like graphs (``magis.models.random_graphs``):
schedule it fully once, then apply ``--rewrites`` random local rewrites one after
another, as the search does. After each rewrite the new graph is scheduled twice:
incrementally (MAGIS Alg. 2, from the previous graph and its incremental order)
and fully (``magis.schedule.schedule``). Reports the speed-up full/incremental and
whether the incremental order's peak equals the full one's. Floors: mean speed-up
>= 10x and the same peak in >= 94 of 100 tests (the paper: 10x on average, 94/100).

A rewrite is one of: ``remat`` (give one consumer of a node a recomputed copy of
it), ``resize`` (halve or double a node's output), ``insert`` (put an op on an
edge), ``remove`` (drop a single-input op whose output has its input's shape).
``touched`` is the nodes the rewrite added, removed or changed.

Timing: the graph's own IR caches (predecessors, consumers, storages), which every
pass shares and the search computes anyway to simulate a state, are built before
either scheduler is timed; each scheduler starts from its own copy of the graph.

    python experiments/incremental.py [--graphs 10] [--rewrites 10] [--cells 20] [--out results/incremental.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from driver import write_json

from magis.cost.memory import peak_memory
from magis.ir.graph import Graph, Ref, TensorMeta, map_refs
from magis.models.random_graphs import random_nasnet_graph
from magis.schedule import incremental_schedule, schedule

Rewrite = Callable[[Graph, random.Random], tuple[Graph, set[str]]]


def _redirect(graph: Graph, consumer: str, old: str, new: str) -> Graph:
    """A copy of ``consumer`` that reads ``new`` where it read ``old``."""
    node = graph[consumer]
    return dataclasses.replace(node, args=map_refs(node.args, lambda r: Ref(new) if r.name == old else r))


def _ops(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes if not n.is_input and n.role.value != "loss"]


def remat(graph: Graph, rng: random.Random) -> tuple[Graph, set[str]]:
    """Give one consumer of a multi-consumer node its own recomputed copy of it."""
    name = rng.choice([n for n in _ops(graph) if len(graph.consumers[n]) > 1])
    consumer = rng.choice(graph.consumers[name])
    copy = dataclasses.replace(graph[name], name=graph.fresh_name(f"{name}_re"))
    new = graph.replace(remove=[consumer], add=[copy, _redirect(graph, consumer, name, copy.name)])
    return new, {copy.name, consumer}


def resize(graph: Graph, rng: random.Random) -> tuple[Graph, set[str]]:
    """Halve or double the bytes of one node's output."""
    node = graph[rng.choice(_ops(graph))]
    meta = node.meta
    scaled = TensorMeta(meta.shape, meta.dtype, max(1, int(meta.nbytes * rng.choice((0.5, 2.0)))))
    return graph.replace(remove=[node.name], add=[dataclasses.replace(node, outputs=(scaled,))]), {node.name}


def insert(graph: Graph, rng: random.Random) -> tuple[Graph, set[str]]:
    """Put a new op with its input's shape on one edge."""
    name = rng.choice([n for n in _ops(graph) if graph.consumers[n]])
    consumer = rng.choice(graph.consumers[name])
    node = graph[name]
    op = dataclasses.replace(node, name=graph.fresh_name(f"{name}_op"), target="identity_op", args=(Ref(name),))
    new = graph.replace(remove=[consumer], add=[op, _redirect(graph, consumer, name, op.name)])
    return new, {op.name, consumer}


def remove(graph: Graph, rng: random.Random) -> tuple[Graph, set[str]]:
    """Drop an op with one input of the same shape; its consumers read that input instead."""
    candidates = [
        n
        for n in _ops(graph)
        if len(graph[n].inputs) == 1
        and graph[graph[n].inputs[0]].meta.shape == graph[n].meta.shape
        and graph.consumers[n]
        and n not in graph.outputs
    ]
    name = rng.choice(candidates)
    source = graph[name].inputs[0]
    return graph.replace(remove=[name], rename={name: source}), {name, *graph.consumers[name]}


REWRITES: dict[str, Rewrite] = {"remat": remat, "resize": resize, "insert": insert, "remove": remove}


def fresh(graph: Graph) -> Graph:
    """The same graph as a new object, its IR caches built (and no scheduler cache)."""
    copy = Graph(graph.nodes, graph.outputs, graph.signature, graph.order_edges)
    for facts in ("index", "predecessors", "successors", "consumers", "storages", "storage_bytes"):
        getattr(copy, facts)
    return copy


def run(graphs: int, rewrites: int, cells: int, time_limit: float) -> dict:
    tests = []
    for seed in range(graphs):
        rng = random.Random(seed)
        graph = random_nasnet_graph(cells, seed)
        order = list(schedule(graph, time_limit).order)
        for step in range(rewrites):
            kind = rng.choice(sorted(REWRITES))
            new, touched = REWRITES[kind](graph, rng)
            inc_graph, full_graph = fresh(new), fresh(new)
            start = time.perf_counter()
            inc_order = incremental_schedule(graph, order, inc_graph, touched, time_limit_s=time_limit)
            inc_s = time.perf_counter() - start
            start = time.perf_counter()
            full = schedule(full_graph, time_limit)
            full_s = time.perf_counter() - start
            assert new.is_schedule(inc_order), "incremental scheduling returned an invalid order"
            inc_peak = peak_memory(new, inc_order)
            tests.append(
                {
                    "graph": seed,
                    "rewrite": step,
                    "kind": kind,
                    "nodes": len(new),
                    "touched": len(touched),
                    "incremental_seconds": inc_s,
                    "full_seconds": full_s,
                    "speedup": full_s / inc_s,
                    "incremental_peak_bytes": inc_peak,
                    "full_peak_bytes": full.peak,
                    "peak_ratio": inc_peak / full.peak,
                    "same_peak": inc_peak == full.peak,
                }
            )
            print(
                f"[incremental] graph {seed} rewrite {step} ({kind}): {inc_s * 1e3:.1f} ms vs {full_s * 1e3:.1f} ms, "
                f"speed-up {full_s / inc_s:.1f}x, peak ratio {inc_peak / full.peak:.4f}",
                file=sys.stderr,
                flush=True,
            )
            graph, order = inc_graph, inc_order  # the search keeps the graph it scheduled
    speedups = [t["speedup"] for t in tests]
    same = sum(t["same_peak"] for t in tests)
    summary = {
        "tests": len(tests),
        "mean_speedup": statistics.mean(speedups),
        "median_speedup": statistics.median(speedups),
        "geomean_speedup": statistics.geometric_mean(speedups),
        "min_speedup": min(speedups),
        "same_peak": same,
        "worst_peak_ratio": max(t["peak_ratio"] for t in tests),
        "floor_mean_speedup_10x": statistics.mean(speedups) >= 10,
        "floor_same_peak_94_of_100": same >= 0.94 * len(tests),
    }
    config = {"graphs": graphs, "rewrites": rewrites, "cells": cells, "time_limit_s": time_limit}
    return {"config": config, "summary": summary, "tests": tests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", type=int, default=10)
    parser.add_argument("--rewrites", type=int, default=10)
    parser.add_argument("--cells", type=int, default=20, help="NASNet cells per graph (18 nodes each)")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per scheduling call")
    parser.add_argument("--out", default="results/incremental.json")
    args = parser.parse_args()
    report = run(args.graphs, args.rewrites, args.cells, args.time_limit)
    out = Path(args.out)
    write_json(out, report)
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
