"""Identity graph rewrites around concatenation (Serenity, MLSys'20, §3.3), and a convolution's bias.

A concatenation keeps every branch it joins alive until the concatenated tensor
exists, and that tensor alive until its consumer ran. When the consumer is a
convolution, the concatenation can go:

- channel-wise partitioning, ``conv(cat(x_1..x_k), W) = Σ_i conv(x_i, W[:, C_i])``
  (Serenity Eq. 3-6): each partial convolution runs as soon as its branch exists
  and the branch can be freed right after; the partial results are summed by a
  chain of adds (the bias goes to the first part).
- kernel-wise partitioning for a depthwise convolution (``groups`` = input
  channels), ``dwconv(cat(x_1..x_k), W) = cat(dwconv(x_i, W[C_i]))`` (Eq. 7-8):
  each branch gets its own depthwise convolution, the outputs are concatenated.

A third rewrite prepares a fission rather than removing a tensor: a convolution's bias
taken out of it, ``conv(x, W, b) = conv(x, W) + b``, the sum added in place. A dense
convolution without a bias sums over its input channels, so the F-Tree can split the
producers of ``x`` along those channels and add up the parts (MAGIS §4.1's reduce axis);
with the bias inside, each part would add it again, and that dimension stopped there (the
stem of a user's network at batch 1, whose convolutions keep PyTorch's default bias).

Each rule is a pair ``find_*(graph) -> list[Match]`` and ``apply_*(graph, match) ->
Graph``; the rewritten graph computes the same values (up to floating-point
summation order) and its new nodes carry output metadata computed on meta tensors.

Validity in a training graph: the rewrite removes the concatenated tensor, so it
applies only where the convolution is its *only* reader (and it is not a graph
output). In a training step the convolution's backward also reads the
concatenation (the saved input of the weight gradient), so there the rules find
nothing, and gradients are never touched: they fire on forward regions whose
convolution needs no backward (frozen weights and inputs that need no gradient)
and on inference-style graphs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from magis.ir.graph import Graph, Node, Ref
from magis.rules.builder import NodeBuilder
from magis.rules.in_place import EVAL_BATCH_NORM, IN_PLACE
from magis.rules.rewrite import Rewrite, hot_spots

aten = torch.ops.aten

CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")


@dataclass(frozen=True)
class ConcatConv:
    """A concatenation along channels read only by a convolution."""

    concat: str
    conv: str
    parts: tuple[str, ...]  # the concatenated nodes, in order
    channels: tuple[int, ...]  # channels of each part


def find_concat_conv(graph: Graph) -> list[ConcatConv]:
    """Every ``cat`` along channels whose only reader is a dense (``groups=1``) convolution."""
    return [m for m in _concat_convs(graph) if _conv_args(graph[m.conv])["groups"] == 1]


def find_concat_depthwise(graph: Graph) -> list[ConcatConv]:
    """Every ``cat`` along channels whose only reader is a depthwise convolution (``groups`` = channels)."""
    return [m for m in _concat_convs(graph) if _conv_args(graph[m.conv])["groups"] == sum(m.channels) > 1]


def apply_concat_conv(graph: Graph, match: ConcatConv) -> Graph:
    """Channel-wise partitioning: one partial convolution per part, summed; the sum takes the conv's name."""
    args = _conv_args(graph[match.conv])
    new = NodeBuilder(graph, match.conv)
    total: Ref | None = None
    start = 0
    for i, (part, channels) in enumerate(zip(match.parts, match.channels)):
        weight = new.add("weight", aten.slice.Tensor, (args["weight"], 1, start, start + channels))
        bias = args["bias"] if i == 0 else None
        partial = new.add("part", aten.convolution.default, _positional(args, Ref(part), weight, bias))
        total = partial if total is None else new.add("sum", aten.add.Tensor, (total, partial))
        start += channels
    assert total is not None
    return graph.replace(remove=[match.concat, match.conv], add=new.nodes, rename={match.conv: total.name})


def apply_concat_depthwise(graph: Graph, match: ConcatConv) -> Graph:
    """Kernel-wise partitioning: one depthwise convolution per part, concatenated; the cat takes the conv's place."""
    return _depthwise_per_part(graph, match)[0]


def _depthwise_per_part(graph: Graph, match: ConcatConv) -> tuple[Graph, str]:
    """:func:`apply_concat_depthwise`, and the name of the new concatenation."""
    args = _conv_args(graph[match.conv])
    new = NodeBuilder(graph, match.conv)
    multiplier = graph[args["weight"].name].meta.shape[0] // args["groups"]
    outputs: list[Ref] = []
    start = 0
    for part, channels in zip(match.parts, match.channels):
        stop = start + channels * multiplier
        weight = new.add("weight", aten.slice.Tensor, (args["weight"], 0, start, stop))
        bias = new.add("bias", aten.slice.Tensor, (args["bias"], 0, start, stop)) if args["bias"] else None
        outputs.append(new.add("part", aten.convolution.default, _positional(args, Ref(part), weight, bias, channels)))
        start = stop
    joined = new.add("cat", aten.cat.default, (outputs, 1))
    graph = graph.replace(remove=[match.concat, match.conv], add=new.nodes, rename={match.conv: joined.name})
    return graph, joined.name


def concat_conv_rewrites(graph: Graph) -> list[Rewrite]:
    """Every channel-wise partitioning the graph offers (an M-Rule)."""
    return [
        Rewrite(apply_concat_conv(graph, m), f"partition {m.conv} over the {len(m.parts)} parts of {m.concat}")
        for m in find_concat_conv(graph)
    ]


def concat_depthwise_rewrites(graph: Graph) -> list[Rewrite]:
    """Every kernel-wise partitioning the graph offers (an M-Rule)."""
    return [
        Rewrite(apply_concat_depthwise(graph, m), f"partition {m.conv} kernel-wise over the parts of {m.concat}")
        for m in find_concat_depthwise(graph)
    ]


#: operators applied to each element alone, a tensor first and constants after (the activations
#: that have an in-place twin): ``f(cat(x_1..x_k)) = cat(f(x_1)..f(x_k))``, bit for bit
ELEMENTWISE = frozenset(IN_PLACE)


def find_concat_sinks(graph: Graph) -> list[str]:
    """Every channel concatenation :func:`sink_concat` moves past an operator that is not a dense
    convolution (a concatenation a dense convolution reads is :func:`find_concat_conv`'s alone)."""
    outputs = set(graph.outputs)
    found = []
    for node in graph.nodes:
        if node.target is not aten.cat.default or node.name in outputs:
            continue
        target = _sunk_through(graph, node.name)
        dense = target is aten.convolution.default and _conv_args(graph[graph.consumers[node.name][0]])["groups"] == 1
        if target is not None and not dense:
            found.append(node.name)
    return found


def sink_concat(graph: Graph, concat: str) -> Graph:
    """Move a channel concatenation as far down as its values stay per channel (Serenity §3.3's
    partitionings, extended through what lies between a concatenation and its convolution):
    past elementwise activations, eval-mode batch norms (each part normalised with its
    channels' statistics) and means over the image (a classifier's pooling), kernel-wise
    through depthwise convolutions, and finally channel-wise into a dense convolution,
    which sums partial convolutions instead. A
    NAS cell's "concatenate, depthwise, batch norm, ReLU, 1x1 convolution" then never
    holds the concatenated channels at all. Exact but for the last partitioning's sums."""
    while (target := _sunk_through(graph, concat)) is not None:
        reader = graph[graph.consumers[concat][0]]
        if target is aten.convolution.default:
            match = ConcatConv(concat, reader.name, *_parts(graph, concat))
            if _conv_args(reader)["groups"] == 1:
                return apply_concat_conv(graph, match)
            graph, concat = _depthwise_per_part(graph, match)
        elif target is EVAL_BATCH_NORM:
            graph, concat = _batch_norm_per_part(graph, concat, reader)
        else:
            graph, concat = _elementwise_per_part(graph, concat, reader)
    return graph


def concat_sink_rewrites(graph: Graph) -> list[Rewrite]:
    """Every concatenation :func:`sink_concat` moves (an M-Rule)."""
    return [
        Rewrite(sink_concat(graph, concat), f"move {concat} past the per-channel operators reading it")
        for concat in find_concat_sinks(graph)
    ]


def find_biased_convs(graph: Graph, order: Sequence[str] | None = None) -> list[str]:
    """Dense convolutions with a bias whose input is live at a peak of ``order``, computed by
    another operator and not saved for a weight gradient (which keeps it whole, split or not):
    the inputs a fission along their channels could split."""
    found: list[tuple[str, str]] = []  # (convolution, its input)
    for node in graph.nodes:
        if node.target is not aten.convolution.default:
            continue
        args = _conv_args(node)
        x = args["input"]
        if args["bias"] is None or args["transposed"] or args["groups"] != 1 or graph[x.name].is_input:
            continue
        if not any(graph[r].target is aten.convolution_backward.default for r in graph.consumers[x.name]):
            found.append((node.name, x.name))
    if not found:
        return []
    hot = hot_spots(graph, order)
    return [conv for conv, x in found if hot.intersection(graph.storages[x])]


def apply_bias_out(graph: Graph, conv: str) -> Graph:
    """``conv(x, W, b)`` as ``conv(x, W).add_(b)`` (the bias viewed along the channels); the
    in-place sum takes the convolution's name, its result the convolution's storage."""
    args = _conv_args(graph[conv])
    new = NodeBuilder(graph, conv)
    bare = new.add("nobias", aten.convolution.default, _positional(args, args["input"], args["weight"], None))
    spatial = len(graph[conv].meta.shape) - 2
    bias = new.add("bias", aten.view.default, (args["bias"], [-1] + [1] * spatial))
    summed = new.add("plus_bias", aten.add_.Tensor, (bare, bias))
    return graph.replace(remove=[conv], add=new.nodes, rename={conv: summed.name})


def bias_out_rewrites(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """Every convolution's bias taken out where its input is at a peak (an M-Rule)."""
    return [
        Rewrite(apply_bias_out(graph, conv), f"add {conv}'s bias after it: its input channels become a sum")
        for conv in find_biased_convs(graph, order)
    ]


def _concat_convs(graph: Graph) -> list[ConcatConv]:
    """Channel concatenations read only by a (non-transposed) convolution, as its input."""
    matches = []
    outputs = set(graph.outputs)
    for node in graph.nodes:
        if node.target is not aten.cat.default or node.name in outputs:
            continue
        readers = graph.consumers[node.name]
        if len(readers) != 1 or graph[readers[0]].target is not aten.convolution.default:
            continue
        conv = graph[readers[0]]
        args = _conv_args(conv)
        if args["transposed"] or args["input"] != Ref(node.name) or Ref(node.name) in (args["weight"], args["bias"]):
            continue
        parts, dim = _cat_args(node)
        if len(parts) < 2 or dim % len(node.meta.shape) != 1 or len(set(parts)) != len(parts):
            continue
        channels = tuple(graph[p].meta.shape[1] for p in parts)
        matches.append(ConcatConv(node.name, conv.name, parts, channels))
    return matches


def _cat_args(node: Node) -> tuple[tuple[str, ...], int]:
    values = dict(zip(("tensors", "dim"), node.args)) | node.kwargs_dict()
    tensors = values["tensors"]
    if not all(isinstance(t, Ref) for t in tensors):
        return (), 0
    return tuple(t.name for t in tensors), int(values.get("dim", 0))


def _conv_args(node: Node) -> dict[str, Any]:
    return dict(zip(CONV_ARGS, node.args)) | node.kwargs_dict()


def _positional(args: dict[str, Any], x: Ref, weight: Ref, bias: Ref | None, groups: int | None = None) -> tuple:
    """Arguments of a convolution like ``args`` on other operands."""
    changed = {"input": x, "weight": weight, "bias": bias, "groups": args["groups"] if groups is None else groups}
    return tuple(changed.get(name, args[name]) for name in CONV_ARGS)


def _sunk_through(graph: Graph, concat: str) -> Any:
    """The operator a channel concatenation ``concat`` can move past (module docstring): its one
    reader's target, or ``None``."""
    node = graph[concat]
    parts, dim = _cat_args(node)
    readers = graph.consumers[concat]
    if len(parts) < 2 or dim % len(node.meta.shape) != 1 or len(set(parts)) != len(parts) or len(readers) != 1:
        return None
    around = node.meta.shape[:1] + node.meta.shape[2:]
    if any(graph[p].meta.shape[:1] + graph[p].meta.shape[2:] != around for p in parts):
        return None  # an empty 1-D part (``cat`` skips those)
    reader = graph[readers[0]]
    if not reader.args or reader.args[0] != Ref(concat) or sum(r == Ref(concat) for r in reader.refs) != 1:
        return None
    if reader.target in ELEMENTWISE:
        return reader.target if all(not isinstance(a, Ref) for a in reader.args[1:]) and not reader.kwargs else None
    if reader.target is aten.mean.dim and len(reader.args) > 1 and isinstance(reader.args[1], (list, tuple)):
        rank = len(node.meta.shape)
        reduced = {d % rank for d in reader.args[1]}
        return reader.target if reduced.isdisjoint({0, 1}) and not reader.kwargs else None
    if reader.target is EVAL_BATCH_NORM:
        items = graph.consumers[reader.name]
        only_output = all(graph[i].target is operator.getitem and graph[i].args[1] == 0 for i in items)
        statistics = all(isinstance(a, Ref) and a.name in graph.persistent for a in reader.args[3:5])
        return reader.target if items and only_output and statistics else None
    if reader.target is aten.convolution.default and not _conv_args(reader)["transposed"]:
        groups = _conv_args(reader)["groups"]
        return reader.target if groups in (1, node.meta.shape[1]) else None
    return None


def _parts(graph: Graph, concat: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    parts, _ = _cat_args(graph[concat])
    return parts, tuple(graph[p].meta.shape[1] for p in parts)


def _elementwise_per_part(graph: Graph, concat: str, reader: Node) -> tuple[Graph, str]:
    """``f(cat(x_i))`` as ``cat(f(x_i))`` (an elementwise ``f``, or a mean over other dimensions than
    the batch and the channels); the new concatenation takes the reader's place."""
    new = NodeBuilder(graph, reader.name)
    parts = [new.add("part", reader.target, (Ref(p), *reader.args[1:])) for p in _parts(graph, concat)[0]]
    joined = new.add("cat", aten.cat.default, (parts, 1))
    graph = graph.replace(remove=[concat, reader.name], add=new.nodes, rename={reader.name: joined.name})
    return graph, joined.name


def _batch_norm_per_part(graph: Graph, concat: str, reader: Node) -> tuple[Graph, str]:
    """An eval-mode batch norm of ``cat(x_i)`` as ``cat`` of each part's batch norm with its
    channels' weight, bias and running statistics (views of them); the new concatenation takes
    the place of the batch norm's output."""
    new = NodeBuilder(graph, reader.name)
    outputs: list[Ref] = []
    start = 0
    for part, channels in zip(*_parts(graph, concat)):
        sliced = [
            new.add("slice", aten.slice.Tensor, (a, 0, start, start + channels)) if isinstance(a, Ref) else a
            for a in reader.args[1:5]
        ]
        normed = new.add("part", EVAL_BATCH_NORM, (Ref(part), *sliced, *reader.args[5:]), like=reader)
        outputs.append(new.element(normed, 0))
        start += channels
    joined = new.add("cat", aten.cat.default, (outputs, 1))
    items = graph.consumers[reader.name]
    rename = dict.fromkeys(items, joined.name)
    graph = graph.replace(remove=[concat, reader.name, *items], add=new.nodes, rename=rename)
    return graph, joined.name
