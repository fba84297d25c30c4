"""Pointwise convolutions of one sample as matrix products.

A 1x1 convolution with stride 1 and no padding, on one sample (batch 1, the batch Serenity
schedules for, §4), is the matrix product ``W X`` of its weight, ``[C_out, C_in]``, and its
input seen as ``[C_in, H W]``: the same multiply-adds, with views for the reshapes. A
convolution kernel pays a fixed cost per call that a matrix product does not (on this
repository's CPU, oneDNN's 16 -> 16 channel 1x1 convolution at 64x64 took 147 us where the
product took 44 us, in /tmp micro-benchmarks), and Serenity's channel-wise partitioning
(:func:`magis.rules.identity.apply_concat_conv`) turns one convolution over a concatenation
into one per part: as products, the partitioned network costs what its arithmetic costs.

Inference plans only, as :mod:`magis.rules.multiply_add`: the products equalled the
convolutions bit for bit where measured, but no kernel promises the same summation order,
and a training step's gradients keep eager's rounding.
"""

from __future__ import annotations

import torch

from magis.cost.op_keys import is_row_major
from magis.ir.graph import Graph, Ref
from magis.rules.builder import NodeBuilder
from magis.rules.identity import CONV_ARGS
from magis.rules.rewrite import Rewrite

aten = torch.ops.aten


def find_pointwise_convolutions(graph: Graph) -> list[str]:
    """The convolutions of an inference ``graph`` that are matrix products: one sample, a 1x1
    kernel, stride 1, no padding, one group, not transposed, a contiguous input."""
    if not graph.signature.inference:
        return []  # module docstring: a training step keeps its convolutions' rounding
    found = []
    for node in graph.nodes:
        if node.target is not aten.convolution.default:
            continue
        args = dict(zip(CONV_ARGS, node.args))
        x, w = graph[args["input"].name].outputs[0], graph[args["weight"].name].outputs[0]
        if (
            len(x.shape) == 4
            and x.shape[0] == 1
            and tuple(w.shape[2:]) == (1, 1)
            and args["groups"] == 1
            and not args["transposed"]
            and all(s == 1 for s in args["stride"])
            and all(p == 0 for p in args["padding"])
            and x.strides is not None
            and is_row_major(x.shape, x.strides)
            and x.dtype == w.dtype
        ):
            found.append(node.name)
    return found


def as_matmuls(graph: Graph, names: list[str]) -> Graph:
    """``graph`` with each convolution of ``names`` (:func:`find_pointwise_convolutions`) as
    ``mm`` (``addmm`` with a bias) of views, its result viewed back as ``[1, C_out, H, W]``
    under a new name that its readers read instead."""
    for name in names:
        node = graph[name]
        args = dict(zip(CONV_ARGS, node.args))
        _, c_in, height, width = graph[args["input"].name].outputs[0].shape
        c_out = graph[args["weight"].name].outputs[0].shape[0]
        build = NodeBuilder(graph, name)
        x = build.add("rows", aten.view.default, (args["input"], [c_in, height * width]))
        w = build.add("matrix", aten.view.default, (args["weight"], [c_out, c_in]))
        if isinstance(args["bias"], Ref):
            bias = build.add("column", aten.view.default, (args["bias"], [c_out, 1]))
            product = build.add("product", aten.addmm.default, (bias, w, x))
        else:
            product = build.add("product", aten.mm.default, (w, x))
        result = build.add("map", aten.view.default, (product, [1, c_out, height, width]))
        graph = graph.replace(remove=[name], add=build.nodes, rename={name: result.name})
    return graph


def pointwise_matmul_rewrites(graph: Graph) -> list[Rewrite]:
    """The M-Rule: every pointwise convolution of one sample as a matrix product, at once."""
    found = find_pointwise_convolutions(graph)
    if not found:
        return []
    return [Rewrite(as_matmuls(graph, found), f"pointwise-matmul: {len(found)} 1x1 convolutions as matrix products")]
