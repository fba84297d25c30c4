"""What graph rules return (:class:`Rewrite`), and what the scheduling-based rules (MAGIS §5.2)
share: the tensors they target.

Every rule of :mod:`magis.rules` that rewrites a whole graph (identity and algebraic
rewrites, re-materialization, swapping, compaction) returns a list of
:class:`Rewrite`; the M-Optimizer (:mod:`magis.search.registry`) takes any such
function as an M-Rule. A scheduling-based rule is ``rule(graph, order)``: ``order`` is the
current schedule of ``graph`` (its node order when omitted), whose memory
hot-spots decide where the rule applies (§5.2, "Heuristic"). Each
:class:`Rewrite` is a new graph, a one-line description, the old schedule with
the new nodes placed where they help (also the new graph's node order, so the
graph runs as proposed), and the names of the nodes it touched, which is what
incremental scheduling (MAGIS Alg. 2) needs.

:func:`saved_tensors` finds the targets: hot-spot storages that some reader
needs only after the peak, the activations a training step saves for its backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from magis.cost.memory import MemoryProfile, StorageKey, simulate_memory, storage_lifetimes
from magis.ir.graph import Graph, GraphError, Node


@dataclass(frozen=True)
class Rewrite:
    """One candidate of a rule: ``graph`` (its nodes listed in ``order``), what was done, what
    changed, and the bytes the rule estimates it saves at the peak (0 for the dual rules).

    ``touched`` holds the nodes added, removed or re-wired (whose inputs changed), for
    incremental scheduling; ``order`` is a valid schedule whose peak the rule checked. A
    swap's Store sits next to a tensor made early and its Load next to a reader late in
    the step, so an interval rescheduled around the touched nodes may place the Store
    late and lose the saving: keep ``order`` as the fallback (it is never worse).
    """

    graph: Graph
    description: str
    order: tuple[str, ...] = ()  # empty: the rule placed nothing (the caller reschedules)
    touched: frozenset[str] = frozenset()  # empty: the caller compares the graphs
    saving: int = 0
    memory: MemoryProfile | None = None  # the timeline of ``graph`` in ``order``, where the rule simulated it


Rule = Callable[[Graph, Sequence[str] | None], list[Rewrite]]


@dataclass(frozen=True)
class SavedTensor:
    """A hot-spot storage that readers after the last peak step need (MAGIS §2.1 hot-spot).

    ``carriers`` are the nodes whose value lives in the storage (its owner, a
    ``getitem`` of it, views), ``late`` maps each reader scheduled after the peak
    to the carriers it reads, and ``freed`` holds, for each peak step, the bytes the
    storage stops occupying there once no late reader needs it.
    """

    storage: StorageKey
    nbytes: int
    carriers: tuple[str, ...]
    late: dict[str, tuple[str, ...]]
    first_late: int  # position of the first late reader in the schedule
    freed: dict[int, int]


def hot_spots(graph: Graph, order: Sequence[str] | None = None) -> frozenset[StorageKey]:
    """The storages live at a peak of ``order`` (the graph's node order where none is given):
    where a rule that only prepares another's saving looks for work."""
    return simulate_memory(graph, order if order is not None else [n.name for n in graph.nodes]).hotspots


@dataclass(frozen=True)
class Timeline:
    """A schedule's positions, storage lifetimes and peak steps, shared by the rules' estimates."""

    order: tuple[str, ...]
    pos: dict[str, int]
    span: dict[StorageKey, tuple[int, int]]
    peak: int
    peak_steps: tuple[int, ...]
    timeline: tuple[int, ...]

    @staticmethod
    def of(graph: Graph, order: Sequence[str] | None = None) -> Timeline:
        order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
        profile = simulate_memory(graph, order)
        return Timeline(
            order,
            {name: i for i, name in enumerate(order)},
            storage_lifetimes(graph, order),
            profile.peak,
            profile.peak_steps,
            profile.timeline,
        )

    def not_raised_by(self, rewritten: Graph) -> MemoryProfile | None:
        """The memory timeline of the rewritten graph run in its node order, where it peaks
        no higher than this schedule (Echo's guarantee: the footprint never grows, e.g.
        where a recomputation runs); ``None`` where it peaks higher."""
        memory = simulate_memory(rewritten, [n.name for n in rewritten.nodes])
        return memory if memory.peak <= self.peak else None


def saved_tensors(graph: Graph, timeline: Timeline) -> list[SavedTensor]:
    """Every hot-spot storage with readers after the last peak step, in schedule order.

    Storages that live to the end anyway (persistent tensors, graph outputs, views
    of them) and storages in host memory are left out: no rule can free them.
    """
    storages, sizes, pos = graph.storages, graph.storage_bytes, timeline.pos
    last_step = len(timeline.order) - 1
    last_peak = max(timeline.peak_steps)
    carriers: dict[StorageKey, list[str]] = {}
    for name in timeline.order:
        for key in storages[name]:
            if key is not None:
                carriers.setdefault(key, []).append(name)
    found = []
    for key, names in carriers.items():
        start, end = timeline.span[key]
        owner = graph[key[0]]
        if owner.role.persistent or owner.on_host or end == last_step or sizes[key] == 0:
            continue
        if not any(start <= p <= end for p in timeline.peak_steps):
            continue
        inside = set(names)
        late: dict[str, list[str]] = {}
        stay = max((pos[n] for n in names if pos[n] <= last_peak), default=-1)  # carriers stay where they are
        for carrier in names:
            for reader in graph.consumers[carrier]:
                if reader in inside:
                    continue
                if pos[reader] > last_peak:
                    late.setdefault(reader, []).append(carrier)
                else:
                    stay = max(stay, pos[reader])
        if not late:
            continue
        freed = {p: sizes[key] for p in timeline.peak_steps if start <= p <= end and stay < p}
        found.append(
            SavedTensor(
                key,
                sizes[key],
                tuple(names),
                {r: tuple(c) for r, c in late.items()},
                min(pos[r] for r in late),
                freed,
            )
        )
    return sorted(found, key=lambda s: pos[s.storage[0]])


def kept_alive(graph: Graph, timeline: Timeline, names: Iterable[str], until: int) -> dict[int, int]:
    """Bytes, per peak step, of the storages of ``names`` that die before that step but
    would now live until step ``until`` (Echo §IV-A: what a recomputation newly keeps)."""
    keys = {k for name in names for k in graph.storages[name] if k is not None}
    cost: dict[int, int] = {}
    for key in keys:
        if graph[key[0]].role.persistent or graph[key[0]].on_host:
            continue
        start, end = timeline.span[key]
        for p in timeline.peak_steps:
            if start <= p and end < p <= until:
                cost[p] = cost.get(p, 0) + graph.storage_bytes[key]
    return cost


def net_saving(timeline: Timeline, freed: dict[int, int], cost: dict[int, int]) -> int | None:
    """The most bytes saved at a peak step (Echo §IV-A: released minus newly kept), or
    ``None`` unless no peak step grows and some step shrinks."""
    nets = [freed.get(p, 0) - cost.get(p, 0) for p in timeline.peak_steps]
    return max(nets) if min(nets) >= 0 and max(nets) > 0 else None


def reordered(graph: Graph, order: Sequence[str]) -> Graph:
    """``graph`` with its nodes listed in ``order`` (a valid schedule of it)."""
    graph.check_schedule(order)
    return Graph(tuple(graph[n] for n in order), graph.outputs, graph.signature, graph.order_edges)


def rebuild(graph: Graph, order: Sequence[str], nodes: Iterable[Node]) -> Graph:
    """``graph`` with ``nodes`` added or put in place of the nodes of the same name, its
    nodes listed in ``order`` (which must name every node of the result exactly once)."""
    by_name = {n.name: n for n in graph.nodes}
    by_name.update((n.name, n) for n in nodes)
    result = Graph(tuple(by_name[n] for n in order), graph.outputs, graph.signature, graph.order_edges)
    if len(result) != len(by_name):
        raise GraphError("the order leaves out nodes of the rewritten graph")
    result.check_schedule(order)
    return result


def insert_before(order: Sequence[str], new: Sequence[str], anchor: str) -> list[str]:
    """``order`` with ``new`` (in that order) placed right before ``anchor``."""
    at = list(order).index(anchor)
    return [*order[:at], *new, *order[at:]]


def prune_dead(graph: Graph, names: Iterable[str]) -> Graph:
    """Remove, among ``names``, nodes nothing reads any more (and then their unread inputs
    among ``names``): copies made unneeded by a rewrite. Graph outputs, inputs and random
    ops stay (a random op keeps its place in the stream of random numbers)."""
    candidates = set(names)
    outputs = set(graph.outputs)
    dead: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name in candidates - dead:
            node = graph[name]
            if name in outputs or node.is_input or node.random:
                continue
            if all(c in dead for c in graph.successors[name]):
                dead.add(name)
                changed = True
    if not dead:
        return graph
    edges = tuple((a, b) for a, b in graph.order_edges if a not in dead and b not in dead)
    return Graph(tuple(n for n in graph.nodes if n.name not in dead), graph.outputs, graph.signature, edges)
