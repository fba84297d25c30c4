"""Divide and conquer for ordering (Serenity §3.2; MAGIS §6.1 narrow waists).

The narrow-waist value nw(v) = |V| - |anc(v)| - |des(v)| - 1 counts the nodes that
may run on either side of v. nw(v) = 0 splits the ordering problem into two
independent halves: everything before v is an ancestor, everything after a
descendant. Nodes with nw ≤ 1 are the partition points of MAGIS's GraphPartition
(with nw = 1 the one free node goes to the side the reference order puts it on).

On a training graph the raw values are useless: a parameter is incomparable with
almost every node. The partitioner therefore computes them on the reduced problem
of :mod:`magis.schedule.problem` (inert nodes left out, views merged into their
producer: both exact reductions), where the forward pass becomes a chain of waists.
Ancestor sets are int bitsets built along a topological order.
"""

from __future__ import annotations

from collections.abc import Sequence

from magis.ir.graph import Graph
from magis.schedule.problem import OrderingProblem, bits


def waist_values(preds: Sequence[int]) -> list[int]:
    """nw of every node of a DAG given as predecessor bitsets, nodes numbered topologically."""
    n = len(preds)
    anc = [0] * n
    for v, mask in enumerate(preds):
        anc[v] = mask
        for u in bits(mask):
            anc[v] |= anc[u]
    des = [0] * n
    for v in range(n - 1, -1, -1):  # a node's descendants are complete before its predecessors need them
        for u in bits(preds[v]):
            des[u] |= des[v] | 1 << v
    return [n - anc[v].bit_count() - des[v].bit_count() - 1 for v in range(n)]


def narrow_waist(graph: Graph) -> dict[str, int]:
    """nw(v) = |V| - |anc(v)| - |des(v)| - 1 of every node (MAGIS §6.1), data and ordering edges."""
    index = graph.index
    preds = [sum(1 << index[p] for p in graph.predecessors[n.name]) for n in graph.nodes]
    return dict(zip(index, waist_values(preds)))


def unit_waists(problem: OrderingProblem) -> list[int]:
    """nw of every unit of a reduced ordering problem."""
    return waist_values(problem.preds)


def components(problem: OrderingProblem) -> list[list[int]]:
    """The weakly connected components of the unit DAG, each in unit order, ordered by first unit."""
    root = list(range(len(problem)))

    def find(u: int) -> int:
        while root[u] != u:
            root[u] = root[root[u]]
            u = root[u]
        return u

    for u, succs in enumerate(problem.succs):
        for w in succs:
            a, b = find(u), find(w)
            if a != b:
                root[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for u in range(len(problem)):
        groups.setdefault(find(u), []).append(u)
    return list(groups.values())


def split_at_waists(unit_order: Sequence[int], waist: Sequence[int], limit: int = 1) -> list[list[int]]:
    """Cut a unit order after every unit whose nw is at most ``limit`` (GraphPartition)."""
    pieces: list[list[int]] = [[]]
    for u in unit_order:
        pieces[-1].append(u)
        if waist[u] <= limit:
            pieces.append([])
    return [p for p in pieces if p]


def split_to_windows(unit_order: Sequence[int], waist: Sequence[int], size: int, first: int = 0) -> list[list[int]]:
    """Cut a unit order into windows of at most ``size`` units, each after the narrowest waist of its second half.

    Used to reorder a piece too large for the DP window by window; ``first`` (when
    set) bounds the first window instead, so that a pass with ``first = size // 2``
    straddles the cuts of a pass without.
    """
    windows: list[list[int]] = []
    start, limit = 0, first or size
    while len(unit_order) - start > limit:
        cut = min(range(start + (limit + 1) // 2, start + limit + 1), key=lambda i: (waist[unit_order[i - 1]], -i))
        windows.append(list(unit_order[start:cut]))
        start, limit = cut, size
    if start < len(unit_order):
        windows.append(list(unit_order[start:]))
    return windows
