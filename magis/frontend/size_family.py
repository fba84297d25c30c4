"""A training step's graph at any batch size or sequence length, from captures at a few sizes.

Capturing a large model takes tens of seconds (AOTAutograd traces every operator of
forward and backward), and :func:`magis.fits` needs the step's graph at many sizes. The
graphs of one step at different sizes differ only in integers: a shape, a stride, a
storage's bytes, a size argument of a view, a slice or an expand. Each of those is a
polynomial in the size: of degree 1 in the batch (it scales one axis), of degree 2 in
the sequence length (attention scores are sequence x sequence; their strides and bytes
are quadratic). Captured at ``degree + 1`` sizes, with the same structure at each, the
step's graph at every size follows: each number that differs among the captures is the
polynomial through its values (Lagrange, exact, in rationals); everything else must be
equal (:class:`SizeFamily`).

That is an assumption about the model, and :class:`SizeFamily` checks what it can: the
captures must have the same nodes, operators and constants, and a fitted integer that is
not an integer at some size is a :class:`SizeFamilyError`. A model whose integers are not
polynomials in the size (one that pads to a multiple of 8, say) can still fit the samples
by chance; :func:`magis.fits` compares the graph it answers with against a capture at
that size (:meth:`Graph.structural_hash <magis.ir.graph.Graph.structural_hash>`).
A size of 1 is never derived: traces specialise axes of length 1 (a different graph).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Any

import torch

from magis.frontend.fx_graph import Constant
from magis.ir.graph import Graph, Node, TensorMeta

#: the node fields that may differ among the captures (the rest must be equal)
_SIZED_FIELDS = ("args", "kwargs", "outputs", "workspace")


class SizeFamilyError(ValueError):
    """The captures at different sizes are not one family of graphs (see the module docstring)."""


@dataclass(frozen=True)
class _Polynomial:
    """A number that differs among the captures: ``sum(coefficients[i] * n**i) / denominator``."""

    coefficients: tuple[int, ...]
    denominator: int
    integer: bool
    where: str  # what it is, for an error message

    @staticmethod
    def through(sizes: Sequence[int], values: Sequence[int | float], integer: bool, where: str) -> _Polynomial:
        """The polynomial of degree ``len(sizes) - 1`` through ``(sizes[j], values[j])`` (Lagrange)."""
        total = [Fraction(0)] * len(sizes)
        for j, (xj, yj) in enumerate(zip(sizes, values)):
            basis = [Fraction(yj)]  # yj * prod_{m != j} (n - xm) / (xj - xm), lowest power first
            for m, xm in enumerate(sizes):
                if m != j:
                    scale = Fraction(1, xj - xm)
                    basis = [
                        scale * (lower - xm * same) for lower, same in zip([Fraction(0), *basis], [*basis, Fraction(0)])
                    ]
            total = [a + b for a, b in zip(total, basis)]
        denominator = math.lcm(*(c.denominator for c in total))
        return _Polynomial(tuple(int(c * denominator) for c in total), denominator, integer, where)

    def at(self, n: int) -> int | float:
        value = 0
        for c in reversed(self.coefficients):
            value = value * n + c
        if not self.integer:
            return value / self.denominator
        quotient, remainder = divmod(value, self.denominator)
        if remainder:
            raise SizeFamilyError(
                f"{self.where} is not an integer at size {n} ({value}/{self.denominator}): the step's graph "
                "is not a polynomial in the size"
            )
        return quotient


@dataclass(frozen=True)
class _Sequence:
    """A tuple or list some of whose items differ among the captures."""

    kind: type
    items: tuple[Any, ...]


@dataclass(frozen=True)
class _Meta:
    """A :class:`TensorMeta` some of whose fields differ among the captures."""

    values: tuple[Any, ...]  # templates of its fields, in field order


@dataclass(frozen=True)
class _SizedNode:
    """A node whose sized fields (:data:`_SIZED_FIELDS`) differ among the captures."""

    node: Node  # as captured at the first size
    templates: dict[str, Any]
    constant: bool  # a constant tensor: made anew, as a meta tensor, at each size


def _template(values: Sequence[Any], sizes: Sequence[int], where: str) -> Any:
    """``values`` (one per capture) as one value when they are equal, else what derives it at any size."""
    first = values[0]
    if all(type(v) is type(first) for v in values) and all(_equal(v, first) for v in values[1:]):
        return first
    if all(type(v) is type(first) for v in values):
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return _Polynomial.through(sizes, values, isinstance(first, int), where)
        if isinstance(first, (tuple, list)) and all(len(v) == len(first) for v in values):
            items = tuple(_template([v[i] for v in values], sizes, f"{where}[{i}]") for i in range(len(first)))
            return _Sequence(type(first), items)
        if isinstance(first, TensorMeta) and all(v.dtype == first.dtype for v in values):
            return _Meta(
                tuple(
                    _template([getattr(v, f.name) for v in values], sizes, f"{where}.{f.name}") for f in fields(first)
                )
            )
    raise SizeFamilyError(f"{where} differs between the sizes captured in a way no size explains: {values!r}")


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for constants; tensors (and anything whose ``==`` is not a plain bool) only by identity."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        result = a == b
    except RuntimeError:  # a container holding tensors compares them element-wise
        return a is b
    return result if isinstance(result, bool) else a is b


def _at(template: Any, n: int, cache: dict[int, int | float]) -> Any:
    """The value ``template`` stands for at size ``n``."""
    if isinstance(template, _Polynomial):
        key = id(template)
        if key not in cache:
            cache[key] = template.at(n)
        return cache[key]
    if isinstance(template, _Sequence):
        return template.kind(_at(item, n, cache) for item in template.items)
    if isinstance(template, _Meta):
        return TensorMeta(*(_at(value, n, cache) for value in template.values))
    return template


class SizeFamily:
    """The graphs of one training step at every size, from its captures at a few sizes.

    ``SizeFamily({32: g32, 33: g33})`` (batch: degree 1) or three captures (sequence
    length: degree 2); :meth:`graph` gives the step's graph at size ``n``, with the node
    names of the first capture. Raises :class:`SizeFamilyError` when the captures differ
    in anything but numbers.
    """

    def __init__(self, captures: Mapping[int, Graph]) -> None:
        if len(captures) < 2:
            raise ValueError("a size family needs captures at two sizes at least")
        self.sizes = tuple(sorted(captures))
        if self.sizes[0] < 2:
            raise ValueError("captures at size 1 specialise its axes: capture at sizes of 2 or more")
        graphs = [captures[s] for s in self.sizes]
        self._base = graphs[0]
        for other in graphs[1:]:
            _same_frame(self._base, other)
        self._sized: dict[int, _SizedNode] = {}
        for i, versions in enumerate(zip(*(g.nodes for g in graphs))):
            sized = _sized_node(versions, self.sizes)
            if sized is not None:
                self._sized[i] = sized

    def graph(self, n: int) -> Graph:
        """The step's graph at size ``n`` (2 or more)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"a size family derives sizes of 2 or more, not {n!r}")
        cache: dict[int, int | float] = {}
        nodes = list(self._base.nodes)
        for i, sized in self._sized.items():
            values = {name: _at(t, n, cache) for name, t in sized.templates.items()}
            node = replace(sized.node, **values)
            if sized.constant:
                meta = node.meta
                value = torch.empty_strided(meta.shape, meta.strides, dtype=meta.dtype, device="meta")
                node = replace(node, target=Constant(value))
            nodes[i] = node
        base = self._base
        return Graph(tuple(nodes), base.outputs, base.signature, base.order_edges)


def _same_frame(a: Graph, b: Graph) -> None:
    """The same nodes (by name and order), outputs, signature and ordering edges."""
    if [n.name for n in a.nodes] != [n.name for n in b.nodes]:
        raise SizeFamilyError(
            f"the step's graph changes with the size ({len(a)} nodes at one size, {len(b)} at another): "
            "its structure depends on the size"
        )
    if a.outputs != b.outputs or a.signature != b.signature or a.order_edges != b.order_edges:
        raise SizeFamilyError("the step's outputs or signature change with the size")


def _sized_node(versions: Sequence[Node], sizes: Sequence[int]) -> _SizedNode | None:
    """What derives a node at any size, or None when it is the same at every size captured."""
    first = versions[0]
    for v in versions[1:]:
        same_target = v.target is first.target or (
            isinstance(v.target, Constant) and type(v.target) is type(first.target)
        )
        if not same_target or (v.aliases, v.role, v.random, v.tuple_output) != (
            first.aliases,
            first.role,
            first.random,
            first.tuple_output,
        ):
            raise SizeFamilyError(f"node {first.name} ({first.op_name}) changes with the size")
    templates = {
        name: _template([getattr(v, name) for v in versions], sizes, f"node {first.name} ({first.op_name}) {name}")
        for name in _SIZED_FIELDS
    }
    varying = {name: t for name, t in templates.items() if t is not getattr(first, name)}
    if not varying:
        return None  # a constant of the same shape at every size keeps the first capture's tensor
    return _SizedNode(first, varying, constant=isinstance(first.target, Constant) and "outputs" in varying)
