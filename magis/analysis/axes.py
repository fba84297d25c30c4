"""An operator's axes (MAGIS §4.1): what a dimension rule says, and the dims that need no rule.

The D-Graph (:mod:`magis.analysis.dgraph`) needs, for every operator, how its output
dimensions and reduce axes line up with its inputs' dimensions: an :class:`OpDims`,
which a dimension rule (:mod:`magis.analysis.dim_rules`) builds from the
:class:`OpCall` it reads.

- an operator's *axes* are the loops of its computation, numbered by the rule:
  positive axes appear as a dimension of some output element (for a single-output
  operator axis ``i`` is output dimension ``i - 1``); negative axes ``-1, -2, ...``
  are reduce axes that appear in no output (``k`` of a matmul);
- ``inputs[p][d]`` is the axis that dimension ``d`` of the ``p``-th tensor argument
  runs along (arguments in the order :func:`magis.ir.graph.iter_refs` visits them);
- ``outputs[e][d]`` is the axis of dimension ``d`` of output element ``e``;
- ``reductions[e]`` are the axes element ``e`` is a *sum* over: split the axis into
  parts, compute each part, add the results, and the element is exact (the weight
  gradient of a matmul over the batch, Figure 5 of the paper);
- ``sizes`` are the constant arguments that hold an axis' length (``view`` sizes,
  ``native_group_norm``'s ``N``): a part of a fissioned region divides them by ``n``
  (:func:`scale_sizes`).

``None`` means "no axis": that dimension is not linked to anything, so no fission
crosses it. Graph inputs, ``getitem`` and nodes without a rule get their dims here
(:func:`input_dims`, :func:`getitem_dims`, :func:`opaque_dims`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from magis.ir.graph import Node, Ref

Axis = int
Shape = tuple[int, ...]
AxisMap = tuple[Axis | None, ...]
#: where a size constant sits: (argument name, index in a list argument or ``None``).
SizePath = tuple[str, int | None]


@dataclass(frozen=True)
class OpDims:
    """How one operator's axes run through its tensors (see the module docstring)."""

    inputs: tuple[AxisMap, ...]
    outputs: tuple[AxisMap | None, ...]
    reductions: tuple[frozenset[Axis], ...]
    lengths: Mapping[Axis, int]
    sizes: tuple[tuple[SizePath, Axis], ...] = ()

    @property
    def axes(self) -> tuple[Axis, ...]:
        """Every axis of the operator: one D-Graph vertex each."""
        return tuple(sorted(self.lengths))

    def visible(self, element: int) -> AxisMap:
        """The axes a reader of output ``element`` can link to: its dimensions, then the
        axes it sums over (only ``getitem`` links those, to carry a partial sum on)."""
        dims = self.outputs[element] or ()
        return dims + tuple(sorted(self.reductions[element]))


# ------------------------------------------------------------------ rule input
@dataclass(frozen=True)
class OpCall:
    """What a rule sees: the node, its arguments bound by schema name, its inputs' shapes."""

    node: Node
    args: Mapping[str, Any]
    shapes: Mapping[str, Shape] = field(repr=False)

    def shape(self, arg: str) -> Shape:
        """Shape of the tensor argument ``arg``."""
        return self.shapes[self.args[arg].name]

    def ndim(self, arg: str) -> int:
        return len(self.shape(arg))

    @property
    def out(self) -> Shape:
        """Shape of output element 0."""
        meta = self.node.outputs[0]
        return () if meta is None else meta.shape

    def dims(
        self,
        inputs: Mapping[str, AxisMap | Sequence[AxisMap]],
        outputs: Sequence[AxisMap | None] | None = None,
        reductions: Sequence[frozenset[Axis]] = (),
        sizes: Sequence[tuple[SizePath, Axis]] = (),
    ) -> OpDims:
        """Build the :class:`OpDims`: ``inputs`` maps argument names to axes (a list of
        them for a list of tensors); arguments left out are unlinked. ``outputs``
        defaults to the identity over the single output."""
        per_ref = tuple(self._flatten(inputs))
        if outputs is None:
            outputs = (identity(len(self.out)),)
        outputs = tuple(None if m is None else axes for m, axes in zip(self.node.outputs, outputs, strict=True))
        reductions = tuple(reductions) or (frozenset(),) * len(outputs)
        lengths: dict[Axis, int] = {}
        for meta, axes in zip(self.node.outputs, outputs):
            if meta is not None and axes is not None:
                _collect_lengths(lengths, meta.shape, axes)
        for ref, axes in zip(self.node.refs, per_ref):
            _collect_lengths(lengths, self.shapes[ref.name], axes)
        for red in reductions:
            missing = red - lengths.keys()
            assert not missing, f"{self.node.op_name}: reduce axes {missing} appear in no input"
        return OpDims(per_ref, outputs, reductions, MappingProxyType(lengths), tuple(sizes))

    def _flatten(self, inputs: Mapping[str, AxisMap | Sequence[AxisMap]]) -> list[AxisMap]:
        """Per-argument axes in the order ``iter_refs`` visits the node's tensors."""
        out: list[AxisMap] = []
        names = _positional_names(self.node.target)
        given = [*zip(names, self.node.args), *self.node.kwargs]
        for name, value in given:
            axes = inputs.get(name)
            if isinstance(value, Ref):
                out.append(axes if axes is not None else (None,) * len(self.shapes[value.name]))
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Ref):
                        out.append(axes[i] if axes is not None else (None,) * len(self.shapes[item.name]))
        return out


def _collect_lengths(lengths: dict[Axis, int], shape: Shape, axes: AxisMap) -> None:
    assert len(shape) == len(axes), f"axes {axes} do not match shape {shape}"
    for size, axis in zip(shape, axes):
        if axis is not None:
            lengths.setdefault(axis, size)


def _positional_names(target: Any) -> list[str]:
    return [a.name for a in target._schema.arguments]


def bind(node: Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update(zip(_positional_names(node.target), node.args))
    bound.update(node.kwargs)
    return bound


def identity(ndim: int, skip: Sequence[int] = ()) -> AxisMap:
    """Dimension ``d`` on axis ``d + 1``, except the dimensions in ``skip`` (unlinked)."""
    return tuple(None if d in skip else d + 1 for d in range(ndim))


def right_aligned(shape: Shape, out: Shape) -> AxisMap:
    """Broadcasting: dimension ``d`` of ``shape`` lines up with output dimension
    ``d + len(out) - len(shape)``; it is linked unless it is broadcast (length 1 against more)."""
    offset = len(out) - len(shape)
    return tuple(offset + d + 1 if size == out[offset + d] else None for d, size in enumerate(shape))


class NoRule(Exception):
    """Raised by a rule for a configuration it cannot describe (e.g. attention with dropout)."""


Rule = Callable[[OpCall], OpDims]


# ------------------------------------------------------------------ dims without a rule
def input_dims(shape: Shape) -> OpDims:
    """A graph input: one axis per dimension."""
    return OpDims((), (identity(len(shape)),), (frozenset(),), MappingProxyType(_lengths(shape)))


def _lengths(shape: Shape) -> dict[Axis, int]:
    return {d + 1: s for d, s in enumerate(shape)}


def getitem_dims(source: OpDims, element: int, shape: Shape) -> OpDims:
    """``getitem(t, e)``: its dimensions are element ``e``'s, and it carries the axes
    that element sums over as its own reduce axes ``-1, -2, ...``, so that a weight
    gradient pulled out of ``convolution_backward`` still sums over the batch."""
    reduce = tuple(-(i + 1) for i in range(len(source.reductions[element])))
    lengths = _lengths(shape)
    for own, axis in zip(reduce, sorted(source.reductions[element])):
        lengths[own] = source.lengths[axis]
    own_axes = identity(len(shape)) + reduce
    return OpDims((own_axes,), (identity(len(shape)),), (frozenset(reduce),), MappingProxyType(lengths))


def opaque_dims(node: Node) -> OpDims:
    """Dims of a node without a rule: one fresh axis per output dimension, no input linked.

    Its outputs still have D-Graph vertices (its consumers may link to them), but no
    axis runs through it.
    """
    outputs: list[AxisMap | None] = []
    lengths: dict[Axis, int] = {}
    for meta in node.outputs:
        if meta is None:
            outputs.append(None)
            continue
        start = len(lengths)
        axes = tuple(start + d + 1 for d in range(len(meta.shape)))
        lengths.update(zip(axes, meta.shape))
        outputs.append(axes)
    return OpDims((), tuple(outputs), (frozenset(),) * len(outputs), MappingProxyType(lengths))


# ------------------------------------------------------------------ one part's sizes
def scale_sizes(node: Node, dims: OpDims, axis: Axis, parts: int) -> Node:
    """``node`` with every size constant of ``axis`` divided by ``parts`` (one part's shapes)."""
    if not any(size_axis == axis for _, size_axis in dims.sizes):
        return node
    args = list(node.args)
    kwargs = dict(node.kwargs)
    names = _positional_names(node.target)
    for (arg, index), size_axis in dims.sizes:
        if size_axis != axis:
            continue
        position = names.index(arg)
        holder = args if position < len(args) else kwargs
        key = position if holder is args else arg
        value = holder[key]
        if index is None:
            holder[key] = _divide(value, parts)
        else:
            value = list(value)
            value[index] = _divide(value[index], parts)
            holder[key] = value
    return replace(node, args=tuple(args), kwargs=tuple(sorted(kwargs.items())))


def _divide(size: int, parts: int) -> int:
    if size % parts:
        raise ValueError(f"size {size} is not divisible by {parts}")
    return size // parts
