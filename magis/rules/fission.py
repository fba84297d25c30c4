"""Fission transformation, F-Trans ``f = (S, D, n)`` (MAGIS §4.2).

An F-Trans splits the sub-graph ``S`` along the D-Graph dimension ``D`` into ``n``
parts that run one after another, so each part's intermediate tensors are ``1/n``
of the originals and are freed before the next part starts. Whether it is valid is
the analysis :func:`magis.analysis.ftrans.plan_fission`.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch

from magis.analysis.axes import scale_sizes
from magis.analysis.dgraph import DGraph, build_dgraph
from magis.analysis.ftrans import FissionBoundary, FTrans, plan_fission, reach
from magis.backend.codegen import part_of
from magis.backend.interpreter import execute
from magis.backend.program import Program, lower
from magis.backend.runtime import bind_arguments
from magis.cost.latency import CostModel
from magis.cost.memory import MemoryProfile, simulate_memory
from magis.cost.region_latency import merge_graph_of, region_seconds
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta

aten = torch.ops.aten


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


def part_graph(graph: Graph, dgraph: DGraph, f: FTrans, plan: FissionBoundary) -> Graph:
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


def whole_graph(graph: Graph, f: FTrans, plan: FissionBoundary) -> Graph:
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
    nothing copied), runs the part's graph with :func:`magis.backend.interpreter.execute`
    (which frees every intermediate after its last use), and writes each of the part's
    outputs into its result as soon as it is made: into its slice along
    ``concat_dims``, or added in (``None``), as autograd adds a gradient into
    ``.grad``. A result is allocated when the first part makes it. The next part
    starts only after the previous one's tensors are gone, so the region holds at most
    one part's memory, its results merged as they come, on top of its results.

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
    def streaming(self) -> Graph:
        """One part whose results are merged as they are made: its outputs are not held to
        the part's end but die at their last use inside the part (or at once)."""
        return replace(self.graph, outputs=())

    @cached_property
    def part_program(self) -> Program:
        """One part lowered for the runtime (its generated loop, :mod:`magis.backend.codegen`)."""
        return lower(self.streaming)

    @property
    def part_outputs(self) -> tuple[str, ...]:
        return self.graph.outputs

    @cached_property
    def part_profile(self) -> MemoryProfile:
        """The memory timeline of one part, its sliced inputs counted as resident and each
        result gone once it is merged."""
        return simulate_memory(self.streaming, [n.name for n in self.graph.nodes])

    @property
    def workspace(self) -> int:
        """Bytes the region holds beyond its inputs and results: the peak of one part,
        less the part's inputs, which are views of the region's inputs."""
        profile = self.part_profile
        return max(profile.timeline, default=0) - profile.persistent_bytes

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        strides = self.result_strides(inputs)
        results: list[torch.Tensor | None] = [None] * len(self.graph.outputs)
        slots: dict[str, list[int]] = {}
        for i, name in enumerate(self.graph.outputs):
            slots.setdefault(name, []).append(i)

        def merge(name: str, piece: torch.Tensor, k: int) -> None:
            """Write part ``k``'s result ``name`` into place as soon as it is made (a
            weight gradient is added in and freed, as autograd's ``AccumulateGrad`` does)."""
            for i in slots.get(name, ()):
                result = results[i]
                if result is None:
                    result = results[i] = self.empty_result(i, strides, piece)
                dim = self.concat_dims[i]
                if dim is not None:
                    part_of(result, dim, k, self.parts).copy_(piece)
                elif k == 0:
                    result.copy_(piece)
                else:
                    result.add_(piece)

        for k in range(self.parts):
            env = {
                name: part_of(x, dim, k, self.parts) for name, x, dim in zip(self.graph.inputs, inputs, self.slice_dims)
            }
            for name in set(self.graph.outputs) & set(self.graph.inputs):  # passed through
                merge(name, env[name], k)
            execute(self.part_program, env, emit=lambda name, value, k=k: merge(name, value, k))
            del env  # the part's tensors die here, before the next part starts
        return tuple(results)  # type: ignore[arg-type]

    def empty_result(self, index: int, strides: tuple[tuple[int, ...], ...], like: torch.Tensor) -> torch.Tensor:
        """Result ``index``, not yet written, on the device of ``like`` (a part's piece of it)."""
        meta = self.output_metas[index]
        return torch.empty_strided(meta.shape, strides[index], dtype=meta.dtype, device=like.device)

    def result_strides(self, inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...], ...]:
        """The strides of the unsplit sub-graph's outputs for inputs laid out as ``inputs``,
        worked out once per layout by running it on meta tensors."""
        key = tuple((tuple(x.shape), x.stride(), x.dtype) for x in inputs)
        if key not in self._layouts:
            self._layouts[key] = _meta_strides(self.whole, inputs)
        return self._layouts[key]

    def estimate_seconds(self, cost_model: CostModel) -> float:
        """The latency :mod:`magis.cost.latency` asks a self-describing target for
        (:func:`magis.cost.region_latency.region_seconds`)."""
        return region_seconds(cost_model, self.graph, self.merge_graph, self.parts)

    @cached_property
    def merge_graph(self) -> Graph:
        """Putting one part's results in place (:func:`magis.cost.region_latency.merge_graph_of`),
        built once: a cost model keeps its prices per graph object."""
        return merge_graph_of([_fresh_meta(self.graph[name].meta) for name in self.graph.outputs], self.concat_dims)


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
