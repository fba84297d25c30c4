"""Validity of an F-Trans ``f = (S, D, n)`` (MAGIS §4.2): the analysis behind fission.

An F-Trans splits the sub-graph ``S`` along the D-Graph dimension ``D`` into ``n``
parts that run one after another. It is valid when (:func:`plan_fission`):

1. ``S`` is weakly connected and convex (no path leaves ``S`` and comes back);
2. every node of ``S`` has exactly one axis in ``D`` (``FTrans.axes``), has a
   dimension rule, and is not random (a part would draw other random numbers);
3. every edge inside ``S`` is linked in ``D``: the consumer reads the producer's
   ``D`` axis along its own ``D`` axis, at every argument that reads it;
4. ``n`` divides the length of every ``D`` axis, sliced input and size constant.

:func:`plan_fission` also says which inputs of ``S`` are sliced and which outputs
concatenated or summed; :mod:`magis.rules.fission` rewrites the graph accordingly,
and the F-Tree (:mod:`magis.analysis.ftree`) proposes candidates with these checks.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from magis.analysis.axes import Axis, scale_sizes
from magis.analysis.dgraph import DGraph
from magis.ir.graph import Graph


class InvalidFission(ValueError):
    """An F-Trans that breaks a validity condition; the message names the node and why."""


@dataclass(frozen=True)
class FTrans:
    """``f = (S, D, n)``: the nodes of ``S``, each with its axis on ``D``, split into ``parts``.

    ``inner`` are F-Trans nested inside this one (enabled F-Tree descendants): they
    apply to the graph of one part, after this split (outermost first).
    """

    axes: tuple[tuple[str, Axis], ...]  # (node, its axis in D), sorted by node name
    parts: int
    inner: tuple[FTrans, ...] = ()

    @staticmethod
    def of(axes: Mapping[str, Axis], parts: int, inner: Iterable[FTrans] = ()) -> FTrans:
        return FTrans(tuple(sorted(axes.items())), parts, tuple(inner))

    @cached_property
    def nodes(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.axes)

    @cached_property
    def axis(self) -> dict[str, Axis]:
        return dict(self.axes)


@dataclass(frozen=True)
class FissionBoundary:
    """How a valid F-Trans meets the rest of the graph: the inputs of ``S`` it slices
    into parts (or shares whole), the outputs whose parts it concatenates (or sums)."""

    inputs: tuple[str, ...]
    slice_dims: tuple[int | None, ...]  # per input: the dimension cut into parts, None = shared
    outputs: tuple[str, ...]
    concat_dims: tuple[int | None, ...]  # per output: the dimension parts fill, None = summed


# ------------------------------------------------------------------ validity
def plan_fission(graph: Graph, dgraph: DGraph, f: FTrans) -> FissionBoundary:
    """Check the validity conditions of ``f`` on ``graph`` (module docstring); raise
    :class:`InvalidFission` naming the first broken one, else return its :class:`FissionBoundary`."""
    if f.parts < 2:
        raise InvalidFission(f"the fission number must be at least 2, got {f.parts}")
    if not f.nodes:
        raise InvalidFission("the sub-graph is empty")
    for name in sorted(f.nodes):
        _check_node(graph, dgraph, name, f.axis.get(name))
    _check_tuples(graph, f.nodes)
    _check_connected(graph, f.nodes)
    _check_convex(graph, f.nodes)
    inputs = _input_slices(graph, dgraph, f)
    outputs = _output_concats(graph, dgraph, f)
    _check_divisible(graph, dgraph, f, inputs)
    return FissionBoundary(tuple(inputs), tuple(inputs.values()), tuple(outputs), tuple(outputs.values()))


def is_valid(graph: Graph, dgraph: DGraph, f: FTrans) -> bool:
    try:
        plan_fission(graph, dgraph, f)
    except InvalidFission:
        return False
    return True


def _check_node(graph: Graph, dgraph: DGraph, name: str, axis: Axis | None) -> None:
    if name not in graph:
        raise InvalidFission(f"node {name} is not in the graph")
    node = graph[name]
    if node.is_input:
        raise InvalidFission(f"{name} is a graph input: it cannot be split inside a region")
    if node.random:
        raise InvalidFission(f"{name} ({node.op_name}) is random: a part would draw other random numbers")
    if name not in dgraph.supported:
        raise InvalidFission(f"{name} ({node.op_name}) has no dimension rule")
    if axis not in dgraph.dims[name].lengths:
        raise InvalidFission(f"{name} ({node.op_name}) has no axis {axis}")


def _check_tuples(graph: Graph, nodes: frozenset[str]) -> None:
    """A tuple-valued node and the ``getitem`` nodes that read it go together."""
    for name in nodes:
        node = graph[name]
        if node.tuple_output and any(c not in nodes for c in graph.consumers[name]):
            raise InvalidFission(f"the tuple of {name} ({node.op_name}) is read outside the sub-graph")
        if node.target is operator.getitem and node.args[0].name not in nodes:
            raise InvalidFission(f"{name} reads a tuple from outside the sub-graph")


def _check_connected(graph: Graph, nodes: frozenset[str]) -> None:
    pieces = weak_components(graph, nodes)
    if len(pieces) > 1:
        raise InvalidFission(f"the sub-graph is not weakly connected ({len(pieces)} pieces)")


def weak_components(graph: Graph, nodes: Iterable[str]) -> list[set[str]]:
    """The weakly connected pieces of ``graph[nodes]`` (data edges either way)."""
    left = set(nodes)
    pieces = []
    while left:
        start = left.pop()
        piece = {start}
        stack = [start]
        while stack:
            name = stack.pop()
            for other in (*graph[name].inputs, *graph.consumers[name]):
                if other in left:
                    left.remove(other)
                    piece.add(other)
                    stack.append(other)
        pieces.append(piece)
    return pieces


def _check_convex(graph: Graph, nodes: frozenset[str]) -> None:
    """No path leaves the sub-graph and comes back (MAGIS §4.2 condition 2)."""
    escaped = convexity_breakers(graph, nodes)
    if escaped:
        name = min(escaped, key=graph.index.__getitem__)
        raise InvalidFission(f"the sub-graph is not convex: {name} depends on it through a node outside it")


def convexity_breakers(graph: Graph, nodes: frozenset[str] | set[str]) -> set[str]:
    """Nodes of ``nodes`` reachable from ``nodes`` through a node outside them (MAGIS
    §4.2 condition 2 fails exactly when there is one); without them the set is convex."""
    return reach(graph, [s for n in nodes for s in graph.successors[n] if s not in nodes], nodes, forward=True) & nodes


def reach(graph: Graph, starts: Iterable[str], span: Iterable[str], forward: bool) -> set[str]:
    """Nodes reachable from ``starts`` (along edges, or against them) that lie between
    the first and the last node of ``span`` in graph order: in a topologically sorted
    graph no path from outside that range leads back into ``span``."""
    positions = [graph.index[n] for n in span]
    low, high = min(positions), max(positions)
    edges = graph.successors if forward else graph.predecessors
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        name = stack.pop()
        if name not in seen and low <= graph.index[name] <= high:
            seen.add(name)
            stack.extend(edges[name])
    return seen


def unlinked_reads(graph: Graph, dgraph: DGraph, axis: Mapping[str, Axis], name: str) -> list[str]:
    """The producers inside ``axis`` that node ``name`` reads off the split axis."""
    own = axis[name]
    bad = []
    for read in dgraph.reads(name):
        if read.source not in axis:
            continue
        theirs = axis[read.source]
        visible = dgraph.dims[read.source].visible(read.element)
        if not any(mine == own and t == theirs for mine, t in zip(read.axes, visible)):
            bad.append(read.source)
    return bad


def _input_slices(graph: Graph, dgraph: DGraph, f: FTrans) -> dict[str, int | None]:
    """Per input of ``S``: the dimension to slice (linked to its reader's ``D`` axis) or None."""
    slices: dict[str, int | None] = {}
    for name in sorted(f.nodes, key=graph.index.__getitem__):
        bad = unlinked_reads(graph, dgraph, f.axis, name)
        if bad:
            raise InvalidFission(f"{name} ({graph[name].op_name}) does not read {bad[0]} along the split axis")
        for read in dgraph.reads(name):
            if read.source in f.nodes:
                continue
            dims = [d for d, a in enumerate(read.axes) if a == f.axis[name]]
            if len(dims) > 1:
                raise InvalidFission(f"{name} reads {read.source} along the split axis twice")
            dim = dims[0] if dims else None
            if slices.setdefault(read.source, dim) != dim:
                raise InvalidFission(f"input {read.source} is read both sliced and whole (by {name})")
    return slices


def _output_concats(graph: Graph, dgraph: DGraph, f: FTrans) -> dict[str, int | None]:
    """Per output of ``S``: the dimension its parts are concatenated along, or None (summed)."""
    concats: dict[str, int | None] = {}
    for name in graph.subgraph_outputs(f.nodes):
        dims = dgraph.dims[name]
        axis = f.axis[name]
        if is_view(graph, name):
            raise InvalidFission(f"output {name} ({graph[name].op_name}) is a view: the region would return a copy")
        if axis in (dims.outputs[0] or ()):
            concats[name] = dims.outputs[0].index(axis)
        elif axis in dims.reductions[0]:
            concats[name] = None
        else:
            raise InvalidFission(f"output {name} ({graph[name].op_name}) does not vary along the split axis")
    return concats


def is_view(graph: Graph, name: str) -> bool:
    """The node's value shares the storage of another value (``getitem`` of a freshly
    computed tuple element is that element, not a view of it)."""
    node = graph[name]
    if node.aliases[0] is None:
        return False
    if node.target is operator.getitem:
        producer = graph[node.args[0].name]
        return producer.aliases[node.args[1]] is not None
    return True


def _check_divisible(graph: Graph, dgraph: DGraph, f: FTrans, slices: Mapping[str, int | None]) -> None:
    n = f.parts
    for name, axis in f.axes:
        length = dgraph.dims[name].lengths[axis]
        if length % n:
            raise InvalidFission(f"{name}: axis {axis} has length {length}, not divisible by {n}")
        try:
            scale_sizes(graph[name], dgraph.dims[name], axis, n)
        except ValueError as err:
            raise InvalidFission(f"{name} ({graph[name].op_name}): {err}") from err
    for name, dim in slices.items():
        if dim is not None and graph[name].meta.shape[dim] % n:
            raise InvalidFission(
                f"input {name}: dimension {dim} ({graph[name].meta.shape[dim]}) is not divisible by {n}"
            )
