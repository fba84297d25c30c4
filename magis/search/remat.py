"""Rematerialization as the baselines see it: values computed, kept, freed and computed again.

Checkmate (Jain et al., MLSys 2020) and DTR (Kirisame et al., ICLR 2021) both plan
over a DAG of operators, each making one value, in a fixed topological order; both
may free a value and compute it again when it is next needed. :func:`remat_problem`
reduces a magis :class:`~magis.ir.graph.Graph` to that form, with the exact
reductions of :mod:`magis.schedule.problem`: parameters, inputs and their views
(*inert* nodes) are resident throughout; a node that allocates nothing and has one
predecessor (a view, ``getitem``...) joins its predecessor's *unit*, so a unit's
value is the storages its producer allocates. Random ops are computed once
(dropout is never drawn twice: DESIGN.md), and so is a unit whose storage another
unit views; the bytes of graph outputs (gradients, loss) live to the end.

A plan is a *sequence* of units, repeats being recomputations; :func:`replay` turns
it into a graph in which every recomputation is a copy of the unit's nodes reading
the latest copies of their inputs, with the order to run it in. The magis simulator
scores that graph and the magis runtime runs it: each storage lives from its copy's
step to its last reader's, never longer than the planner assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from magis.ir.graph import Graph, Node, Ref, map_refs
from magis.schedule.problem import group_units, memory_facts

#: seconds one node of the graph takes (a cost model's ``node_seconds`` bound to the graph)
NodeCost = Callable[[str], float]


class DoesNotFit(ValueError):
    """No plan of the method keeps the step within the memory limit (the message says where it fails)."""


@dataclass(frozen=True)
class RematProblem:
    """A graph as units in captured order, with what a rematerialization planner needs.

    ``size[u]`` is the bytes unit ``u`` allocates that may be freed, ``kept[u]`` those that
    live to the end of the step (graph outputs: gradients, loss, buffer updates; all of
    a unit whose storage another unit views), ``workspace[u]`` what it holds only while
    it runs, ``cost[u]`` its seconds; ``deps[u]`` the units whose values it
    reads, ``users[u]`` those that read its value (both exclude ``u``); ``static``
    the bytes resident for the whole step (parameters, buffers, inputs).
    """

    graph: Graph
    units: tuple[tuple[str, ...], ...]
    inert: tuple[str, ...]
    size: tuple[int, ...]
    kept: tuple[int, ...]
    workspace: tuple[int, ...]
    cost: tuple[float, ...]
    deps: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    once: frozenset[int]  # never computed twice: random ops, and units whose storage another unit views
    pinned: frozenset[int]  # with bytes that live to the end of the step (``kept``)
    static: int

    def __len__(self) -> int:
        return len(self.units)

    @property
    def fixed(self) -> frozenset[int]:
        """Units Checkmate never recomputes: :attr:`once`, and the outputs (:attr:`pinned`)."""
        return self.once | self.pinned

    @property
    def no_remat_peak(self) -> int:
        """Peak of running every unit once, freeing each value after its last user."""
        return sequence_peak(self, range(len(self)))


def remat_problem(graph: Graph, cost: NodeCost) -> RematProblem:
    """The :class:`RematProblem` of ``graph`` in its captured order, units priced by ``cost``."""
    facts = memory_facts(graph)
    units, inert = group_units(graph, facts, [n.name for n in graph.nodes])
    unit_of = {name: u for u, names in enumerate(units) for name in names}
    n = len(units)
    deps: list[set[int]] = [set() for _ in range(n)]
    users: list[set[int]] = [set() for _ in range(n)]
    once: set[int] = set()
    viewed: set[int] = set()  # units whose storage another unit views
    kept = [0] * n
    for u, names in enumerate(units):
        for name in names:
            if graph[name].random:
                once.add(u)
            for p in graph[name].inputs:  # data only: random units keep their order, run once
                if p in unit_of and unit_of[p] != u:
                    deps[u].add(unit_of[p])
            for key in graph.storages[name]:
                if key is None or key not in facts.readers:
                    continue  # persistent
                owner = unit_of[key[0]]
                if owner != u:  # a view of another unit's storage keeps that storage alive
                    viewed.add(owner)
                if key in facts.pinned and key[0] == name:
                    kept[u] += graph.storage_bytes[key]
                for reader in facts.readers[key]:
                    if unit_of.get(reader, owner) != owner:
                        users[owner].add(unit_of[reader])
                        deps[unit_of[reader]].add(owner)
    size = [facts.alloc[names[0]] - kept[u] for u, names in enumerate(units)]
    for u in viewed:
        size[u], kept[u] = 0, kept[u] + size[u]
    pinned = {u for u in range(n) if kept[u]} | viewed
    return RematProblem(
        graph=graph,
        units=tuple(tuple(u) for u in units),
        inert=tuple(inert),
        size=tuple(size),
        kept=tuple(kept),
        workspace=tuple(graph[names[0]].workspace for names in units),
        cost=tuple(sum(cost(name) for name in names) for names in units),
        deps=tuple(tuple(sorted(d)) for d in deps),
        users=tuple(tuple(sorted(s)) for s in users),
        once=frozenset(once | viewed),
        pinned=frozenset(pinned),
        static=facts.persistent_bytes,
    )


def sequence_peak(problem: RematProblem, sequence: Sequence[int]) -> int:
    """Peak bytes of running the units in ``sequence`` (repeats recompute), each value
    freed after the last step that reads it before it is computed again (its ``kept`` bytes never).

    :func:`magis.cost.memory.simulate_memory` of the :func:`replay` of ``sequence``
    gives the same figure where each unit's storages share their readers, less where
    they do not (a unit's storages are freed here together, at the last read of any).
    """
    last_read: dict[tuple[int, int], int] = {}  # (unit, its computation) -> last step reading it
    version = [-1] * len(problem)
    made: list[tuple[int, int]] = []
    for step, u in enumerate(sequence):
        for d in problem.deps[u]:
            if version[d] < 0:
                raise ValueError(f"unit {u} runs before its input {d} was computed")
            last_read[(d, version[d])] = step
        version[u] += 1
        made.append((u, version[u]))
    delta = [0] * (len(sequence) + 1)
    for step, (u, v) in enumerate(made):
        delta[step] += problem.size[u] + problem.kept[u]
        delta[last_read.get((u, v), step) + 1] -= problem.size[u]
    peak, live = 0, problem.static
    for step, u in enumerate(sequence):
        live += delta[step]
        peak = max(peak, live + problem.workspace[u])
    return peak if sequence else problem.static


def replay(problem: RematProblem, sequence: Sequence[int]) -> tuple[Graph, tuple[str, ...]]:
    """The graph and order that run the units in ``sequence``, repeats as recomputed copies.

    A unit's first computation keeps its nodes' names; the ``r``-th recomputation
    copies them as ``name.r<r>``, reading the latest copies of their inputs. Units of
    :attr:`RematProblem.once` must appear once. Graph outputs and the signature are unchanged.
    """
    graph = problem.graph
    latest: dict[str, str] = {}
    nodes: list[Node] = [graph[name] for name in problem.inert]
    times: dict[int, int] = {}
    for u in sequence:
        r = times[u] = times.get(u, -1) + 1
        if r and u in problem.once:
            raise ValueError(f"unit {u} ({problem.units[u][0]}) must not be computed twice (a random op)")
        for name in problem.units[u]:
            node = graph[name]
            new = name if r == 0 else f"{name}.r{r}"

            def ren(ref: Ref) -> Ref:
                return Ref(latest.get(ref.name, ref.name))

            nodes.append(replace(node, name=new, args=map_refs(node.args, ren), kwargs=map_refs(node.kwargs, ren)))
            latest[name] = new
    missing = [names[0] for u, names in enumerate(problem.units) if u not in times]
    if missing:
        raise ValueError(f"the sequence never computes {missing[0]}")
    out = Graph(tuple(nodes), graph.outputs, graph.signature, graph.order_edges)
    return out, tuple(n.name for n in out.nodes)
