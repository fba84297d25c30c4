"""The ordering problem every scheduler of this package solves.

A schedule is cut into contiguous *segments*; reordering inside one segment never
changes the memory of the steps outside it (MAGIS §2.1 accounting: a storage made
before the segment and read inside it is live at every earlier step whatever the
inner order, one made inside and read after it is live at every later step). So a
segment is an independent problem, the memory of whatever crosses its boundary
taken as fixed (Serenity §3.2, divide-and-conquer).

:func:`segment_problem` reduces a segment to an :class:`OrderingProblem` on *units*,
with two reductions that never lose the optimum:

- *inert* nodes (persistent inputs, and views of them: ``t(weight)``...) allocate
  nothing and free nothing; they run first.
- a node that allocates nothing, has no workspace and one predecessor (a view,
  ``getitem``, ``detach``...) runs right after that predecessor: its step then holds
  no more than its predecessor's did, and every lifetime only shortens. It joins the
  predecessor's unit, and a unit costs what its first node costs.

Memory of a unit's step = live bytes before it + ``cost``; afterwards the live bytes
grow by ``alloc`` and shrink by every storage whose readers have all run. The
accounting agrees exactly with :func:`magis.cost.memory.simulate_memory` (a storage
lives from its producer's step to the last step that reads any view of it; outputs
and persistent tensors stay), up to the bytes that are constant over the segment.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from magis.cost.memory import StorageKey
from magis.ir.graph import Graph


@dataclass(frozen=True)
class MemoryFacts:
    """Per-graph facts the problems are built from (computed once per graph)."""

    alloc: dict[str, int]  # bytes of non-persistent storages a node allocates
    readers: dict[StorageKey, tuple[str, ...]]  # non-persistent storage -> its views and their consumers (repeats)
    pinned: frozenset[StorageKey]  # storages that live to the end (a view is an output or persistent)
    inert: frozenset[str]  # nodes with no memory effect at all
    persistent_bytes: int  # parameters, buffers and inputs: live at every step


_FACTS: weakref.WeakKeyDictionary[Graph, MemoryFacts] = weakref.WeakKeyDictionary()


def memory_facts(graph: Graph) -> MemoryFacts:
    """The :class:`MemoryFacts` of ``graph``, cached on the graph object."""
    facts = _FACTS.get(graph)
    if facts is None:
        facts = _FACTS[graph] = _compute_facts(graph)
    return facts


def _compute_facts(graph: Graph) -> MemoryFacts:
    storages, consumers, predecessors, nbytes = graph.storages, graph.consumers, graph.predecessors, graph.storage_bytes
    persistent = {key for key in nbytes if graph[key[0]].role.persistent}
    outputs = set(graph.outputs)
    readers: dict[StorageKey, list[str]] = {}
    pinned: set[StorageKey] = set()
    alloc: dict[str, int] = {}
    inert: set[str] = set()
    for node in graph.nodes:
        name = node.name
        keys = [k for k in storages[name] if k is not None and k not in persistent]
        alloc[name] = sum(nbytes[k] for k in keys if k[0] == name)
        for key in keys:
            seen = readers.setdefault(key, [])
            seen.append(name)
            seen.extend(consumers[name])
        if keys and (name in outputs or node.role.persistent):
            pinned.update(keys)
        if not keys and node.workspace == 0 and all(p in inert for p in predecessors[name]):
            inert.add(name)
    return MemoryFacts(
        alloc=alloc,
        readers={k: tuple(v) for k, v in readers.items()},
        pinned=frozenset(pinned),
        inert=frozenset(inert),
        persistent_bytes=sum(nbytes[k] for k in persistent),
    )


@dataclass(frozen=True)
class OrderingProblem:
    """A segment of a schedule as a DAG of units with exact memory accounting.

    Units are numbered in the order the segment listed them (a valid order), and
    sets of units are int bitsets. ``frees[u]`` lists ``(readers, bytes)`` for every
    storage unit ``u`` reads or makes that the segment may free: it is freed once
    every unit of ``readers`` has run. ``start_live`` is the bytes made before the
    segment and freed inside it.
    """

    units: tuple[tuple[str, ...], ...]
    preds: tuple[int, ...]
    succs: tuple[tuple[int, ...], ...]
    cost: tuple[int, ...]
    alloc: tuple[int, ...]
    frees: tuple[tuple[tuple[int, int], ...], ...]
    start_live: int
    inert: tuple[str, ...]
    floor: tuple[int, ...]  # bytes surely live at each unit's step: its cost and the storages it reads

    @property
    def lower_bound(self) -> int:
        """No order of the segment peaks below this (the largest ``floor``)."""
        return max(self.floor, default=0)

    def __len__(self) -> int:
        return len(self.units)

    def nodes(self, unit_order: Sequence[int]) -> list[str]:
        """The node order of a unit order: inert nodes first, each unit's nodes in a row."""
        return [*self.inert, *(name for u in unit_order for name in self.units[u])]

    def start(self) -> State:
        """The state before anything in the segment ran."""
        ready = 0
        for u, mask in enumerate(self.preds):
            if not mask:
                ready |= 1 << u
        return State(0, self.start_live, self.start_live, ready, None)

    def advance(self, state: State, u: int) -> State:
        """The state after running unit ``u`` (which must be ready)."""
        bit = 1 << u
        done = state.done | bit
        todo = ~done
        live = state.live + self.alloc[u]
        for readers, nbytes in self.frees[u]:
            if not readers & todo:
                live -= nbytes
        ready = state.ready ^ bit
        preds = self.preds
        for w in self.succs[u]:
            if not preds[w] & todo:
                ready |= 1 << w
        step = state.live + self.cost[u]
        peak = step if step > state.peak else state.peak
        return State(done, peak, live, ready, (u, state.path))

    def successors(self, state: State, budget: float = float("inf"), limit: int | None = None) -> Iterator[State]:
        """Every state one step after ``state`` whose peak is within ``budget`` (only one when a step is dominant).

        Dominance: running a ready unit that neither raises the peak so far nor grows
        the live bytes never hurts, whatever comes after: every later step holds no
        more than it would have. Such a unit is run at once, without branching.
        ``limit`` considers only that many ready units, the first listed (heuristics on
        very wide graphs); the exact DP considers them all.
        """
        after = []
        ready, peak, live, cost = state.ready, state.peak, state.live, self.cost
        for u in itertools.islice(bits(ready), limit):
            if live + cost[u] > budget:
                continue
            nxt = self.advance(state, u)
            if nxt.peak <= peak and nxt.live <= live:
                yield nxt
                return
            after.append(nxt)
        yield from after

    def run(self, unit_order: Sequence[int]) -> State:
        """The state after running ``unit_order``: its ``peak`` is the segment's peak
        (without the bytes constant over the segment), its ``live`` what stays after it."""
        state = self.start()
        for u in unit_order:
            state = self.advance(state, u)
        return state

    def unit_order(self, order: Sequence[str]) -> list[int]:
        """The units in the order their first node appears in a node order."""
        unit_of = {name: u for u, names in enumerate(self.units) for name in names}
        seen: dict[int, None] = {}
        for name in order:
            u = unit_of.get(name)
            if u is not None:
                seen.setdefault(u)
        return list(seen)


class State(NamedTuple):
    """A partial schedule: units run (``done``), its peak, live bytes, ready units, and the path that led here."""

    done: int
    peak: int
    live: int
    ready: int
    path: tuple | None  # (last unit, previous path), shared between states

    def units(self) -> list[int]:
        """The units run so far, in order."""
        out = []
        path = self.path
        while path is not None:
            out.append(path[0])
            path = path[1]
        return out[::-1]


def segment_problem(
    graph: Graph, order: Sequence[str], lo: int = 0, hi: int | None = None, pos: dict[str, int] | None = None
) -> OrderingProblem:
    """The :class:`OrderingProblem` of ``order[lo:hi]``, the rest of ``order`` staying where it is.

    ``pos`` (each node's position in ``order``) may be passed to save building it; only
    on which side of the segment a node lies matters, so it stays valid while segments
    of the same order are reordered in place.
    """
    hi = len(order) if hi is None else hi
    facts = memory_facts(graph)
    if pos is None:
        pos = {name: i for i, name in enumerate(order)}
    units, inert = group_units(graph, facts, order[lo:hi])
    unit_of = {name: u for u, names in enumerate(units) for name in names}
    preds_mask, succs = _unit_edges(graph, units, unit_of)
    cost = [facts.alloc[names[0]] + graph[names[0]].workspace for names in units]
    alloc = [facts.alloc[names[0]] for names in units]
    frees, read, start_live = _storage_effects(graph, facts, units, unit_of, pos, lo, hi)
    floor = [c + r for c, r in zip(cost, read)]
    return OrderingProblem(
        units=tuple(tuple(u) for u in units),
        preds=tuple(preds_mask),
        succs=tuple(tuple(s) for s in succs),
        cost=tuple(cost),
        alloc=tuple(alloc),
        frees=tuple(tuple(f.items()) for f in frees),
        start_live=start_live,
        inert=tuple(inert),
        floor=tuple(floor),
    )


def _unit_edges(graph: Graph, units: list[list[str]], unit_of: dict[str, int]) -> tuple[list[int], list[list[int]]]:
    """The DAG of the units: each unit's predecessors (a bitset) and its successors."""
    preds_mask = [0] * len(units)
    for name, u in unit_of.items():
        for p in graph.predecessors[name]:
            v = unit_of.get(p)
            if v is not None and v != u:
                preds_mask[u] |= 1 << v
    succs: list[list[int]] = [[] for _ in units]
    for u, mask in enumerate(preds_mask):
        for v in bits(mask):
            succs[v].append(u)
    return preds_mask, succs


def _storage_effects(
    graph: Graph,
    facts: MemoryFacts,
    units: list[list[str]],
    unit_of: dict[str, int],
    pos: dict[str, int],
    lo: int,
    hi: int,
) -> tuple[list[dict[int, int]], list[int], int]:
    """What the storages the segment ``order[lo:hi]`` touches do there, those constant over
    it (persistent, or made before it and live after it) left out: per unit, the bytes
    it frees by the set of readers that must all have run (``frees``) and the bytes of
    storages it reads but did not make (live at its step); and the bytes made before the
    segment and freed inside it."""
    frees: list[dict[int, int]] = [{} for _ in units]
    read = [0] * len(units)
    start_live = 0
    storages = graph.storages
    touched = {k for name in unit_of for p in (name, *graph.predecessors[name]) for k in storages[p]}
    for key in touched:
        readers = facts.readers.get(key)
        if readers is None:
            continue  # persistent: constant
        nbytes = graph.storage_bytes[key]
        kept = key in facts.pinned  # live after the segment
        mask = 0
        for r in readers:
            i = pos[r]
            if i >= hi:
                kept = True
            elif i >= lo:
                mask |= 1 << unit_of[r]
        made_before = key[0] not in unit_of
        if kept and made_before:
            continue  # live over the whole segment: constant
        for u in bits(mask):
            if not kept:
                frees[u][mask] = frees[u].get(mask, 0) + nbytes
            if units[u][0] != key[0]:  # a reader (the maker has the bytes in its cost)
                read[u] += nbytes
        if made_before and not kept:
            start_live += nbytes
    return frees, read, start_live


def group_units(graph: Graph, facts: MemoryFacts, names: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    """The units of a segment (a node allocating nothing, without workspace, joins the unit
    of its only predecessor), and its inert nodes."""
    unit_of: dict[str, int] = {}
    units: list[list[str]] = []
    inert: list[str] = []
    for name in names:
        if name in facts.inert:
            inert.append(name)
            continue
        preds = graph.predecessors[name]
        if facts.alloc[name] == 0 and graph[name].workspace == 0 and len(preds) == 1 and preds[0] in unit_of:
            unit_of[name] = unit_of[preds[0]]
            units[unit_of[name]].append(name)
        else:
            unit_of[name] = len(units)
            units.append([name])
    return units, inert


def bits(mask: int) -> Iterator[int]:
    """The members of an int bitset, lowest first."""
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1
