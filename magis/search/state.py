"""The M-State of MAGIS Algorithm 3, and how one is simulated.

An M-State is a point of the joint search space: a graph the graph rules made
(``base``), the F-Tree laid over it with a fission number per node (``tree``), the
graph that results when the enabled nodes are fissioned (``graph``, what runs), a
schedule of it (``order``), and the simulated peak memory and latency of running it
in that order (MAGIS §5, "Simulator": :mod:`magis.cost.memory`, :mod:`magis.cost.latency`).
A :class:`Mutation` is a state before it is scheduled and simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from magis.analysis.ftree import FTree
from magis.cost.latency import CostModel, estimate_latency
from magis.cost.memory import MemoryProfile, simulate_memory
from magis.ir.graph import Graph

#: the F-Tree of a graph with no fission candidates (the captured step, before analysis)
EMPTY_TREE = FTree((), ())


@dataclass(frozen=True)
class Step:
    """One rule application on the way to a state: the rule's name and what it did."""

    rule: str
    description: str


@dataclass(frozen=True, eq=False)
class MState:
    """``(graph, F-Tree, schedule, simulated peak and latency)`` (MAGIS Alg. 3)."""

    base: Graph  # the graph the F-Tree is laid over (graph rules applied)
    base_order: tuple[str, ...]  # a schedule of ``base``, carried through the rewrites
    tree: FTree
    graph: Graph  # ``base`` with the enabled F-Tree nodes fissioned: what runs
    order: tuple[str, ...]  # the schedule of ``graph``
    memory: MemoryProfile
    latency_s: float
    key: str  # Weisfeiler-Lehman hash of ``graph``
    steps: tuple[Step, ...] = ()
    #: regions fissioned into ``base`` itself (a recompute dive from a fissioned state,
    #: :meth:`magis.search.first_level.FirstLevel._refine`), as :meth:`regions` lists them
    frozen: tuple[dict[str, Any], ...] = ()

    @property
    def peak_bytes(self) -> int:
        return self.memory.peak

    def regions(self) -> list[dict[str, Any]]:
        """The enabled F-Tree nodes: the fissioned sub-graphs, with their dimension and ``n``
        (``nested_in``: the F-Tree node of the region this one runs inside, if any), after
        those fissioned into ``base`` itself (:attr:`frozen`, their F-Tree node that of the
        tree they were fissioned from)."""
        return list(self.frozen) + [
            {
                "ftree_node": i,
                "dimension": c.label,
                "parts": self.tree.parts[i],
                "nodes": len(c.nodes),
                "dominator": c.dominator,
                "nested_in": next((a for a in self.tree.ancestors(i) if self.tree.enabled(a)), None),
            }
            for i, c in enumerate(self.tree.candidates)
            if self.tree.enabled(i)
        ]


@dataclass(frozen=True)
class Mutation:
    """A state before it is scheduled and simulated: its graph, in the order carried over."""

    base: Graph
    base_order: tuple[str, ...]
    tree: FTree
    graph: Graph
    carried: tuple[str, ...]
    steps: tuple[Step, ...]  # what made it from its parent (the recompute dive: several remats)
    #: regions ``base`` holds that its parent's base does not (:attr:`MState.frozen`)
    frozen: tuple[dict[str, Any], ...] = ()
    #: the carried order is an incremental schedule of ``graph`` itself (a rewrite under an
    #: F-Tree that fissions nothing): scheduling it again would change nothing
    scheduled: bool = False


def simulate_state(
    base: Graph,
    base_order: Sequence[str],
    tree: FTree,
    graph: Graph,
    order: Sequence[str],
    key: str,
    cost_model: CostModel,
    steps: tuple[Step, ...] = (),
    frozen: tuple[dict[str, Any], ...] = (),
) -> MState:
    """An :class:`MState` with its memory timeline and latency simulated."""
    memory = simulate_memory(graph, order)
    latency = estimate_latency(graph, order, cost_model).total_s
    return MState(base, tuple(base_order), tree, graph, tuple(order), memory, latency, key, steps, frozen)


def changed_nodes(old: Graph, new: Graph) -> set[str]:
    """Names of the nodes a mutation added, removed or changed (another operator, other
    arguments or outputs; a fissioned region by its part graph and ``n``)."""

    def signature(graph: Graph, name: str) -> tuple:
        node = graph[name]
        return (node.op_name, node.args, node.kwargs, node.outputs, node.aliases)

    names = set(old.index) | set(new.index)
    return {n for n in names if n not in old or n not in new or signature(old, n) != signature(new, n)}


def fission_changes(old: FTree, new: FTree) -> str:
    """The F-Tree nodes whose fission number changed, e.g. ``input.dim0 (41 nodes): n 1 -> 2``."""
    return "; ".join(
        f"{c.label} ({len(c.nodes)} nodes): n {a} -> {b}"
        for c, a, b in zip(new.candidates, old.parts, new.parts)
        if a != b
    )
