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

A matrix product seen through a reshaping view is a product too: Serenity's channel-wise
partitioning (§3.3) sums one partial 1x1 convolution per part, each a matrix product once
:mod:`magis.rules.pointwise_matmul` has run, and ``a + view(mm(W, X))`` runs as
``view(addmm(view(a), W, X))``: BLAS accumulates into ``a`` (``beta = 1``), in place once
:mod:`magis.rules.in_place` has run, and neither the partial product nor the sum's kernel
is left (bit for bit equal to the pair's in the /tmp comparisons at SwiftNet's shapes; a
unit in the last place apart at others).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from magis.cost.op_keys import is_row_major
from magis.ir.graph import Graph, Node, Ref
from magis.rules.builder import NodeBuilder
from magis.rules.rewrite import Rewrite

aten = torch.ops.aten


def find_multiply_adds(graph: Graph) -> dict[str, int]:
    """Each sum ``add(a, b)`` of ``graph`` one of whose terms is a product that nothing else
    reads, of operands laid out as the sum (or single numbers), all of the sum's dtype, or a
    matrix product that nothing else reads seen as the sum's shape (:func:`_matrix_product`):
    the sum's name and the position of that term."""
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
            if other.name != product.name and _matrix_product(graph, product, other, node) is not None:
                found[node.name] = position
                break
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


def _matrix_product(graph: Graph, term: Node, other: Node, total: Node) -> Node | None:
    """The ``mm`` that ``term`` is, or reshapes, when ``total = other + term`` may run as an
    ``addmm`` into ``other`` (seen as a matrix; module docstring), or None: the product (and
    its view) read by the next alone, neither an output, and ``other`` laid out as the sum,
    row-major, of the product's dtype."""
    chain = [term]
    if term.target is aten.view.default and isinstance(term.args[0], Ref):
        chain.insert(0, graph[term.args[0].name])
    product, meta = chain[0], other.meta
    if (
        product.target is not aten.mm.default
        or not all(isinstance(a, Ref) for a in product.args)
        or any(n.name in graph.outputs for n in chain)
        or any(graph.consumers[n.name] != (reader.name,) for n, reader in zip(chain, [*chain[1:], total]))
        or meta is None
        or meta != total.meta
        or meta.strides is None
        or not is_row_major(meta.shape, meta.strides)
        or meta.dtype != product.meta.dtype
    ):
        return None
    return product


def _fits(operand, result) -> bool:
    """An operand of the fused kernel that neither changes its result's layout nor its dtype."""
    return operand.dtype == result.dtype and (operand == result or operand.shape == ())


def fuse_multiply_adds(graph: Graph, found: dict[str, int]) -> Graph:
    """``graph`` with each sum of ``found`` (:func:`find_multiply_adds`) as ``addcmul`` (``addmm``)
    of the other term and the product's operands, under the sum's name; a sum of a reshaped
    matrix product as ``addmm`` into the other term seen as a matrix, viewed back under a new
    name that its readers read instead. The products go."""
    fused, products, matrix_sums = {}, set(), []
    for name, position in found.items():
        node = graph[name]
        product = graph[node.args[position].name]
        if product.target is aten.view.default:
            matrix_sums.append((name, position))
            continue
        products.add(product.name)
        target = aten.addmm.default if product.target is aten.mm.default else aten.addcmul.default
        fused[name] = replace(node, target=target, args=(node.args[1 - position], *product.args))
    nodes = tuple(fused.get(n.name, n) for n in graph.nodes if n.name not in products)
    graph = Graph(nodes, graph.outputs, graph.signature, graph.order_edges)
    for name, position in matrix_sums:
        graph = _accumulated_product(graph, name, position)
    return graph


def _accumulated_product(graph: Graph, name: str, position: int) -> Graph:
    """``graph`` with the sum ``name``, whose term ``position`` is a view of an ``mm``, as
    ``view(addmm(view(other), *mm.args))`` (module docstring)."""
    node = graph[name]
    term = graph[node.args[position].name]
    product = graph[term.args[0].name]
    build = NodeBuilder(graph, name)
    rows = build.add("rows", aten.view.default, (node.args[1 - position], list(product.meta.shape)))
    accumulated = build.add("accumulated", aten.addmm.default, (rows, *product.args))
    total = build.add("map", aten.view.default, (accumulated, list(node.meta.shape)))
    return graph.replace(remove=[name, term.name, product.name], add=build.nodes, rename={name: total.name})


def multiply_add_rewrites(graph: Graph) -> list[Rewrite]:
    """The M-Rule: every sum of a product fused at once (module docstring)."""
    found = find_multiply_adds(graph)
    if not found:
        return []
    return [Rewrite(fuse_multiply_adds(graph, found), f"multiply-add: {len(found)} sums of products fused")]
