"""A Weisfeiler-Lehman hash of a graph, to skip graphs the search saw (MAGIS Alg. 3, lines 5-8).

Two M-States whose graphs are the same up to node names (two rule sequences that
reach one graph, a rewrite and its inverse) need not be searched twice. MAGIS
hashes each graph with the Weisfeiler-Lehman test: every node starts with a label
of its own (operator, constants, output shapes and dtypes, role), and labels are
refined by concatenating each node's label with its neighbours'.

A training step is a long DAG of repeated blocks, where a few rounds of refinement
cannot tell "block 3 fissioned" from "block 5 fissioned": both neighbourhoods look
alike. So the refinement here runs to convergence, which on a DAG takes one pass
each way: along the edges in topological order (a node's label takes its inputs'
labels in argument order, since the operands of a matmul are not interchangeable:
it then stands for the node's whole ancestry), and against them in reverse order
(the sorted labels of its readers, each with the argument position it is read at:
its whole future). The graph's hash is that of the sorted multiset of the final
labels, with the labels of the graph outputs and of the ordering edges (the chain
of random ops) beside it.

Node names and the order of the node list never enter a label, so relabelled
(isomorphic) graphs hash the same; graphs that differ in an operator, a constant,
a shape or an edge hash differently.
"""

from __future__ import annotations

import hashlib

from magis.ir.graph import Graph, map_refs


def _digest(value: object) -> str:
    return hashlib.blake2b(repr(value).encode(), digest_size=12).hexdigest()


def wl_hash(graph: Graph) -> str:
    """The Weisfeiler-Lehman hash of ``graph`` (hex), independent of node names and node order."""
    ancestry: dict[str, str] = {}
    for n in graph.nodes:  # topological: inputs first
        args = map_refs((n.args, n.kwargs), lambda r: ancestry[r.name])
        ancestry[n.name] = _digest((n.op_name, args, n.outputs, n.role.value, n.random))
    readers: dict[str, list[tuple[str, int]]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for position, ref in enumerate(n.refs):
            readers[ref.name].append((n.name, position))
    future: dict[str, str] = {}
    for n in reversed(graph.nodes):
        future[n.name] = _digest((ancestry[n.name], sorted((future[r], p) for r, p in readers[n.name])))
    outputs = [future[o] for o in graph.outputs]
    edges = sorted((future[a], future[b]) for a, b in graph.order_edges)
    return hashlib.blake2b(repr((sorted(future.values()), outputs, edges)).encode(), digest_size=16).hexdigest()
