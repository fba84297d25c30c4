"""The dimension graph, D-Graph (MAGIS §4.1).

One vertex ``<v, i>`` per axis ``i`` of every node ``v`` (its output dimensions and
its reduce axes, :mod:`magis.analysis.dim_rules`); an edge joins ``<u, i>`` and
``<v, j>`` when ``v`` reads ``u`` and dimension ``i`` of ``u`` runs along axis ``j`` of
``v``. Its connected components are the graph-level dimensions a fission can split
along: the batch, the sequence, the attention heads, the channels of a block...

A node without a dimension rule keeps vertices for its output dimensions (its
readers may link to them) but no edge runs through it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

from magis.analysis.axes import Axis, AxisMap, OpDims, opaque_dims
from magis.analysis.dim_rules import op_dims
from magis.ir.graph import Graph

Vertex = tuple[str, Axis]


@dataclass(frozen=True)
class Read:
    """One tensor argument of a node: it reads output ``element`` of ``source``, and
    ``axes[d]`` is the reader's axis along visible axis ``d`` of that element."""

    source: str
    element: int
    axes: AxisMap


@dataclass(frozen=True)
class Dimension:
    """A connected component of the D-Graph: one graph-level dimension."""

    index: int
    vertices: frozenset[Vertex]
    length: int  # gcd of its vertices' lengths: every valid fission number divides it
    label: str  # a representative vertex, e.g. ``input_ids.dim0``

    @cached_property
    def nodes(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.vertices)


@dataclass(frozen=True, eq=False)
class DGraph:
    """The D-Graph of ``graph``: per-node dims, and the components of its vertices."""

    graph: Graph
    dims: Mapping[str, OpDims]  # every node; nodes without a rule get opaque dims
    supported: frozenset[str]  # nodes that have a dimension rule
    component: Mapping[Vertex, int]  # vertex -> index into ``dimensions``
    dimensions: tuple[Dimension, ...]

    def reads(self, name: str) -> tuple[Read, ...]:
        """The tensor arguments of node ``name`` with the axes they run along."""
        return tuple(
            Read(source, element, axes)
            for (source, element), axes in zip(_sources(self.graph, name), self.dims[name].inputs)
        )

    def axes_in(self, name: str, dimension: int) -> tuple[Axis, ...]:
        """The axes of node ``name`` that belong to ``dimensions[dimension]``."""
        return tuple(a for a in self.dims[name].axes if self.component[(name, a)] == dimension)

    def length(self, vertex: Vertex) -> int:
        name, axis = vertex
        return self.dims[name].lengths[axis]


def _sources(graph: Graph, name: str) -> Iterator[tuple[str, int]]:
    """(node, element) of every tensor argument of ``name``, in ``iter_refs`` order."""
    node = graph[name]
    element = node.args[1] if node.target is operator.getitem else 0
    for ref in node.refs:
        yield ref.name, element


def node_dims(graph: Graph) -> tuple[dict[str, OpDims], frozenset[str]]:
    """Dims of every node (opaque for nodes without a rule) and the set of nodes with a rule."""
    dims: dict[str, OpDims] = {}
    supported: set[str] = set()
    for node in graph.nodes:
        if node.target is operator.getitem:  # described by the tuple it reads
            producer = node.args[0].name
            found = op_dims(graph, node.name, dims[producer])
            ruled = producer in supported
        else:
            found = op_dims(graph, node.name)
            ruled = found is not None
        if ruled:
            supported.add(node.name)
        dims[node.name] = found if found is not None else opaque_dims(node)
    return dims, frozenset(supported)


def links(graph: Graph, dims: Mapping[str, OpDims], name: str) -> Iterator[tuple[Vertex, Vertex]]:
    """D-Graph edges into node ``name``: ``(<u, i>, <name, j>)`` for each linked dimension it reads."""
    for (source, element), axes in zip(_sources(graph, name), dims[name].inputs):
        visible = dims[source].visible(element)
        for own, theirs in zip(axes, visible):
            if own is not None and theirs is not None:
                yield (source, theirs), (name, own)


def build_dgraph(graph: Graph) -> DGraph:
    """The D-Graph of ``graph`` and its connected components (union-find over vertices)."""
    dims, supported = node_dims(graph)
    parent: dict[Vertex, Vertex] = {(n, a): (n, a) for n, d in dims.items() for a in d.axes}

    def find(v: Vertex) -> Vertex:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for node in graph.nodes:
        for u, v in links(graph, dims, node.name):
            ru, rv = find(u), find(v)
            if ru != rv:
                parent[ru] = rv
    groups: dict[Vertex, list[Vertex]] = {}
    for v in parent:
        groups.setdefault(find(v), []).append(v)
    rank = _representative_rank(graph)
    ordered = sorted(groups.values(), key=lambda vs: (-len({n for n, _ in vs}), min(map(rank, vs))))
    dimensions = []
    component: dict[Vertex, int] = {}
    for i, vertices in enumerate(ordered):
        rep = min(vertices, key=rank)
        length = math.gcd(*(dims[n].lengths[a] for n, a in vertices))
        dimensions.append(Dimension(i, frozenset(vertices), length, vertex_label(graph, rep)))
        component.update(dict.fromkeys(vertices, i))
    return DGraph(graph, MappingProxyType(dims), supported, MappingProxyType(component), tuple(dimensions))


def _representative_rank(graph: Graph) -> Callable[[Vertex], tuple[int, int, int]]:
    """Order vertices for labels: the user's inputs first, then parameters, then by position."""
    user = set(graph.signature.user_inputs)

    def rank(v: Vertex) -> tuple[int, int, int]:
        name, axis = v
        kind = 0 if name in user else 1 if graph[name].is_input else 2
        return kind, graph.index[name], abs(axis)

    return rank


def vertex_label(graph: Graph, vertex: Vertex) -> str:
    """``input0.dim0`` for dimension 0 of the user's first input, ``encoder.0.weight.dim1``
    for a parameter's, ``mm_3.reduce1`` for the first reduce axis of node ``mm_3``."""
    name, axis = vertex
    sig = graph.signature
    user = {n: f"input{i}" for i, n in enumerate(sig.user_inputs)}
    readable = sig.parameters.get(name) or sig.buffers.get(name) or user.get(name, name)
    return f"{readable}.dim{axis - 1}" if axis > 0 else f"{readable}.reduce{-axis}"
