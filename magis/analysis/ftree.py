"""The fission hierarchy tree, F-Tree, and its construction (MAGIS §4.3, Algorithm 1).

Each F-Tree node is a fission candidate ``(S, D)`` with a fission number ``n``:
``n = 1`` is a disabled candidate, ``n > 1`` an F-Trans applied to the graph. A
child's ``S`` is a subset of its parent's. The tree is a pure value
(:class:`FTree`); :mod:`magis.rules.ftree_mutation` changes the ``n`` of its nodes.

Algorithm 1 builds it from the memory hot-spots ``H`` of a schedule: for every
D-Graph component ``D`` it takes ``G'``, the sub-graph of the nodes with an axis in
``D``, and its dominator tree ``T`` entered at the input tensor
(:func:`component_entries`), and scores each node ``v`` by the peak reduction a
fission of what it dominates would bring (Eqs. 3-4, :func:`dominator_scores`). Nodes are bucketed by
``score / s_max`` into ``L`` levels; the top-most node of a level (no dominator of
it in the same level) gives the candidate ``S = T.des(v) - {v}``, cut down to what
the F-Trans validity check accepts (:func:`restrict`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import rustworkx as rx

from magis.analysis.axes import Axis
from magis.analysis.dgraph import DGraph, Dimension, build_dgraph
from magis.analysis.ftrans import (
    FTrans,
    InvalidFission,
    convexity_breakers,
    is_view,
    plan_fission,
    reach,
    unlinked_reads,
    weak_components,
)
from magis.cost.memory import MemoryProfile, StorageKey
from magis.ir.graph import Graph

#: Algorithm 1's default number of score levels (L = 4 in the paper's evaluation).
DEFAULT_LEVELS = 4


@dataclass(frozen=True)
class Candidate:
    """One F-Tree node's sub-graph and dimension: ``(S, D)`` without its ``n``."""

    axes: tuple[tuple[str, Axis], ...]  # (node of S, its axis in D), sorted by name
    dimension: int  # index into the D-Graph's dimensions
    label: str  # the dimension's readable name
    length: int  # every fission number of this node divides it
    score: float  # Eq. (4) of the dominator that gave it
    dominator: str
    blocked_by: tuple[str, ...] = ()  # operators without a dimension rule the dominator's set lost
    parent: int | None = None  # index of the smallest candidate containing this one

    @cached_property
    def nodes(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.axes)


@dataclass(frozen=True)
class FTree:
    """An F-Tree state: the candidates (parents before children) and ``n`` of each."""

    candidates: tuple[Candidate, ...]
    parts: tuple[int, ...]  # 1 = disabled

    def __len__(self) -> int:
        return len(self.candidates)

    def enabled(self, i: int) -> bool:
        return self.parts[i] > 1

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.candidates]
        for i, c in enumerate(self.candidates):
            if c.parent is not None:
                kids[c.parent].append(i)
        return tuple(tuple(k) for k in kids)

    def ancestors(self, i: int) -> Iterator[int]:
        """Parent, grandparent... of node ``i``."""
        parent = self.candidates[i].parent
        while parent is not None:
            yield parent
            parent = self.candidates[parent].parent

    def descendants(self, i: int) -> Iterator[int]:
        stack = list(self.children[i])
        while stack:
            j = stack.pop()
            yield j
            stack.extend(self.children[j])

    def has_enabled_ancestor(self, i: int) -> bool:
        return any(self.enabled(a) for a in self.ancestors(i))

    def has_enabled_descendant(self, i: int) -> bool:
        return any(self.enabled(d) for d in self.descendants(i))

    def available_length(self, i: int) -> int:
        """The length node ``i`` can still split: enabled ancestors on the same dimension
        already divided it."""
        length = self.candidates[i].length
        for a in self.ancestors(i):
            if self.enabled(a) and self.candidates[a].dimension == self.candidates[i].dimension:
                length //= self.parts[a]
        return length

    def consistent(self) -> bool:
        """Every enabled node's ``n`` divides what its enabled ancestors left of its length."""
        return all(self.available_length(i) % self.parts[i] == 0 for i in range(len(self)) if self.enabled(i))

    def outermost_enabled(self) -> tuple[int, ...]:
        """Enabled nodes without an enabled ancestor: the F-Trans applied to the graph itself."""
        return tuple(i for i in range(len(self)) if self.enabled(i) and not self.has_enabled_ancestor(i))

    def fission(self, i: int) -> FTrans:
        """The F-Trans of enabled node ``i``, with its enabled descendants nested inside."""
        return FTrans(self.candidates[i].axes, self.parts[i], tuple(self.fission(j) for j in self._inner(i)))

    def _inner(self, i: int) -> list[int]:
        """The top-most enabled nodes below ``i``."""
        found = []
        stack = list(self.children[i])
        while stack:
            j = stack.pop()
            if self.enabled(j):
                found.append(j)
            else:
                stack.extend(self.children[j])
        return sorted(found)

    def with_parts(self, changes: Mapping[int, int]) -> FTree:
        """A new state with some nodes' fission numbers changed."""
        return replace(self, parts=tuple(changes.get(i, n) for i, n in enumerate(self.parts)))


# ------------------------------------------------------------------ Algorithm 1
def build_ftree(
    graph: Graph,
    profile: MemoryProfile,
    levels: int = DEFAULT_LEVELS,
    parts: int = 2,
    dgraph: DGraph | None = None,
) -> FTree:
    """Algorithm 1: fission candidates of every D-Graph component, arranged in a tree.

    ``profile`` is the memory simulation of the schedule whose hot-spots the
    candidates target; ``parts`` is the ``n`` of Eq. (4). Candidates that partly
    overlap a better-scored one are dropped, so the tree is laminar: two nodes are
    nested or disjoint.
    """
    dgraph = dgraph if dgraph is not None else build_dgraph(graph)
    index = HotSpotIndex.of(graph, profile.hotspots)
    found: list[Candidate] = []
    for dimension in dgraph.dimensions:
        if dimension.length >= 2 and len(dimension.nodes) > 2:
            found.extend(component_candidates(graph, dgraph, dimension, index, levels, parts))
    return _as_tree(found)


def component_candidates(
    graph: Graph, dgraph: DGraph, dimension: Dimension, index: HotSpotIndex, levels: int, parts: int
) -> list[Candidate]:
    """Algorithm 1, lines 4-15, for one component ``D``."""
    members = dimension.nodes
    idom = dominator_tree(graph, members, component_entries(graph, members))
    scores = dominator_scores(graph, idom, index, parts)
    s_max = max(scores.values(), default=0.0)
    if s_max <= 0:
        return []
    dominated = dominated_sets(graph, idom)
    single = {n: axes[0] for n in members if len(axes := dgraph.axes_in(n, dimension.index)) == 1}
    found = []
    for level in range(1, levels + 1):
        bucket = {v for v, s in scores.items() if level / levels <= s / s_max < (level + 1) / levels}
        for v in sorted(bucket, key=graph.index.__getitem__):
            if _has_dominator_in(idom, v, bucket):
                continue
            below = with_expanding_producers(graph, dominated[v] - {v}, single)
            axes = restrict(graph, dgraph, {n: single[n] for n in below if n in single}, index, parts)
            candidate = _validated(graph, dgraph, axes, dimension, scores[v], v)
            if candidate is not None:
                found.append(replace(candidate, blocked_by=unsupported_ops(graph, dgraph, below)))
    return found


def with_expanding_producers(graph: Graph, below: frozenset[str], single: Mapping[str, Axis]) -> frozenset[str]:
    """``below`` (the nodes a dominator spans) with the producers it alone reads whose inputs
    along the dimension are no larger than their output, transitively: computed part by part
    inside the region, each costs no more memory than before and its whole output is never
    live. What this adds: an unpacked bit mask (:mod:`magis.rules.compact`, Echo §IV-B) whose
    packed input was made in the forward, outside the backward's dominator; without it, the
    region reads the whole unpacked mask from outside and packing frees nothing inside.
    Random ops, inputs and the graph's outputs stay where they are."""
    inside = set(below)
    outputs = set(graph.outputs)
    frontier = {p for n in inside for p in graph[n].inputs if p not in inside}
    while frontier:
        name = frontier.pop()
        node = graph[name]
        if name in inside or name not in single or node.random or node.is_input or name in outputs:
            continue
        if any(reader not in inside for reader in graph.consumers[name]):
            continue
        made = sum(graph.storage_bytes[k] for k in graph.storages[name] if k is not None)
        along = [p for p in node.inputs if p in single]
        read = sum(graph.storage_bytes[k] for p in along for k in graph.storages[p] if k is not None)
        if read > made:
            continue
        inside.add(name)
        frontier.update(p for p in node.inputs if p not in inside)
    return frozenset(inside)


def unsupported_ops(graph: Graph, dgraph: DGraph, nodes: frozenset[str]) -> tuple[str, ...]:
    """Names of the operators among ``nodes`` that have no dimension rule."""
    return tuple(
        sorted(
            {graph[n].op_name for n in nodes if n not in dgraph.supported and graph[n].target is not operator.getitem}
        )
    )


def component_entries(graph: Graph, members: frozenset[str]) -> tuple[str, ...]:
    """The entry of ``G'``, Algorithm 1's input tensor: of the nodes of ``G'`` without a
    predecessor in it, the one from which the most of ``G'`` is reached, the user's first
    input on a tie (the model input; the labels come after it and reach only the loss and
    the backward). Usually that is the model input; where a layer's reshape cuts the
    dimension off the input (an LSTM projects every time step at once, merging time and
    batch as ``[T*B, E]`` with the batch inside, so the batch leaves the input's dimension
    there) it is where the dimension starts again, ahead of the rest of the step. A
    dimension no user input has (the heads of one layer, a convolution's output channels) is
    entered at every operator of ``G'`` that reads no other operator of it: the weights and
    buffers that bring the dimension are read a slice per part, never computed, so they
    dominate nothing (entered at them, each dominated its own reader alone, and a stem's
    channels at batch 1 were never a candidate). Where ``G'`` holds no operator, at its
    sources."""
    dag, ids = _member_dag(graph, members)
    sources = [name for name, i in ids.items() if dag.in_degree(i) == 0]
    user = [name for name in graph.signature.user_inputs if name in members]
    if not user:
        computed = {name for name in members if not graph[name].is_input}
        first = [name for name in computed if not any(p in computed for p in graph[name].inputs)]
        return tuple(sorted(first, key=graph.index.__getitem__)) if first else tuple(sources)
    return (max(sources, key=lambda n: (len(rx.descendants(dag, ids[n])), n == user[0])),)


def _member_dag(graph: Graph, members: frozenset[str]) -> tuple[rx.PyDiGraph, dict[str, int]]:
    """The data-flow graph ``G' = graph[members]`` and each member's index in it."""
    dag = rx.PyDiGraph()
    ids = {name: dag.add_node(name) for name in sorted(members, key=graph.index.__getitem__)}
    for name, i in ids.items():
        for p in graph[name].inputs:
            if p in members:
                dag.add_edge(ids[p], i, None)
    return dag, ids


def dominator_tree(graph: Graph, members: frozenset[str], entries: tuple[str, ...]) -> dict[str, str | None]:
    """Immediate dominators of the data-flow graph ``G' = graph[members]`` entered at
    ``entries`` through a virtual root (``None``). Nodes the entries do not reach are left out."""
    dag, ids = _member_dag(graph, members)
    root = dag.add_node(None)
    for name in entries:
        dag.add_edge(root, ids[name], None)
    idom = rx.immediate_dominators(dag, root)
    return {name: dag[idom[i]] for name, i in ids.items() if i in idom}


def _has_dominator_in(idom: Mapping[str, str | None], v: str, bucket: set[str]) -> bool:
    parent = idom[v]
    while parent is not None:
        if parent in bucket:
            return True
        parent = idom[parent]
    return False


def dominated_sets(graph: Graph, idom: Mapping[str, str | None]) -> dict[str, frozenset[str]]:
    """``T.des(v)``: every node ``v`` dominates, itself included."""
    below: dict[str, set[str]] = {v: {v} for v in idom}
    for v in sorted(idom, key=graph.index.__getitem__, reverse=True):  # dominated after dominator
        parent = idom[v]
        if parent is not None:
            below[parent] |= below[v]
    return {v: frozenset(s) for v, s in below.items()}


@dataclass(frozen=True)
class HotSpotIndex:
    """What Eqs. (3)-(4) need per node, computed once per graph and hot-spot set ``H``:
    its hot-spot bytes, its storages outside ``H``, and a bit per node for set masks."""

    sizes: Mapping[StorageKey, int]
    names: tuple[str, ...]  # node of each bit
    bit: Mapping[str, int]
    hot: Mapping[str, tuple[StorageKey, ...]]  # the hot-spot storages each node owns
    cold: Mapping[str, tuple[StorageKey, ...]]  # storages of each node's value not in H
    cold_mask: int  # nodes whose value has a storage not in H

    @staticmethod
    def of(graph: Graph, hotspots: frozenset[StorageKey]) -> HotSpotIndex:
        sizes = graph.storage_bytes
        names = tuple(n.name for n in graph.nodes)
        bit = {name: 1 << i for i, name in enumerate(names)}
        hot: dict[str, tuple[StorageKey, ...]] = {}
        for key in sorted(hotspots):
            hot[key[0]] = (*hot.get(key[0], ()), key)
        cold = {n: tuple(k for k in graph.storages[n] if k is not None and k not in hotspots) for n in names}
        cold_mask = sum(bit[n] for n, keys in cold.items() if keys)
        return HotSpotIndex(sizes, names, bit, hot, cold, cold_mask)

    def hot_bytes(self, name: str) -> int:
        """Bytes of the hot-spot storages node ``name`` owns."""
        return sum(self.sizes[key] for key in self.hot.get(name, ()))


def dominator_scores(
    graph: Graph, idom: Mapping[str, str | None], index: HotSpotIndex, parts: int = 2
) -> dict[str, float]:
    """Eqs. (3)-(4): ``heat(v)`` = bytes of the hot-spots ``v`` dominates, and
    ``score(v) = (1 - 1/n) heat(v) - |inputs of T.des(v) not in H|``.

    Sets are bit masks over the graph's node positions, accumulated from the
    dominator tree's leaves up, so all scores cost one pass.
    """
    bit = index.bit
    heat = {v: index.hot_bytes(v) for v in idom}
    inside = dict.fromkeys(idom, 0)
    reads = {v: sum(bit[p] for p in graph[v].inputs) for v in idom}
    for v in sorted(idom, key=graph.index.__getitem__, reverse=True):  # dominated after dominator
        inside[v] |= bit[v]
        parent = idom[v]
        if parent is not None:
            inside[parent] |= inside[v]
            reads[parent] |= reads[v]
            heat[parent] += heat[v]
    scores = {}
    for v in idom:
        outside = reads[v] & ~inside[v] & index.cold_mask
        keys = {key for i in _bits(outside) for key in index.cold[index.names[i]]}
        scores[v] = (1 - 1 / parts) * heat[v] - sum(index.sizes[k] for k in keys)
    return scores


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def restrict(
    graph: Graph, dgraph: DGraph, axes: Mapping[str, Axis], index: HotSpotIndex, parts: int = 2
) -> dict[str, Axis]:
    """The part of a candidate sub-graph an F-Trans can split well (Algorithm 1, line 15).

    Drops nodes without a rule and random nodes, then, until nothing changes, the
    nodes :func:`_unfit` names. A sub-graph that is not convex loses either the nodes
    downstream of its escaping paths or those upstream of them, whichever leaves the
    larger :func:`split_gain` (a forward part and a backward part joined through the
    loss keep the one whose split lowers the peak). Of the weakly connected pieces
    left, keeps the one with the largest gain.
    """
    keep = {n: a for n, a in axes.items() if n in dgraph.supported and not graph[n].random}
    while True:
        drop = _unfit(graph, dgraph, keep)
        if not drop and keep:
            inside = set(keep)
            downstream = convexity_breakers(graph, inside)
            if downstream:
                upstream = _upstream_of_escapes(graph, inside)
                drop = max((downstream, upstream), key=lambda d: split_gain(graph, index, inside - d, parts))
        if not drop:
            break
        keep = {n: a for n, a in keep.items() if n not in drop}
    pieces = weak_components(graph, keep)
    best = max(pieces, key=lambda p: (split_gain(graph, index, p, parts), len(p)), default=set())
    return {n: keep[n] for n in best}


def split_gain(graph: Graph, index: HotSpotIndex, nodes: set[str], parts: int) -> float:
    """Eq. (2) for the outputs ``nodes`` keep: the hot-spots they compute and use up
    themselves shrink to ``1/n``; the storages their outputs keep stay whole, and those
    that were not hot-spots (made after the peak) are now held at it."""
    if not nodes:
        return 0.0
    kept = {key for name in graph.subgraph_outputs(nodes) for key in graph.storages[name] if key is not None}
    inner = sum(index.sizes[key] for name in nodes for key in index.hot.get(name, ()) if key not in kept)
    cold = {key for key in kept if key[0] in nodes and key in index.cold[key[0]]}
    return (1 - 1 / parts) * inner - sum(index.sizes[key] for key in cold)


def _unfit(graph: Graph, dgraph: DGraph, keep: Mapping[str, Axis]) -> set[str]:
    """Nodes the F-Trans check would reject, or that the region would copy for nothing:
    tuples read outside and ``getitem`` of tuples outside; readers of a producer inside
    off the split axis; views of the sub-graph's inputs (nothing to split: they are cut
    as inputs instead); and outputs that are views (a region returns new tensors, so
    it would copy them: their bases are the outputs instead)."""
    inside = set(keep)
    storages = graph.storages
    outputs = graph.subgraph_outputs(inside) if inside else ()
    drop = set()
    for name in inside:
        node = graph[name]
        keys = [k for k in storages[name] if k is not None]
        if (
            (node.tuple_output and any(c not in inside for c in graph.consumers[name]))
            or (node.target is operator.getitem and node.args[0].name not in inside)
            or unlinked_reads(graph, dgraph, keep, name)
            or (keys and all(owner not in inside for owner, _ in keys))
        ):
            drop.add(name)
    drop.update(name for name in outputs if is_view(graph, name))
    return drop


def _upstream_of_escapes(graph: Graph, nodes: set[str]) -> set[str]:
    """Nodes of ``nodes`` with a path that leaves them and comes back in: dropping them
    (the other cure to :func:`~magis.rules.fission.convexity_breakers`) leaves a convex set."""
    exits = [s for n in nodes for s in graph.successors[n] if s not in nodes]
    entries = [p for n in nodes for p in graph.predecessors[n] if p not in nodes]
    through = (reach(graph, exits, nodes, forward=True) & reach(graph, entries, nodes, forward=False)) - nodes
    return reach(graph, through, nodes, forward=False) & nodes


def _validated(
    graph: Graph, dgraph: DGraph, axes: Mapping[str, Axis], dimension: Dimension, score: float, dominator: str
) -> Candidate | None:
    """The candidate if the F-Trans check accepts it with its smallest fission number."""
    if len(axes) < 2:
        return None
    lengths = [dgraph.dims[n].lengths[a] for n, a in axes.items()]
    length = math.gcd(*lengths)
    if length < 2:
        return None
    f = FTrans.of(axes, next_divisor(length, 1))
    try:
        plan = plan_fission(graph, dgraph, f)
    except InvalidFission:
        return None
    sliced = [graph[name].meta.shape[dim] for name, dim in zip(plan.inputs, plan.slice_dims) if dim is not None]
    length = math.gcd(length, *sliced)
    if length < 2:
        return None
    return Candidate(f.axes, dimension.index, dimension.label, length, score, dominator)


def next_divisor(length: int, n: int) -> int | None:
    """The smallest divisor of ``length`` above ``n`` (None when ``n`` is the largest):
    the next fission number of a node of that length (Mutating rule, Figure 7d)."""
    return next((d for d in range(n + 1, length + 1) if length % d == 0), None)


def update_ftree(
    tree: FTree,
    graph: Graph,
    profile: MemoryProfile,
    touched: Collection[str],
    levels: int = DEFAULT_LEVELS,
    dgraph: DGraph | None = None,
) -> FTree:
    """Re-analysis after a rewrite (MAGIS Alg. 3, ``Analyze``): ``tree`` was built for the
    graph before it, ``graph`` is the graph after it and ``touched`` the nodes it added,
    removed or changed.

    The candidates the rewrite left alone keep their fission numbers; Algorithm 1 runs
    again only on the D-Graph components of ``graph`` that hold a touched node, with the
    hot-spots of ``profile`` (a schedule of ``graph``). New candidates that partly overlap
    a kept one are dropped, so the result stays laminar and keeps every candidate the
    rewrite left alone. An enabled candidate the rewrite touched passes its fission number
    to its heir (:func:`_heir`) where the tree stays consistent: a rewrite inside a
    fissioned region (masks packed in every layer of BERT's) keeps the region fissioned,
    rather than making a state that needs a second step, from far above the best, to
    fission it again.
    """
    dgraph = dgraph if dgraph is not None else build_dgraph(graph)
    touched = set(touched)
    parts: dict[tuple, int] = {}
    kept = []
    moved: list[tuple[Candidate, int]] = []
    for c, n in zip(tree.candidates, tree.parts):
        if c.nodes.isdisjoint(touched) and all(name in graph for name in c.nodes):
            dimension = dgraph.dimensions[dgraph.component[c.axes[0]]]
            kept.append(replace(c, dimension=dimension.index, label=dimension.label, parent=None))
            parts[c.axes] = n
        elif n > 1:
            moved.append((c, n))
    index = HotSpotIndex.of(graph, profile.hotspots)
    fresh: list[Candidate] = []
    for dimension in dgraph.dimensions:
        if dimension.length >= 2 and len(dimension.nodes) > 2 and not dimension.nodes.isdisjoint(touched):
            found = component_candidates(graph, dgraph, dimension, index, levels, 2)
            fresh.extend(c for c in found if c.axes not in parts)
    kept.extend(fresh)
    inherited = dict(parts)
    for c, n in moved:
        heir = _heir(c, fresh, graph, touched)
        if heir is not None and heir.length % n == 0:
            inherited.setdefault(heir.axes, n)
    result = _with_parts(kept, inherited)
    return result if result.consistent() or len(inherited) == len(parts) else _with_parts(kept, parts)


def _with_parts(found: list[Candidate], parts: Mapping[tuple, int]) -> FTree:
    """The laminar tree of ``found`` (enabled candidates kept first) with the fission numbers
    ``parts`` (by ``axes``; 1 for the rest)."""
    result = _as_tree(found, {axes: 0 if n > 1 else 1 for axes, n in parts.items()})
    return result.with_parts({i: parts.get(c.axes, 1) for i, c in enumerate(result.candidates)})


def _heir(old: Candidate, fresh: Sequence[Candidate], graph: Graph, touched: Collection[str]) -> Candidate | None:
    """The candidate of ``fresh`` that holds the most of what the rewrite left of ``old`` in
    ``graph`` untouched, each node along the same axis, where that is more than half of it:
    the region ``old`` was, with the rewrite inside. Its entry may move (on tiny BERT, masks
    packed where drawn make the first draw the region's dominator, and the embeddings fall
    outside it: 324 of 332 nodes left)."""
    left = {(name, axis) for name, axis in old.axes if name in graph and name not in touched}
    held = {i: len(left.intersection(c.axes)) for i, c in enumerate(fresh)}
    best = max(held, key=lambda i: (held[i], -len(fresh[i].axes)), default=None)
    return fresh[best] if best is not None and 2 * held[best] > len(left) else None


def _as_tree(found: list[Candidate], rank: Mapping[tuple, int] | None = None) -> FTree:
    """Keep a laminar family (by ``rank`` of their ``axes``: 0 and 1 first, unranked (2) last;
    then best score first), then link each to its smallest superset."""
    rank = rank or {}
    kept: list[Candidate] = []
    for c in sorted(found, key=lambda c: (rank.get(c.axes, 2), -c.score, -len(c.nodes))):
        if all(c.nodes.isdisjoint(k.nodes) or c.nodes < k.nodes or k.nodes < c.nodes for k in kept):
            kept.append(c)
    kept.sort(key=lambda c: -len(c.nodes))  # parents before children
    linked = []
    for i, c in enumerate(kept):
        supersets = [j for j in range(i) if c.nodes < kept[j].nodes]
        parent = max(supersets, key=lambda j: -len(kept[j].nodes), default=None)
        linked.append(replace(c, parent=parent))
    return FTree(tuple(linked), (1,) * len(linked))
