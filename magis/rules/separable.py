"""Algebraic rewrites that make a training step separable along its samples (MAGIS §4, §5).

Fission only shrinks the activations a training step saves for its backward when
one region holds both the forward of a block and its backward (MAGIS Figure 16's
"F-Trans covering the whole graph"). Every such region contains the loss, and a
captured step ties each sample to every other one at three places where no value
needs it:

1. the backward is seeded by ``ones_like(loss)``, which reads the loss only for its
   shape (:func:`seed_backward_with_constant`);
2. a mean cross-entropy, ``nll_loss_forward(..., reduction='mean')``, returns the
   number of counted labels, ``total_weight``, from the whole batch, and its backward
   divides by it (:func:`normalise_loss_by_labels`);
3. dropout draws its mask inside the op that applies it, so a part of a region would
   draw other numbers than the whole (:func:`predraw_dropout_masks`).

Each rewrite computes the same values as the captured step (bit for bit for 1 and
3; for 2 the loss is the same sum divided by the same count) and removes the
dependence: the seed becomes a constant, the count is taken from the labels up
front, the masks are drawn ahead of the region, in the same order, from the same
random stream, by the same kernel on a tensor laid out like the dropout's input.
The samples then meet only in sums (weight gradients, the summed loss), which a
fission region adds up over its parts. :func:`make_separable` applies all three.

The new constants and stand-ins take their device from a parameter of the step
(``new_full`` and ``new_empty_strided`` follow their first argument), since the
graph does not record devices: a training step runs where its parameters live.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from magis.analysis.axes import bind
from magis.ir.graph import Graph, Node, Ref, Role
from magis.rules.builder import NodeBuilder
from magis.rules.rewrite import reordered

aten = torch.ops.aten

#: ``*_like`` factories (they read their input only for its shape, dtype and device) -> fill value
LIKE_FACTORIES = {
    aten.ones_like.default: 1,
    aten.zeros_like.default: 0,
    aten.full_like.default: None,  # its own fill_value argument
}
NLL_LOSSES = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_MEAN, _SUM = 1, 2  # torch's Reduction enum


def make_separable(graph: Graph) -> Graph:
    """All three rewrites of the module docstring; ``graph`` itself when none applies."""
    return predraw_dropout_masks(normalise_loss_by_labels(seed_backward_with_constant(graph)))


def seed_backward_with_constant(graph: Graph) -> Graph:
    """``ones_like(x)`` (and ``zeros_like``, ``full_like``) of a computed, row-major ``x``
    becomes ``new_full(parameter, shape, value)``: the same tensor, read from nothing."""
    anchor = device_anchor(graph)
    edit = _Edit()
    for node in graph.nodes:
        if node.target not in LIKE_FACTORIES or graph[node.inputs[0]].is_input or not _row_major(node):
            continue
        args = bind(node)
        value = LIKE_FACTORIES[node.target]
        fill = args["fill_value"] if value is None else value
        build = NodeBuilder(graph, node.name)
        const = build.add(
            "const", aten.new_full.default, (anchor, list(node.meta.shape), fill), {"dtype": node.meta.dtype}
        )
        edit.replace(node.name, build, {node.name: const.name})
    return edit.apply(graph)


def normalise_loss_by_labels(graph: Graph) -> Graph:
    """A mean ``nll_loss_forward`` (no class weights) becomes its sum divided by the count
    of labels that are not ``ignore_index``, counted from the labels; the backward's
    ``total_weight`` is that count. Both equal the captured values exactly."""
    edit = _Edit()
    for node in graph.nodes:
        if node.target not in NLL_LOSSES:
            continue
        args = bind(node)
        if args["reduction"] != _MEAN or args.get("weight") is not None:
            continue
        loss, total_weight = _elements(graph, node.name)
        if not loss:  # an unread loss: nothing to keep equal
            continue
        scores, labels, ignore = args["self"], args["target"], args["ignore_index"]
        dtype = node.outputs[0].dtype
        build = NodeBuilder(graph, node.name)
        counted = build.add("counted", aten.ne.Scalar, (labels, ignore))
        count = build.add("count", aten.sum.default, (counted,), {"dtype": dtype})
        summed = build.add("sum", node.target, (scores, labels, None, _SUM, ignore))
        mean = build.add("mean", aten.div.Tensor, (build.element(summed, 0), count), role=graph[loss].role)
        edit.replace(node.name, build, {loss: mean.name, total_weight: count.name}, drop=(loss, total_weight))
    return edit.apply(graph)


def predraw_dropout_masks(graph: Graph) -> Graph:
    """``native_dropout(x, p, train=True)`` becomes a draw, ``native_dropout`` of an
    uninitialised stand-in laid out like ``x`` (the mask depends only on the random
    stream, the shape and the layout), then ``x * mask * scale`` (the formula of
    ``native_dropout_backward``). The draw keeps the original's place in the chain of
    random ops, so every mask is the captured one. Dropouts whose input layout is not
    recorded, or whose input may start inside its storage (CUDA's fused kernel picks
    its vector width from the address), stay as they are and out of fission regions;
    so do dropouts narrower than float32: CPU's kernel multiplies by the scale rounded
    to bfloat16/float16, CUDA's by the float scale, and no one formula after the draw
    equals both (on CPU, ``x * mask * scale`` put a bf16 step's loss 1% off eager's)."""
    anchor = device_anchor(graph)
    edit = _Edit()
    for node in graph.nodes:
        if node.target is not aten.native_dropout.default:
            continue
        args = bind(node)
        x, p, train = args["input"], float(args["p"]), args["train"]
        meta = graph[x.name].meta
        if (
            train is not True
            or not 0.0 < p < 1.0
            or meta.strides is None
            or meta.dtype.itemsize < 4
            or not starts_its_storage(graph, x.name)
        ):
            continue
        output, mask = _elements(graph, node.name)
        if not output:  # nothing applies the mask: a draw already
            continue
        build = NodeBuilder(graph, node.name)
        stand_in = build.add(
            "stand_in",
            aten.new_empty_strided.default,
            (anchor, list(meta.shape), list(meta.strides)),
            {"dtype": meta.dtype},
        )
        draw = build.add("draw", aten.native_dropout.default, (stand_in, p, train), random=True)
        drawn = build.element(draw, 1, role=graph[mask].role if mask else None)
        scale = 1.0 / (1.0 - p)
        applied = build.add("apply", aten.native_dropout_backward.default, (x, drawn, scale), role=graph[output].role)
        edit.replace(
            node.name,
            build,
            {output: applied.name, mask: drawn.name},
            drop=(output, mask),
            random=(node.name, draw.name),
        )
    return edit.apply(graph)


def device_anchor(graph: Graph) -> Ref:
    """A parameter of the step (else any input): new constants take its device."""
    inputs = [n for n in graph.nodes if n.is_input]
    if not inputs:
        raise ValueError("the graph has no inputs to take a device from")
    return Ref(next((n for n in inputs if n.role is Role.PARAMETER), inputs[0]).name)


#: views whose tensor starts where their input's does (no storage offset added)
OFFSET_FREE_VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.alias.default,
        aten.detach.default,
        operator.getitem,
    }
)


def starts_its_storage(graph: Graph, name: str) -> bool:
    """Whether the value of node ``name`` begins at the first element of its storage: it
    owns its storage, or reaches its owner only through views that add no offset."""
    node, element = graph[name], 0
    while (alias := node.aliases[element]) is not None:
        if node.target not in OFFSET_FREE_VIEWS:
            return False
        position, element = alias
        node = graph[node.inputs[position]]
    return True


def _row_major(node: Node) -> bool:
    strides = node.meta.strides
    return strides is not None and strides == torch.empty(node.meta.shape, device="meta").stride()


def _elements(graph: Graph, name: str) -> tuple[str, str]:
    """The ``getitem`` readers of elements 0 and 1 of the tuple node ``name`` ('' when unread)."""
    readers = {graph[c].args[1]: c for c in graph.consumers[name] if graph[c].target is operator.getitem}
    return readers.get(0, ""), readers.get(1, "")


@dataclass
class _Edit:
    """Replacements gathered over one pass, applied as one :meth:`Graph.replace`, each
    replaced node's new nodes listed where it was.

    :meth:`Graph.replace` lists a new node after its inputs, and a chain of new nodes can
    drift past the kept nodes after the one it replaces: a draw reading its stand-in came
    after a ``torch.rand`` that eager runs after the dropout, against the order edge of
    the random chain, and the rules that read the node list as a schedule (``canonical``'s
    merge of duplicates) then rebuilt the graph in an order that is not one.
    """

    remove: list[str] = field(default_factory=list)
    add: list[Node] = field(default_factory=list)
    rename: dict[str, str] = field(default_factory=dict)
    in_place_of: dict[str, list[str]] = field(default_factory=dict)  # replaced node -> its new nodes
    random: dict[str, str] = field(default_factory=dict)  # replaced random op -> its new draw

    def replace(
        self,
        name: str,
        build: NodeBuilder,
        rename: dict[str, str],
        drop: tuple[str, ...] = (),
        random: tuple[str, str] | None = None,
    ) -> None:
        """Node ``name`` (and its ``getitem`` readers ``drop``) give way to ``build``'s nodes."""
        self.remove.extend([name, *filter(None, drop)])
        self.add.extend(build.nodes)
        self.rename.update({old: new for old, new in rename.items() if old})
        self.in_place_of[name] = [n.name for n in build.nodes]
        if random is not None:
            self.random[random[0]] = random[1]

    def apply(self, graph: Graph) -> Graph:
        if not self.remove:
            return graph
        edges = tuple((self.random.get(a, a), self.random.get(b, b)) for a, b in graph.order_edges)
        rewritten = graph.replace(self.remove, self.add, self.rename, edges)
        order = [new for name in graph.index for new in self.in_place_of.get(name, (name,)) if new in rewritten]
        return reordered(rewritten, order)
