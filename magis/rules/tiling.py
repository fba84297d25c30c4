"""Spatial tiling of an inference's convolution chains: bands of rows, one after another.

At batch 1 a forward has no batch to split, and a convolution's rows are not a fission axis
(its window reads rows on both sides of a cut: MAGIS §4.1 leaves sliding windows unlinked).
Patch-based inference (Lin et al., "MCUNetV2", NeurIPS 2021, §3.1) splits them anyway, by
recomputing the rows the windows overlap: the output of a chain of convolutions is computed
in horizontal bands, each from the rows of the chain's input that its receptive field
covers, so only one band's intermediate tensors are live at a time.

A *chain* is a path of operators each of which is the only reader of the one before:
convolutions (not transposed), batch norms in eval mode, and elementwise operators of one
tensor (ReLU, SiLU, ReLU6...), on ``N, C, H, W`` tensors, with at least one convolution.
:func:`tiled` rewrites one chain into ``n`` bands of the last operator's output rows.
For each band, the row range every operator must produce is walked back from the band
(:func:`rows_needed`); a band of the chain's input is copied out (a view across channels
would make the convolution copy it unseen), each convolution's zero padding along the rows
is added explicitly where its band reaches the image's top or bottom edge (the padding
along the columns stays the convolution's own), and the bands are concatenated along the
rows. Every output value is computed from the same input values as before; in float32 a
convolution on fewer rows may sum in another order (about 1e-7).

The rule offers a chain where it holds a hot spot and narrows (two consecutive tensors of
it hold more than twice its result, which the bands and their concatenation hold): a stem
that strides down. Nothing else may read the chain's intermediates, so a training step,
whose backward saves them, has no chains worth tiling.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from magis.ir.graph import Graph, Node, Ref
from magis.rules.builder import NodeBuilder
from magis.rules.identity import CONV_ARGS
from magis.rules.rewrite import Rewrite, hot_spots

aten = torch.ops.aten

#: how many bands a chain is offered in (each a candidate of the rule)
BANDS = (2, 4, 8)
EVAL_BATCH_NORM = aten._native_batch_norm_legit_no_training.default


@dataclass(frozen=True)
class Chain:
    """Operators ``ops``, each the only reader of the one before, reading ``source``; ``items``
    are the ``getitem`` nodes of its batch norms, ``result`` the node holding its output."""

    source: str
    ops: tuple[str, ...]
    items: tuple[str, ...]
    result: str


def _is_link(graph: Graph, node: Node) -> bool:
    """An operator a chain may hold: a convolution, an eval-mode batch norm, or an elementwise
    operator whose only tensor argument is its first, on a 4-d tensor."""
    if node.is_input or node.random or node.outputs[0] is None or len(node.outputs[0].shape) != 4:
        return False
    if node.target is aten.convolution.default:
        return not dict(zip(CONV_ARGS, node.args))["transposed"]
    if node.target is EVAL_BATCH_NORM:
        return True
    pointwise = isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
    return pointwise and len(node.inputs) == 1 and bool(node.args) and node.args[0] == Ref(node.inputs[0])


def _value_of(graph: Graph, name: str) -> str | None:
    """The node holding ``name``'s tensor result: itself, or a batch norm's ``getitem(., 0)``."""
    node = graph[name]
    if node.target is not EVAL_BATCH_NORM:
        return name
    readers = graph.consumers[name]
    if len(readers) != 1 or graph[readers[0]].target is not operator.getitem or graph[readers[0]].args[1] != 0:
        return None  # its statistics are read too, or the output twice
    return readers[0]


def find_chains(graph: Graph) -> list[Chain]:
    """Every maximal chain with a convolution and at least two operators."""
    outputs = set(graph.outputs)
    chains: list[Chain] = []
    taken: set[str] = set()
    for node in graph.nodes:
        if node.name in taken or not _is_link(graph, node):
            continue
        source = node.inputs[0]
        ops, items, name, result = [], [], node.name, node.name
        while True:
            value = _value_of(graph, name)
            if value is None:
                break
            ops.append(name)
            result = value
            if value != name:
                items.append(value)
            readers = graph.consumers[value]
            nxt = graph[readers[0]] if len(readers) == 1 else None
            if value in outputs or nxt is None or not _is_link(graph, nxt) or nxt.inputs[0] != value:
                break
            name = nxt.name
        taken.update(ops)
        convolutions = sum(graph[op].target is aten.convolution.default for op in ops)
        if len(ops) >= 2 and convolutions:
            chains.append(Chain(source, tuple(ops), tuple(items), result))
    return chains


def rows_needed(graph: Graph, chain: Chain, first: int, stop: int) -> list[tuple[int, int, int, int]]:
    """For output rows ``[first, stop)`` of the chain, per operator (in chain order) the rows
    ``[a, b)`` of its input it reads and the zero rows ``top, bottom`` its padding adds there:
    a convolution with kernel ``k``, stride ``s``, padding ``p`` and dilation ``d`` makes output
    row ``o`` from input rows ``o s - p + i d``, ``i < k``."""
    needed = []
    for op in reversed(chain.ops):
        node = graph[op]
        height = graph[node.inputs[0]].outputs[0].shape[2]
        if node.target is aten.convolution.default:
            args = dict(zip(CONV_ARGS, node.args))
            kernel = graph[args["weight"].name].outputs[0].shape[2]
            stride, padding, dilation = args["stride"][0], args["padding"][0], args["dilation"][0]
            low = first * stride - padding
            high = (stop - 1) * stride - padding + (kernel - 1) * dilation + 1
            first, stop = max(low, 0), min(high, height)
            needed.append((first, stop, first - low, high - stop))
        else:
            needed.append((first, stop, 0, 0))
    return needed[::-1]


def tiled(graph: Graph, chain: Chain, bands: int) -> Graph:
    """``chain`` computed in ``bands`` bands of its output rows, concatenated (module docstring)."""
    last = graph[chain.result].outputs[0]
    height = last.shape[2]
    build = NodeBuilder(graph, chain.ops[-1])
    pieces: list[Ref] = []
    for band in range(bands):
        first, stop = band * height // bands, (band + 1) * height // bands
        plan = rows_needed(graph, chain, first, stop)
        a, b = plan[0][0], plan[0][1]
        rows = build.add("rows", aten.slice.Tensor, (Ref(chain.source), 2, a, b))
        x = build.add("band", aten.clone.default, (rows,), {"memory_format": torch.contiguous_format})
        for op, (_, _, top, bottom) in zip(chain.ops, plan):
            x = _band_op(build, graph[op], x, top, bottom)
        pieces.append(x)
    joined = build.add("tiles", aten.cat.default, (pieces, 2))
    remove = [*chain.ops, *chain.items]
    return graph.replace(remove=remove, add=build.nodes, rename={chain.result: joined.name})


def _band_op(build: NodeBuilder, node: Node, x: Ref, top: int, bottom: int) -> Ref:
    """One operator of the chain on a band ``x``; a convolution pads the band's edge rows itself."""
    if node.target is aten.convolution.default:
        args = dict(zip(CONV_ARGS, node.args))
        if top or bottom:
            x = build.add("pad", aten.constant_pad_nd.default, (x, [0, 0, top, bottom], 0.0))
        padding = [0, *args["padding"][1:]]
        values = {**args, "input": x, "padding": padding}
        return build.add("conv", aten.convolution.default, tuple(values[name] for name in CONV_ARGS))
    if node.target is EVAL_BATCH_NORM:
        normed = build.add("norm", EVAL_BATCH_NORM, (x, *node.args[1:]), node.kwargs_dict(), like=node)
        return build.element(normed, 0)
    return build.add("op", node.target, (x, *node.args[1:]), node.kwargs_dict())


def tile_rewrites(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """Each chain with a tensor live at a peak of ``order``, in each of :data:`BANDS` bands
    its output has rows for (an M-Rule)."""
    chains = find_chains(graph)
    if not chains:  # a training step: the backward reads what a chain would hold
        return []
    hot = hot_spots(graph, order)
    found = []
    for chain in chains:
        inside = [*chain.ops, *chain.items]
        if not _narrows(graph, chain) or not any(hot.intersection(graph.storages[name]) for name in inside):
            continue
        height = graph[chain.result].outputs[0].shape[2]
        for bands in BANDS:
            if bands <= height:
                description = f"tile {len(chain.ops)} operators from {chain.ops[0]} in {bands} bands of rows"
                found.append(Rewrite(tiled(graph, chain, bands), description))
    return found


def _narrows(graph: Graph, chain: Chain) -> bool:
    """Whether two consecutive tensors of the chain hold more than twice its result: the
    bands and their concatenation hold the result twice, so a chain whose result is as large
    as its steps (a convolution and its ReLU in a training step) gains nothing."""
    values = [_value_of(graph, op) or op for op in chain.ops]
    sizes = [graph[v].outputs[0].nbytes for v in values]
    steps = max(a + b for a, b in itertools.pairwise(sizes))
    return steps > 2 * sizes[-1]
