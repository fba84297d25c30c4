"""Every rewrite that lowers memory without costing time, applied wherever it can be, at once.

Serenity (MLSys'20, §3.3) rewrites a network wherever its identities apply and then schedules
it; the M-Optimizer (MAGIS §6) would have to find each such rewrite as one step of its
search, and a network of a thousand operators (RandWire's) holds more of them than a search
of seconds takes. This rule is the whole chain as one step, from which the search goes on
(fission, tiling, recomputation):

1. concatenations moved past the per-channel operators reading them, and into partial
   convolutions (:func:`magis.rules.identity.sink_concat`, Serenity's partitionings), until
   none is left;
2. pointwise convolutions of one sample run as matrix products
   (:mod:`magis.rules.pointwise_matmul`; the partial convolutions of step 1 among them);
3. every operator that repeats an earlier one computed once (:func:`magis.rules.remat.duplicates`);
4. sums of products fused (:mod:`magis.rules.multiply_add`);
5. concatenations whose parts can be freed early assembled in place
   (:mod:`magis.rules.concat_in_place`);
6. every operator that can, run in place (:mod:`magis.rules.in_place`).

Each keeps the values (bit for bit, but for the partitionings', products' and multiply-adds'
rounding) and moves no more bytes than before; the partial convolutions replace one
convolution and a concatenation by as many smaller convolutions as there were parts (as
products, each costs its arithmetic), and a concatenation assembled in place copies part by
part.
"""

from __future__ import annotations

from magis.ir.graph import Graph
from magis.rules.concat_in_place import concat_in_place, find_concats_in_place
from magis.rules.identity import (
    apply_concat_conv,
    apply_concat_depthwise,
    find_concat_conv,
    find_concat_depthwise,
    find_concat_sinks,
    sink_concat,
)
from magis.rules.in_place import in_place, in_place_candidates
from magis.rules.multiply_add import find_multiply_adds, fuse_multiply_adds
from magis.rules.pointwise_matmul import as_matmuls, find_pointwise_convolutions
from magis.rules.remat import duplicates, merged_duplicates
from magis.rules.rewrite import Rewrite


def partitioned(graph: Graph) -> Graph:
    """``graph`` with every concatenation moved down or partitioned away where it can be."""
    while True:
        if sinks := find_concat_sinks(graph):
            graph = sink_concat(graph, sinks[0])
        elif channel_wise := find_concat_conv(graph):
            graph = apply_concat_conv(graph, channel_wise[0])
        elif kernel_wise := find_concat_depthwise(graph):
            graph = apply_concat_depthwise(graph, kernel_wise[0])
        else:
            return graph


def canonical(graph: Graph) -> Graph:
    """``graph`` after steps 1-6 of the module docstring."""
    graph = partitioned(graph)
    graph = as_matmuls(graph, find_pointwise_convolutions(graph))
    order = tuple(n.name for n in graph.nodes)
    if pairs := duplicates(graph, order):
        graph = merged_duplicates(graph, order, pairs).graph
    graph = fuse_multiply_adds(graph, find_multiply_adds(graph))
    for concat in find_concats_in_place(graph):
        graph = concat_in_place(graph, concat)
    return in_place(graph, in_place_candidates(graph))


def canonical_rewrites(graph: Graph) -> list[Rewrite]:
    """The M-Rule: :func:`canonical`, where it changes the graph."""
    rewritten = canonical(graph)
    if rewritten.structural_hash() == graph.structural_hash():
        return []
    return [Rewrite(rewritten, "every rewrite that costs no time")]
