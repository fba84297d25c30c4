"""The best single fission under a memory limit: one F-Tree node enabled (MAGIS §4.3, §5.1).

The first level of the search of MAGIS Algorithm 3 restricted to fission: from the
F-Tree of a step made separable along its samples (:mod:`magis.rules.separable`),
every state with exactly one enabled node (the Enable rule, then Mutate through the
fission numbers), simulated in the order carried over from the step's schedule.

:func:`best_single_fission` picks, among the states whose simulated peak fits the
limit, the one with the fewest parts (the least overhead: fewer, larger kernels and
fewer partial results to add up), then the lowest peak; when none fits, the lowest
peak. It is what ``magis-fission`` runs in the yardstick (:mod:`yardstick.methods`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from magis.analysis.dgraph import DGraph, build_dgraph
from magis.analysis.ftrans import FTrans, InvalidFission
from magis.analysis.ftree import DEFAULT_LEVELS, Candidate, FTree, build_ftree, next_divisor
from magis.cost.latency import CostModel, estimate_latency
from magis.cost.memory import simulate_memory
from magis.ir.graph import Graph
from magis.rules.fission import fission, fissioned_order
from magis.rules.separable import make_separable
from magis.schedule import schedule

#: largest fission number tried for a candidate (beyond its smallest divisor).
MAX_PARTS = 64
#: how many of the largest candidates name the operators that blocked them (:func:`survey`).
BLOCKED_SHOWN = 5


@dataclass(frozen=True, eq=False)
class SingleFission:
    """A step with one region (or none: ``parts == 1``), its order and simulated peak."""

    graph: Graph
    order: tuple[str, ...]
    peak_bytes: int
    parts: int = 1
    candidate: Candidate | None = None


def fission_numbers(length: int) -> list[int]:
    """The powers of the smallest divisor of ``length`` that divide it, up to :data:`MAX_PARTS`
    (the smallest divisor itself even above it: a prime length such as ViT's 197 tokens)."""
    base = next_divisor(length, 1)
    numbers = []
    n = base
    while n is not None and (n <= MAX_PARTS or not numbers) and length % n == 0:
        numbers.append(n)
        n *= base
    return numbers


def single_fissions(
    graph: Graph, order: Sequence[str], dgraph: DGraph, candidate: Candidate
) -> Iterator[SingleFission]:
    """``graph`` with ``candidate`` enabled alone at each of its :func:`fission_numbers`,
    the region in place of its nodes in ``order``; fission numbers that do not fit are skipped."""
    for parts in fission_numbers(candidate.length):
        try:
            result = fission(graph, FTrans(candidate.axes, parts), dgraph)
        except InvalidFission:
            continue
        new_order = fissioned_order(graph, order, result, candidate.nodes)
        yield SingleFission(result, new_order, simulate_memory(result, new_order).peak, parts, candidate)


def best_single_fission(
    graph: Graph, order: Sequence[str], limit_bytes: int, levels: int = DEFAULT_LEVELS
) -> SingleFission:
    """The fewest-parts single fission of ``make_separable(graph)`` whose simulated peak is at
    most ``limit_bytes`` (ties: the lowest peak), else the lowest-peak one; ``graph`` in
    ``order`` when its F-Tree offers nothing better. ``order`` is a schedule of ``graph``."""
    return choose_within(single_fission_options(graph, order, levels), limit_bytes)


def single_fission_options(graph: Graph, order: Sequence[str], levels: int = DEFAULT_LEVELS) -> list[SingleFission]:
    """``graph`` in ``order`` unchanged, then every single fission of ``make_separable(graph)``
    its F-Tree offers (each candidate at each of its :func:`fission_numbers`)."""
    options = [SingleFission(graph, tuple(order), simulate_memory(graph, order).peak)]
    step = separable_step(graph, order, levels)
    for candidate in step.tree.candidates:
        options.extend(single_fissions(step.graph, step.order, step.dgraph, candidate))
    return options


@dataclass(frozen=True, eq=False)
class SeparableStep:
    """``make_separable(graph)``, a schedule of it, its D-Graph and its F-Tree (all disabled)."""

    graph: Graph
    order: tuple[str, ...]
    dgraph: DGraph
    tree: FTree


def separable_step(graph: Graph, order: Sequence[str], levels: int = DEFAULT_LEVELS) -> SeparableStep:
    """The step made separable along its samples, ``order`` carried over to it, and the
    F-Tree Algorithm 1 builds from the hot-spots of that order: where MAGIS' search starts."""
    separable = make_separable(graph)
    separable_order = carried_order(graph, order, separable)
    dgraph = build_dgraph(separable)
    tree = build_ftree(separable, simulate_memory(separable, separable_order), levels, dgraph=dgraph)
    return SeparableStep(separable, separable_order, dgraph, tree)


def choose_within(options: Sequence[SingleFission], limit_bytes: int) -> SingleFission:
    """The option with the fewest parts whose peak fits ``limit_bytes`` (ties: the lowest
    peak); the lowest-peak option when none fits."""
    fitting = [o for o in options if o.peak_bytes <= limit_bytes]
    if fitting:
        return min(fitting, key=lambda o: (o.parts, o.peak_bytes))
    return min(options, key=lambda o: (o.peak_bytes, o.parts))


def carried_order(graph: Graph, order: Sequence[str], rewritten: Graph) -> tuple[str, ...]:
    """``order`` carried over to ``rewritten`` (nodes it kept keep their places; new ones go
    right before the first kept node that reads them, or where the node list puts them)."""
    kept = [name for name in order if name in rewritten]
    position = {name: i for i, name in enumerate(kept)}
    slots: dict[int, list[str]] = {}
    for node in rewritten.nodes:
        if node.name in position:
            continue
        readers = [position[c] for c in _kept_readers(rewritten, node.name, position)]
        slots.setdefault(min(readers, default=len(kept)), []).append(node.name)
    carried = [name for i, name in enumerate(kept) for name in (*slots.get(i, ()), name)]
    carried += slots.get(len(kept), [])
    rewritten.check_schedule(carried)
    return tuple(carried)


def _kept_readers(graph: Graph, name: str, kept: dict[str, int]) -> Iterator[str]:
    """The kept nodes that read ``name``, directly or through new nodes."""
    stack, seen = [name], set()
    while stack:
        for reader in graph.successors[stack.pop()]:
            if reader in kept:
                yield reader
            elif reader not in seen:
                seen.add(reader)
                stack.append(reader)


# ------------------------------------------------------------------ survey
@dataclass(frozen=True)
class Outcome:
    """The simulated effect of enabling one candidate with ``parts`` parts."""

    parts: int
    peak_bytes: int
    latency_s: float


def survey(
    graph: Graph,
    model: CostModel,
    levels: int = DEFAULT_LEVELS,
    schedule_seconds: float = 10.0,
    progress: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """The report of ``magis fission``: baseline, F-Tree build time, and every candidate's outcomes.

    The baseline is ``graph`` in its lowest-peak order; the candidates are those of
    ``graph`` made separable along its samples (:func:`magis.rules.separable.make_separable`:
    the same values, with the loss no longer tying the samples together), ordered anew.
    ``progress`` receives a line at each stage.
    """
    progress = progress or (lambda _: None)
    progress(f"ordering {len(graph)} nodes for the lowest peak")
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
    progress(f"F-Tree: {len(tree)} candidates in {ftree_seconds:.2f} s; simulating each")
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
    divisor of its length), 4, 8... (:func:`fission_numbers`)."""
    return [
        Outcome(option.parts, option.peak_bytes, estimate_latency(option.graph, option.order, model).total_s)
        for option in single_fissions(graph, order, dgraph, candidate)
    ]
