"""Incremental scheduling after a graph mutation (MAGIS §6.1, Alg. 2).

Rescheduling a whole graph after every rewrite of the search is wasteful: a local
mutation only disturbs the schedule around it. :func:`incremental_schedule` keeps
the old schedule outside an interval around the mutated nodes and reschedules the
interval alone:

1. GetRescheduleInterval: the span of the mutated nodes in the old schedule, each
   end moved outward (at most ``MAX_EXTEND`` steps) to a narrow waist of the old
   graph, a node with nw ≤ ``GOOD_WAIST`` within ``NEAR`` steps, else the narrowest
   one in reach; a cut point (nw ≤ 1) ends the move at once.
2. The interval's nodes in the new graph (old ones still present, plus the new
   ones) form the middle of the new schedule; the interval widens until every edge
   of the new graph points forward.
3. GraphPartition: the middle is cut at its own narrow waists (nw ≤ 1) into pieces.
4. DpSchedule: each piece is ordered by Serenity's DP under soft budgeting; the
   pieces are spliced back between the old prefix and suffix.

The narrow waists of step 1 are computed on the reduced problem of a window of the
old schedule around the interval: only nodes inside it may move, and reachability
between two of them never leaves the window (a path runs through nodes scheduled
between its ends), so the cost is that of the window, not of the graph.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence

from magis.ir.graph import Graph
from magis.schedule.partition import split_at_waists, unit_waists
from magis.schedule.problem import segment_problem
from magis.schedule.scheduler import improve_pieces, place

MAX_EXTEND = 20  # steps an interval end may move outward
NEAR = 10  # within this many steps ...
GOOD_WAIST = 4  # ... an end stops at the first node at least this narrow


def incremental_schedule(
    old_graph: Graph,
    old_order: Sequence[str],
    new_graph: Graph,
    touched: Iterable[str],
    time_limit_s: float = 5.0,
) -> list[str]:
    """A schedule of ``new_graph`` that reuses ``old_order`` outside the region of the mutation.

    ``touched`` names the mutated nodes: added ones, removed ones and those whose
    inputs, outputs or sizes changed. A node of ``new_graph`` missing from
    ``old_order`` counts as touched.
    """
    deadline = time.perf_counter() + time_limit_s
    old_pos = {name: i for i, name in enumerate(old_order)}
    span = _touched_span(new_graph, old_pos, set(touched))
    lo, hi = (0, -1) if span is None else reschedule_interval(old_graph, old_order, *span)
    order, lo, hi = _splice(new_graph, old_order, old_pos, lo, hi)
    pos = {name: i for i, name in enumerate(order)}
    problem = segment_problem(new_graph, order, lo, hi, pos)
    units = problem.unit_order(order[lo:hi])
    place(order, lo, problem.nodes(units), pos)
    pieces = []
    start = lo + len(problem.inert)
    for piece in split_at_waists(units, unit_waists(problem)):
        pieces.append((start, start + sum(len(problem.units[u]) for u in piece)))
        start = pieces[-1][1]
    improve_pieces(new_graph, order, pieces, pos, deadline)
    return order


def _touched_span(new_graph: Graph, old_pos: dict[str, int], touched: set[str]) -> tuple[int, int] | None:
    """First and last old position of the mutated nodes (of their old neighbours, for new nodes alone).

    None when nothing was touched: the old order only needs the nodes that left dropped.
    """
    touched |= {name for name in new_graph.index if name not in old_pos}
    steps = [old_pos[name] for name in touched if name in old_pos]
    if not steps:  # only new nodes: anchor on their old neighbours
        present = [name for name in touched if name in new_graph]
        near = [v for name in present for v in (*new_graph.predecessors[name], *new_graph.successors[name])]
        steps = [old_pos[v] for v in near if v in old_pos]
    return (min(steps), max(steps)) if steps else None


def reschedule_interval(graph: Graph, order: Sequence[str], lo: int, hi: int) -> tuple[int, int]:
    """GetRescheduleInterval: ``[lo, hi]`` (inclusive) with both ends moved outward to narrow waists."""
    wlo, whi = max(0, lo - MAX_EXTEND), min(len(order), hi + MAX_EXTEND + 1)
    problem = segment_problem(graph, order, wlo, whi)
    waist = unit_waists(problem)
    node_waist = {name: waist[u] for u, names in enumerate(problem.units) for name in names}
    return _extend(order, node_waist, lo, -1, wlo), _extend(order, node_waist, hi, +1, whi - 1)


def _extend(order: Sequence[str], waist: dict[str, int], end: int, step: int, bound: int) -> int:
    best, best_waist = end, waist.get(order[end], len(order))
    for k in range(1, MAX_EXTEND + 1):
        i = end + step * k
        if (i - bound) * step > 0:
            return bound
        w = waist.get(order[i])  # inert nodes have none: they never bound an interval
        if w is None:
            continue
        if w <= 1 or (k <= NEAR and w <= GOOD_WAIST):
            return i
        if w < best_waist:
            best, best_waist = i, w
    return best


def _splice(
    graph: Graph, old_order: Sequence[str], old_pos: dict[str, int], lo: int, hi: int
) -> tuple[list[str], int, int]:
    """The old prefix and suffix around ``old_order[lo:hi+1]`` with the middle ordered for ``graph``.

    Widens ``[lo, hi]`` until no edge of ``graph`` points backward, then returns the
    order and the middle's range ``[start, stop)`` in it.
    """
    while True:
        widened = lo, hi
        for name, preds in graph.predecessors.items():
            at = old_pos.get(name)
            for p in preds:
                before = old_pos.get(p)
                if before is None:  # a new predecessor runs in the middle
                    if at is not None and at < lo:
                        lo = at
                elif at is None:  # a new node runs in the middle
                    hi = max(hi, before)
                elif before > at:  # an edge against the old order: both ends go into the middle
                    lo, hi = min(lo, at), max(hi, before)
        if (lo, hi) == widened:
            break
    prefix = [n for n in old_order[:lo] if n in graph.index]
    suffix = [n for n in old_order[hi + 1 :] if n in graph.index]
    middle = [n for n in old_order[lo : hi + 1] if n in graph.index]
    middle += [n for n in graph.index if n not in old_pos]
    return prefix + _topological(graph, middle, old_pos) + suffix, len(prefix), len(prefix) + len(middle)


def _topological(graph: Graph, names: list[str], old_pos: dict[str, int]) -> list[str]:
    """``names`` in a topological order of ``graph``, as close to the old order as the edges allow."""
    inside = set(names)
    indeg = {n: sum(p in inside for p in graph.predecessors[n]) for n in names}
    rank: dict[str, float] = {}
    for n in names:  # a new node ranks right after its latest old predecessor
        rank[n] = old_pos.get(n, max((old_pos.get(p, -1) for p in graph.predecessors[n]), default=-1) + 0.5)
    heap = [(rank[n], n) for n in names if indeg[n] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, n = heapq.heappop(heap)
        out.append(n)
        for s in graph.successors[n]:
            if s in indeg:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, (rank[s], s))
    return out
