"""Fission transformation, F-Trans ``f = (S, D, n)`` (MAGIS §4.2).

An F-Trans splits the sub-graph ``S`` along the D-Graph dimension ``D`` into ``n``
parts that run one after another, so each part's intermediate tensors are ``1/n``
of the originals and are freed before the next part starts. It is valid when
(:func:`plan_fission`):

1. ``S`` is weakly connected and convex (no path leaves ``S`` and comes back);
2. every node of ``S`` has exactly one axis in ``D`` (``FTrans.axes``), has a
   dimension rule, and is not random (a part would draw other random numbers);
3. every edge inside ``S`` is linked in ``D``: the consumer reads the producer's
   ``D`` axis along its own ``D`` axis, at every argument that reads it;
4. ``n`` divides the length of every ``D`` axis, sliced input and size constant.

Inputs of ``S`` with a dimension on ``D`` are sliced (``narrow``: a view, copied
only when cut along an inner dimension, see :func:`part_graph`), the others are
shared by every part. Outputs whose ``D`` axis is one of their dimensions are
concatenated (each part is written into its slice of the result); outputs whose
``D`` axis is a reduce axis (a weight gradient over the batch) are the sum of the
parts.

The rule replaces ``S`` by ONE region node whose target is a :class:`FissionRegion`
(the graph of one part, run ``n`` times by the magis runtime's interpreter),
followed by one ``getitem`` per output, which takes over the output's name. The
region node's ``workspace`` is the memory a part holds beyond the region's inputs
and outputs, so :func:`magis.cost.memory.simulate_memory` of the new graph is what
the runtime allocates.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch

from magis.analysis.dgraph import DGraph, build_dgraph
from magis.analysis.dim_rules import Axis, scale_sizes
from magis.backend.runtime import Program, execute, lower
from magis.cost.memory import MemoryProfile, simulate_memory
from magis.cost.profiler import bind_arguments
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta

aten = torch.ops.aten


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
class Plan:
    """How a valid F-Trans reads and writes: what to slice, what to concatenate or sum."""

    inputs: tuple[str, ...]
    slice_dims: tuple[int | None, ...]  # per input: the dimension cut into parts, None = shared
    outputs: tuple[str, ...]
    concat_dims: tuple[int | None, ...]  # per output: the dimension parts fill, None = summed


# ------------------------------------------------------------------ validity
def plan_fission(graph: Graph, dgraph: DGraph, f: FTrans) -> Plan:
    """Check the validity conditions of ``f`` on ``graph`` (module docstring); raise
    :class:`InvalidFission` naming the first broken one, else return its :class:`Plan`."""
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
    return Plan(tuple(inputs), tuple(inputs.values()), tuple(outputs), tuple(outputs.values()))


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


# ------------------------------------------------------------------ transformation
def fission(graph: Graph, f: FTrans, dgraph: DGraph | None = None) -> Graph:
    """Apply F-Trans ``f``: ``S`` becomes one region node and a ``getitem`` per output.

    ``dgraph`` is ``graph``'s D-Graph (built if not given). Nested F-Trans in
    ``f.inner`` are applied to the graph of one part. Raises :class:`InvalidFission`.
    """
    dgraph = dgraph if dgraph is not None else build_dgraph(graph)
    plan = plan_fission(graph, dgraph, f)
    part = part_graph(graph, dgraph, f, plan)
    for inner in f.inner:
        part = fission(part, inner)
    metas = tuple(_fresh_meta(graph[name].meta) for name in plan.outputs)
    region = FissionRegion(part, whole_graph(graph, f, plan), plan.slice_dims, plan.concat_dims, metas, f.parts)
    region_name = graph.fresh_name("fission")
    forward = any(graph[n].role in (Role.ACTIVATION, Role.LOSS) for n in f.nodes)
    node = Node(
        name=region_name,
        target=region,
        args=tuple(Ref(name) for name in plan.inputs),
        outputs=metas,
        aliases=(None,) * len(metas),
        role=Role.ACTIVATION if forward else Role.BACKWARD,
        tuple_output=True,
        workspace=region.workspace,
    )
    getitems = [
        Node(name, operator.getitem, (Ref(region_name), i), (), (meta,), ((0, i),), role=graph[name].role)
        for i, (name, meta) in enumerate(zip(plan.outputs, metas))
    ]

    def outer(name: str) -> str:
        return region_name if name in f.nodes else name

    edges = tuple((outer(a), outer(b)) for a, b in graph.order_edges if outer(a) != outer(b))
    return graph.replace(remove=f.nodes, add=[node, *getitems], order_edges=edges)


def fissioned_order(graph: Graph, order: Sequence[str], result: Graph, nodes: Iterable[str]) -> tuple[str, ...]:
    """Carry a schedule of ``graph`` over to ``result``, where ``nodes`` became a region:
    the region (and its ``getitem`` outputs) runs where ``nodes`` ran; the other nodes
    that ran among them go before it, or after it when they depend on ``nodes``
    (convexity: none does both)."""
    inside = set(nodes)
    positions = [i for i, name in enumerate(order) if name in inside]
    first, last = positions[0], positions[-1]
    between = [name for name in order[first : last + 1] if name not in inside]
    exits = [s for n in inside for s in graph.successors[n] if s not in inside]
    later = reach(graph, exits, [*inside, *between], forward=True)
    region = next(n.name for n in result.nodes if n.name not in graph)
    outputs = list(result.consumers[region])
    new = (
        [n for n in order[:first] if n not in inside]
        + [n for n in between if n not in later]
        + [region, *outputs]
        + [n for n in between if n in later]
        + [n for n in order[last + 1 :] if n not in inside]
    )
    result.check_schedule(new)
    return tuple(new)


def part_graph(graph: Graph, dgraph: DGraph, f: FTrans, plan: Plan) -> Graph:
    """The graph of one part: the sliced inputs as graph inputs, then ``S`` with its
    shapes and size constants divided by ``n``; its outputs are ``S``'s outputs.

    An input cut along its leading dimension is a view of the same layout as the
    whole (kernels that took the whole take the part). One cut further in has gaps
    between its rows, and some kernels read such arguments as if they had none
    (``native_layer_norm_backward``'s ``mean``), so the part first copies it into a
    dense tensor of the same dimension order: an explicit ``clone`` the simulator counts.
    """
    n = f.parts
    placeholders: list[Node] = []
    copies: list[Node] = []
    for name, dim in zip(plan.inputs, plan.slice_dims):
        meta = _part_meta(graph[name].meta, dim, n)
        if dim is None or not any(size > 1 for size in graph[name].meta.shape[:dim]):
            placeholders.append(Node(name, None, outputs=(meta,), aliases=(None,), role=Role.INPUT))
            continue
        view = graph.fresh_name(f"{name}_slice")
        placeholders.append(Node(view, None, outputs=(meta,), aliases=(None,), role=Role.INPUT))
        copies.append(Node(name, aten.clone.default, (Ref(view),), (), (_fresh_meta(meta),), (None,)))
    body = []
    for name in sorted(f.nodes, key=graph.index.__getitem__):
        dims = dgraph.dims[name]
        axis = f.axis[name]
        node = scale_sizes(graph[name], dims, axis, n)
        metas = tuple(
            None if meta is None else _part_meta(meta, axes.index(axis) if axis in axes else None, n)
            for meta, axes in zip(node.outputs, (a or () for a in dims.outputs))
        )
        body.append(replace(node, outputs=metas))
    return Graph(tuple(placeholders + copies + body), plan.outputs)


def whole_graph(graph: Graph, f: FTrans, plan: Plan) -> Graph:
    """``S`` on its own, unsplit: its inputs as graph inputs (in the plan's order), its nodes as they are."""
    placeholders = [
        Node(name, None, outputs=(graph[name].meta,), aliases=(None,), role=Role.INPUT) for name in plan.inputs
    ]
    body = [graph[name] for name in sorted(f.nodes, key=graph.index.__getitem__)]
    return Graph((*placeholders, *body), plan.outputs)


def _part_meta(meta: TensorMeta, dim: int | None, parts: int) -> TensorMeta:
    """One part of a tensor cut along ``dim`` (the whole tensor when ``dim`` is None)."""
    if dim is None:
        return meta
    shape = list(meta.shape)
    shape[dim] //= parts
    return TensorMeta(tuple(shape), meta.dtype, meta.nbytes // parts)


def _fresh_meta(meta: TensorMeta) -> TensorMeta:
    """A region output is a new contiguous tensor, even where ``S`` returned a view."""
    return TensorMeta(meta.shape, meta.dtype, meta.numel * meta.dtype.itemsize)


@dataclass(frozen=True, eq=False)
class FissionRegion:
    """The target of a fissioned region node: run one part's graph ``parts`` times.

    Calling it with the region's inputs slices each input along ``slice_dims`` (a view,
    nothing copied), runs the part's graph with :func:`magis.backend.runtime.execute`
    (which frees every intermediate after its last use), and writes the part's
    outputs into the results, allocated after the first part: into their slice along
    ``concat_dims``, or added in (``None``). The next part starts only after the
    previous one's tensors are gone, so the region holds at most one part's memory on
    top of its results.

    A result has the strides the unsplit sub-graph would have given it (a later view
    of it may depend on them): :meth:`result_strides` works them out on meta tensors.
    """

    graph: Graph = field(repr=False)  # one part
    whole: Graph = field(repr=False)  # the sub-graph unsplit (its inputs in the region's order)
    slice_dims: tuple[int | None, ...]  # per input of ``graph`` (``graph.inputs`` order)
    concat_dims: tuple[int | None, ...]  # per output of ``graph``
    output_metas: tuple[TensorMeta, ...]  # the whole results
    parts: int
    _layouts: dict = field(default_factory=dict, init=False, repr=False)  # input layouts -> result strides

    @property
    def __name__(self) -> str:  # read by Node.op_name
        return f"fission[n={self.parts}, {len(self.graph) - len(self.graph.inputs)} ops, {self.digest}]"

    @cached_property
    def digest(self) -> str:
        """A short hash of the part's structure: two regions differ in name when they differ."""
        return self.graph.structural_hash()[:10]

    @cached_property
    def program(self) -> Program:
        return lower(self.graph)

    @cached_property
    def part_profile(self) -> MemoryProfile:
        """The memory timeline of one part, its sliced inputs counted as resident."""
        return simulate_memory(self.graph, [n.name for n in self.graph.nodes])

    @property
    def workspace(self) -> int:
        """Bytes the region holds beyond its inputs and results: the peak of one part,
        less the part's inputs, which are views of the region's inputs."""
        profile = self.part_profile
        return max(profile.timeline, default=0) - profile.persistent_bytes

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results: list[torch.Tensor] = []
        for k in range(self.parts):
            env = {
                name: _part_of(x, dim, k, self.parts)
                for name, x, dim in zip(self.graph.inputs, inputs, self.slice_dims)
            }
            execute(self.program, env)
            if k == 0:
                results = [
                    torch.empty_strided(meta.shape, strides, dtype=meta.dtype, device=inputs[0].device)
                    for meta, strides in zip(self.output_metas, self.result_strides(inputs))
                ]
            results = self._merge(results, [env[name] for name in self.graph.outputs], k)
            del env  # the part's outputs die here, before the next part starts
        return tuple(results)

    def _merge(self, results: list[torch.Tensor], pieces: list[torch.Tensor], k: int) -> list[torch.Tensor]:
        """Write part ``k``'s outputs into the results."""
        for result, piece, dim in zip(results, pieces, self.concat_dims):
            if dim is not None:
                _part_of(result, dim, k, self.parts).copy_(piece)
            elif k == 0:
                result.copy_(piece)
            else:
                result.add_(piece)
        return results

    def result_strides(self, inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...], ...]:
        """The strides of the unsplit sub-graph's outputs for inputs laid out as ``inputs``,
        worked out once per layout by running it on meta tensors."""
        key = tuple((tuple(x.shape), x.stride(), x.dtype) for x in inputs)
        if key not in self._layouts:
            self._layouts[key] = _meta_strides(self.whole, inputs)
        return self._layouts[key]

    def estimate_seconds(self, cost_model: Any) -> float:
        """``n`` times one part's operators, plus writing each part's results into place:
        the latency :mod:`magis.cost.latency` asks a self-describing target for."""
        part = sum(cost_model.node_seconds(self.graph, n.name) for n in self.graph.nodes)
        merge = sum(cost_model.node_seconds(self.merge_graph, n.name) for n in self.merge_graph.nodes)
        return self.parts * (part + merge)

    @cached_property
    def merge_graph(self) -> Graph:
        """The work of putting one part's results in place, as operators a cost model can
        price: a copy (``clone``) per concatenated result, an ``add`` per summed one."""
        nodes: list[Node] = []
        for i, (name, dim) in enumerate(zip(self.graph.outputs, self.concat_dims)):
            meta = _fresh_meta(self.graph[name].meta)
            nodes.append(Node(f"part{i}", None, outputs=(meta,), aliases=(None,), role=Role.INPUT))
            op, args = (
                (aten.clone.default, (Ref(f"part{i}"),))
                if dim is not None
                else (aten.add.Tensor, (Ref(f"part{i}"), Ref(f"part{i}")))
            )
            nodes.append(Node(f"merge{i}", op, args, outputs=(meta,), aliases=(None,)))
        return Graph(tuple(nodes), tuple(n.name for n in nodes[1::2]))


def _meta_strides(graph: Graph, inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...], ...]:
    """Output strides of ``graph`` run on meta tensors laid out as ``inputs`` (no memory, no data)."""
    meta = torch.device("meta")
    values: dict[str, Any] = {
        name: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=meta)
        for name, x in zip(graph.inputs, inputs)
    }
    for node in graph.nodes:
        if not node.is_input:
            args, kwargs = bind_arguments(node, values.__getitem__, meta)
            values[node.name] = node.target(*args, **kwargs)
    return tuple(tuple(values[name].stride()) for name in graph.outputs)


def _part_of(tensor: torch.Tensor, dim: int | None, k: int, parts: int) -> torch.Tensor:
    """Part ``k`` of ``parts`` of ``tensor`` along ``dim`` (a view), or the whole tensor."""
    if dim is None:
        return tensor
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, k * size, size)


# ------------------------------------------------------------------ Eqs. (1)-(2)
@dataclass(frozen=True)
class PeakEstimate:
    """MAGIS Eq. (1): the peak before (``M_0``) and after (``M_f``) an F-Trans."""

    before: int
    after: float

    @property
    def reduction(self) -> float:
        """Eq. (2): ``M_0 - M_f``."""
        return self.before - self.after


def estimate_peak(graph: Graph, profile: MemoryProfile, nodes: Iterable[str], parts: int) -> PeakEstimate:
    """MAGIS Eq. (1): ``M_0 = sum(|v| for v in H)`` and
    ``M_f = sum(|v| for v in (H - S) | I) + sum(|v| for v in H & S) / n``, with ``H`` the
    hot-spot storages of ``profile`` and ``I`` the inputs of ``S``."""
    inside = set(nodes)
    sizes = graph.storage_bytes
    hot = profile.hotspots
    split = {key for key in hot if key[0] in inside}
    inputs = {key for name in graph.subgraph_inputs(inside) for key in graph.storages[name] if key is not None}
    before = sum(sizes[key] for key in hot)
    after = sum(sizes[key] for key in (hot - split) | inputs) + sum(sizes[key] for key in split) / parts
    return PeakEstimate(before, after)
