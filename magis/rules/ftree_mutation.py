"""F-Tree mutation rules (MAGIS §5.1) and the graph an F-Tree state stands for.

Each rule is a pure function from an :class:`~magis.analysis.ftree.FTree` state to
the states it can produce (a node is *enabled* when its fission number ``n > 1``):

- Enable: a disabled leaf, or the parent of an enabled node, without enabled
  ancestors, gets the smallest ``n > 1`` dividing its length (Figure 7a);
- Lift: an enabled node without enabled ancestors is disabled and its parent
  enabled (Figure 7b);
- Disable: an enabled node without enabled descendants gets ``n = 1`` (Figure 7c);
- Mutate: an enabled node's ``n`` rises to the next divisor of its length (Figure 7d).

The search starts from the leaves and moves towards the root, so each step changes
memory and latency a little. :func:`apply_ftree` turns a state into a graph: every
enabled node without an enabled ancestor becomes a fissioned region, with its
enabled descendants fissioned inside one part (outermost first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from magis.analysis.dgraph import DGraph, build_dgraph
from magis.analysis.ftree import FTree, next_divisor
from magis.ir.graph import Graph
from magis.rules.fission import fission, fissioned_order

Rule = Callable[[FTree], list[FTree]]


def _enabled(tree: FTree, i: int) -> FTree | None:
    """``tree`` with node ``i`` enabled at its smallest fission number, if that is consistent."""
    n = next_divisor(tree.available_length(i), 1)
    if n is None:
        return None
    result = tree.with_parts({i: n})
    return result if result.consistent() else None


def enable(tree: FTree) -> list[FTree]:
    """Enabling rule: a disabled node without enabled ancestors that is a leaf or the
    parent of an enabled node."""
    found = []
    for i in range(len(tree)):
        if tree.enabled(i) or tree.has_enabled_ancestor(i):
            continue
        children = tree.children[i]
        if not children or any(tree.enabled(c) for c in children):
            result = _enabled(tree, i)
            if result is not None:
                found.append(result)
    return found


def lift(tree: FTree) -> list[FTree]:
    """Lifting rule: disable an enabled node without enabled ancestors, enable its parent."""
    found = []
    for i in tree.outermost_enabled():
        parent = tree.candidates[i].parent
        if parent is None:
            continue
        result = _enabled(tree.with_parts({i: 1}), parent)
        if result is not None:
            found.append(result)
    return found


def disable(tree: FTree) -> list[FTree]:
    """Disabling rule: disable an enabled node that has no enabled descendant."""
    return [tree.with_parts({i: 1}) for i in range(len(tree)) if tree.enabled(i) and not tree.has_enabled_descendant(i)]


def mutate(tree: FTree) -> list[FTree]:
    """Mutating rule: raise an enabled node's ``n`` to the next divisor of its length."""
    found = []
    for i in range(len(tree)):
        if not tree.enabled(i):
            continue
        n = next_divisor(tree.available_length(i), tree.parts[i])
        if n is not None:
            result = tree.with_parts({i: n})
            if result.consistent():
                found.append(result)
    return found


RULES: tuple[Rule, ...] = (enable, lift, disable, mutate)


def mutations(tree: FTree) -> list[FTree]:
    """Every state one rule application away from ``tree``."""
    return [result for rule in RULES for result in rule(tree)]


#: D-Graphs of the graphs F-Tree states were applied to: a search applies many states to one graph.
_DGRAPHS: WeakKeyDictionary[Graph, DGraph] = WeakKeyDictionary()


def dgraph_of(graph: Graph) -> DGraph:
    """``build_dgraph(graph)``, built once per graph object (graphs are immutable)."""
    found = _DGRAPHS.get(graph)
    if found is None:
        found = _DGRAPHS[graph] = build_dgraph(graph)
    return found


@dataclass(frozen=True, eq=False)
class Applied:
    """The graph an F-Tree state stands for, and a schedule of it."""

    graph: Graph
    order: tuple[str, ...]


def apply_ftree(graph: Graph, tree: FTree, order: Sequence[str] | None = None) -> Applied:
    """Fission ``graph`` as ``tree``'s enabled nodes say (outermost first, their enabled
    descendants inside one part) and carry ``order`` (default: the node order) over:
    each region takes the place of its nodes.

    Raises :class:`~magis.rules.fission.InvalidFission` when a region does not fit the
    graph any more (two disjoint regions can make each other non-convex).
    """
    order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
    for i in tree.outermost_enabled():
        f = tree.fission(i)
        result = fission(graph, f, dgraph_of(graph))
        order = fissioned_order(graph, order, result, f.nodes)
        graph = result
    return Applied(graph, order)
