"""The latency of a fissioned region (MAGIS §4.2, §5 "Simulator").

A region (:class:`magis.rules.fission.FissionRegion`) runs one part's graph ``n``
times, one part after another, and writes each part's results into place as they
are made: into their slice of a concatenated result, or added into a summed one.
Its latency is ``n`` times the part's operators plus that merging, each priced by
the cost model as any other operator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from magis.cost.latency import CostModel
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta

aten = torch.ops.aten


def merge_graph_of(results: Sequence[TensorMeta], concat_dims: Sequence[int | None]) -> Graph:
    """The work of putting one part's ``results`` in place, as operators a cost model can
    price: a copy (``clone``) per concatenated result (``concat_dims[i]`` a dimension),
    an ``add`` per summed one (``None``)."""
    nodes: list[Node] = []
    for i, (meta, dim) in enumerate(zip(results, concat_dims)):
        nodes.append(Node(f"part{i}", None, outputs=(meta,), aliases=(None,), role=Role.INPUT))
        op, args = (
            (aten.clone.default, (Ref(f"part{i}"),))
            if dim is not None
            else (aten.add.Tensor, (Ref(f"part{i}"), Ref(f"part{i}")))
        )
        nodes.append(Node(f"merge{i}", op, args, outputs=(meta,), aliases=(None,)))
    return Graph(tuple(nodes), tuple(n.name for n in nodes[1::2]))


def region_seconds(model: CostModel, part: Graph, merge: Graph, parts: int) -> float:
    """``parts`` times one part's operators (``part``) plus writing its results into place
    (``merge``, :func:`merge_graph_of`): the parts run one after another."""
    part_s = sum(model.node_seconds(part, n.name) for n in part.nodes)
    merge_s = sum(model.node_seconds(merge, n.name) for n in merge.nodes)
    return parts * (part_s + merge_s)
