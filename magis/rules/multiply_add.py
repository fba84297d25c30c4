"""Fused multiply-add: a sum of products accumulates into one tensor.

A weighted sum ``Σ w_i·x_i`` (RandWire's aggregation, Xie et al. §3.2) runs as written one
product at a time, each product a tensor as large as its operand and held until the sum
reads it; a schedule that computes products early, to free their operands, holds several
at once. ``add(a, mul(b, c))`` run as ``addcmul(a, b, c)`` never makes the product, and with
the sum then written into ``a`` (:mod:`magis.rules.in_place`) a whole aggregation holds one
accumulator. The kernel rounds ``a + b·c`` once where the pair rounds twice (a fused
multiply-add): results within a unit in the last place of the pair's, not bit for bit, so
only in an inference plan: a training step's forward feeds its gradients, which Adam's
first updates, ``g / (|g| + eps)``, magnify where they are near zero.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from magis.ir.graph import Graph, Ref
from magis.rules.rewrite import Rewrite

aten = torch.ops.aten


def find_multiply_adds(graph: Graph) -> dict[str, int]:
    """Each sum ``add(a, b)`` of ``graph`` one of whose terms is a product that nothing else
    reads, of operands laid out as the sum (or single numbers), all of the sum's dtype: the
    sum's name and the position of that term."""
    if not graph.signature.inference:
        return {}  # module docstring: a training step keeps its forward's rounding
    found = {}
    outputs = set(graph.outputs)
    for node in graph.nodes:
        if node.target is not aten.add.Tensor or node.kwargs_dict().get("alpha", 1) != 1 or len(node.args) != 2:
            continue
        if not all(isinstance(a, Ref) for a in node.args):
            continue
        for position in (1, 0):
            other, product = (graph[a.name] for a in (node.args[1 - position], node.args[position]))
            if (
                product.target is aten.mul.Tensor
                and product.name not in outputs
                and graph.consumers[product.name] == (node.name,)
                and other.name != product.name
                and len(product.args) == 2
                and all(isinstance(a, Ref) for a in product.args)
                and other.meta == node.meta
                and all(_fits(graph[a.name].meta, node.meta) for a in product.args)
            ):
                found[node.name] = position
                break
    return found


def _fits(operand, result) -> bool:
    """An operand of the fused kernel that neither changes its result's layout nor its dtype."""
    return operand.dtype == result.dtype and (operand == result or operand.shape == ())


def fuse_multiply_adds(graph: Graph, found: dict[str, int]) -> Graph:
    """``graph`` with each sum of ``found`` (:func:`find_multiply_adds`) as ``addcmul`` of the
    other term and the product's operands, under the sum's name; the products go."""
    fused, products = {}, set()
    for name, position in found.items():
        node = graph[name]
        product = graph[node.args[position].name]
        products.add(product.name)
        fused[name] = replace(node, target=aten.addcmul.default, args=(node.args[1 - position], *product.args))
    nodes = tuple(fused.get(n.name, n) for n in graph.nodes if n.name not in products)
    return Graph(nodes, graph.outputs, graph.signature, graph.order_edges)


def multiply_add_rewrites(graph: Graph) -> list[Rewrite]:
    """The M-Rule: every sum of a product fused at once (module docstring)."""
    found = find_multiply_adds(graph)
    if not found:
        return []
    return [Rewrite(fuse_multiply_adds(graph, found), f"multiply-add: {len(found)} sums of products fused")]
