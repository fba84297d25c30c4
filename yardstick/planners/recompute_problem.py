"""Rematerialization as the baselines see it: values computed, kept, freed and computed again.

Checkmate (Jain et al., MLSys 2020) and DTR (Kirisame et al., ICLR 2021) both plan
over a DAG of operators, each making one value, in a fixed topological order; both
may free a value and compute it again when it is next needed. :func:`remat_problem`
reduces a magis :class:`~magis.ir.graph.Graph` to that form, with the exact
reductions of :mod:`magis.schedule.problem`: parameters, inputs and their views
(*inert* nodes) are resident throughout; a node that allocates nothing and has one
predecessor (a view, ``getitem``...) joins its predecessor's *unit*. A unit makes
the storages its producer allocates; those read by the same units form one
:class:`Value`, freed after its last reader, so a multi-output operator (batch norm's
output beside its saved statistics) frees each output when its own readers are done,
as the simulator does. Random ops are computed once (dropout is never drawn twice:
docs/design.md), and so is a unit whose storage another unit views; the bytes of graph
outputs (gradients, loss, buffer updates) live to the end. A unit with outputs may be
computed again (batch norm, whose running statistics are outputs): its copies of them
equal the step's, so their readers read the step's outputs and the copies are freed at once.

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
class Value:
    """Freeable storages one unit makes that the same units read: they live and die together."""

    unit: int  # the unit that makes them
    size: int  # bytes
    readers: tuple[int, ...]  # the other units that read them, in order


@dataclass(frozen=True)
class RematProblem:
    """A graph as units in captured order, with what a rematerialization planner needs.

    ``size[u]`` is the bytes unit ``u`` allocates that may be freed (its :attr:`values`,
    listed by ``made[u]``), ``kept[u]`` those that live to the end of the step (graph
    outputs: gradients, loss, buffer updates), ``workspace[u]`` what it holds only while
    it runs, ``cost[u]`` its seconds; ``reads[u]`` the values it reads, ``deps[u]`` the
    units it reads from (values, outputs or views), ``users[u]`` those that read
    from it (both exclude ``u``); ``static`` the bytes resident for the whole step
    (parameters, buffers, inputs).
    """

    graph: Graph
    units: tuple[tuple[str, ...], ...]
    inert: tuple[str, ...]
    values: tuple[Value, ...]
    made: tuple[tuple[int, ...], ...]
    reads: tuple[tuple[int, ...], ...]
    size: tuple[int, ...]
    kept: tuple[int, ...]
    workspace: tuple[int, ...]
    cost: tuple[float, ...]
    deps: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    once: frozenset[int]  # never computed twice: random ops, and units whose storage another unit views
    static: int

    def __len__(self) -> int:
        return len(self.units)

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
    once = {u for u, names in enumerate(units) if any(graph[name].random for name in names)}
    kept = [0] * n
    value_of: dict[tuple[int, tuple[int, ...]], int] = {}  # (maker, readers) -> its Value's bytes, summed
    for key, readers in facts.readers.items():
        owner = unit_of[key[0]]
        reader_units = {unit_of.get(reader, owner) for reader in readers} - {owner}
        for w in reader_units:
            users[owner].add(w)
            deps[w].add(owner)
        if any(unit_of[name] != owner for name in readers if key in graph.storages[name]):
            once.add(owner)  # another unit views the storage: a second copy would not be the one it views
        if key in facts.pinned:
            kept[owner] += graph.storage_bytes[key]
        else:
            shared = (owner, tuple(sorted(reader_units)))
            value_of[shared] = value_of.get(shared, 0) + graph.storage_bytes[key]
    for u, names in enumerate(units):  # data edges too: an input that is persistent still orders the units
        for name in names:
            for p in graph[name].inputs:
                if p in unit_of and unit_of[p] != u:
                    deps[u].add(unit_of[p])
                    users[unit_of[p]].add(u)
    values = tuple(Value(owner, size, readers) for (owner, readers), size in sorted(value_of.items()))
    made: list[list[int]] = [[] for _ in range(n)]
    reads: list[list[int]] = [[] for _ in range(n)]
    for v, value in enumerate(values):
        made[value.unit].append(v)
        for w in value.readers:
            reads[w].append(v)
    return RematProblem(
        graph=graph,
        units=tuple(tuple(u) for u in units),
        inert=tuple(inert),
        values=values,
        made=tuple(map(tuple, made)),
        reads=tuple(map(tuple, reads)),
        size=tuple(sum(values[v].size for v in vs) for vs in made),
        kept=tuple(kept),
        workspace=tuple(graph[names[0]].workspace for names in units),
        cost=tuple(sum(cost(name) for name in names) for names in units),
        deps=tuple(tuple(sorted(d)) for d in deps),
        users=tuple(tuple(sorted(s)) for s in users),
        once=frozenset(once),
        static=facts.persistent_bytes,
    )


def sequence_peak(problem: RematProblem, sequence: Sequence[int]) -> int:
    """Peak bytes of running the units in ``sequence`` (repeats recompute), each :class:`Value`
    freed after the last step that reads it before it is computed again (``kept`` bytes: never
    on their first computation, at once on a recomputation).

    Equals :func:`magis.cost.memory.simulate_memory` of the :func:`replay` of ``sequence``.
    """
    latest = [-1] * len(problem)  # the step that last computed each unit
    first: dict[int, int] = {}  # the step that first computed it: its outputs are the step's
    last_read: dict[tuple[int, int], int] = {}  # (value, step that made it) -> last step reading it
    for step, u in enumerate(sequence):
        for d in problem.deps[u]:
            if latest[d] < 0:
                raise ValueError(f"unit {u} runs before its input {d} was computed")
        for v in problem.reads[u]:
            last_read[(v, latest[problem.values[v].unit])] = step
        latest[u] = step
        first.setdefault(u, step)
    delta = [0] * (len(sequence) + 1)
    for step, u in enumerate(sequence):
        delta[step] += problem.size[u] + problem.kept[u]
        if first[u] != step:  # a recomputed copy's outputs are not the step's: no unit reads them
            delta[step + 1] -= problem.kept[u]
        for v in problem.made[u]:
            delta[last_read.get((v, step), step) + 1] -= problem.values[v].size
    peak, live = 0, problem.static
    for step, u in enumerate(sequence):
        live += delta[step]
        peak = max(peak, live + problem.workspace[u])
    return peak if sequence else problem.static


def replay(problem: RematProblem, sequence: Sequence[int]) -> tuple[Graph, tuple[str, ...]]:
    """The graph and order that run the units in ``sequence``, repeats as recomputed copies.

    A unit's first computation keeps its nodes' names; the ``r``-th recomputation
    copies them as ``name.r<r>``, reading the latest copies of their inputs, except that
    a node whose storages are all outputs of the step is read in its first computation
    (the copy holds the same values; the step's live to the end anyway). Units of
    :attr:`RematProblem.once` must appear once. Graph outputs and the signature are unchanged.
    """
    graph = problem.graph
    pinned = memory_facts(graph).pinned
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
            keys = [key for key in graph.storages[name] if key is not None]
            if not keys or not all(key in pinned for key in keys):
                latest[name] = new
    missing = [names[0] for u, names in enumerate(problem.units) if u not in times]
    if missing:
        raise ValueError(f"the sequence never computes {missing[0]}")
    out = Graph(tuple(nodes), graph.outputs, graph.signature, graph.order_edges)
    return out, tuple(n.name for n in out.nodes)
