"""A Weisfeiler-Lehman hash of a graph, to skip graphs the search saw (MAGIS Alg. 3, lines 5-8).

Two M-States whose graphs are the same up to node names (two rule sequences that
reach one graph, a rewrite and its inverse) need not be searched twice. MAGIS
hashes each graph with the Weisfeiler-Lehman test: every node starts with a label
of its own (operator, constants, output shapes and dtypes, role), then, for a few
rounds, takes a new label from its old one concatenated with the labels of its
inputs, in argument order (the operands of a matmul are not interchangeable), and
the sorted labels of its readers. The graph's hash is that of the sorted multiset of
final labels, with the labels of the graph outputs and of the ordering edges (the
chain of random ops) beside it.

Node names and the order of the node list never enter a label, so relabelled
(isomorphic) graphs hash the same; graphs that differ in an operator, a constant,
a shape or an edge within :data:`ROUNDS` hops of some node hash differently.
"""

from __future__ import annotations

import hashlib

from magis.ir.graph import Graph, Ref, map_refs

#: refinement rounds: a difference is seen from every node within this many hops of it.
ROUNDS = 4


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _hole(_ref: Ref) -> str:
    """What a reference is in a node's own label: a place for an input, named by nothing."""
    return "#"


def wl_hash(graph: Graph, rounds: int = ROUNDS) -> str:
    """The Weisfeiler-Lehman hash of ``graph`` (hex), independent of node names and node order."""
    label = {
        n.name: _digest(repr((n.op_name, map_refs((n.args, n.kwargs), _hole), n.outputs, n.role.value, n.random)))
        for n in graph.nodes
    }
    for _ in range(rounds):
        label = {
            n.name: _digest(
                repr(
                    (
                        label[n.name],
                        map_refs((n.args, n.kwargs), lambda r, old=label: old[r.name]),
                        sorted(label[s] for s in graph.successors[n.name]),
                    )
                )
            )
            for n in graph.nodes
        }
    outputs = [label[o] for o in graph.outputs]
    edges = sorted((label[a], label[b]) for a, b in graph.order_edges)
    return hashlib.blake2b(repr((sorted(label.values()), outputs, edges)).encode(), digest_size=16).hexdigest()
