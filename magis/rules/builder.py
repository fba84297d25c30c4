"""New nodes for a rewrite rule: fresh names, and output metadata from meta tensors.

A rule that replaces nodes by others (:mod:`magis.rules.identity`,
:mod:`magis.rules.separable`) must give every new node its :class:`TensorMeta`
and storage aliasing, exactly as capture would have. :class:`NodeBuilder` runs
each new operator on meta tensors (no memory, no data) laid out as the recorded
strides of its inputs, so the new outputs carry the shapes, sizes and strides the
real run will produce; where an input's layout is unknown, so are the outputs'.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta, iter_refs, map_refs


class NodeBuilder:
    """New nodes named ``<base>_<kind><i>`` (unused in ``graph``), with the role of
    node ``base`` unless told otherwise; :attr:`nodes` lists them in the order made."""

    def __init__(self, graph: Graph, base: str) -> None:
        self.graph, self.base, self.role = graph, base, graph[base].role
        self.nodes: list[Node] = []
        self._made: dict[str, Node] = {}

    def add(
        self,
        kind: str,
        target: Any,
        args: tuple,
        kwargs: dict[str, Any] | None = None,
        role: Role | None = None,
        random: bool = False,
        like: Node | None = None,
    ) -> Ref:
        """Append ``target(*args, **kwargs)``. An op returning a tuple becomes a tuple node
        (read it with :meth:`element`); an output that is a view of an input shares its storage.
        ``like``, a node of the same operator, lends its metadata to every output after the
        first: outputs whose size no input changes, where the meta kernel and the device's
        disagree (an eval-mode batch norm's statistics: ``[C]`` on meta, empty on a CPU)."""
        kwargs = kwargs or {}
        refs = list(iter_refs((args, kwargs)))
        inputs = {ref.name: _meta_tensor(self._meta(ref)) for ref in refs}
        out = target(*map_refs(args, lambda r: inputs[r.name]), **map_refs(kwargs, lambda r: inputs[r.name]))
        values = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        known = all(self._meta(ref).strides is not None for ref in refs)
        order = list(dict.fromkeys(ref.name for ref in refs))  # positions as Node.inputs counts them
        aliases = tuple(_alias(v, inputs, order) for v in values)
        outputs = tuple(_described(v, known) for v in values)
        if like is not None:
            outputs = outputs[:1] + like.outputs[1:]
        node = Node(
            self._fresh(kind),
            target,
            args,
            tuple(kwargs.items()),
            outputs=outputs,
            aliases=aliases,
            role=self.role if role is None else role,
            random=random,
            tuple_output=isinstance(out, (tuple, list)),
        )
        return self._append(node)

    def element(self, ref: Ref, index: int, role: Role | None = None) -> Ref:
        """A ``getitem`` node reading element ``index`` of the tuple node ``ref`` (a view of it)."""
        meta = self._made[ref.name].outputs[index]
        node = Node(
            self._fresh("item"),
            operator.getitem,
            (ref, index),
            outputs=(meta,),
            aliases=((0, index),),
            role=self.role if role is None else role,
        )
        return self._append(node)

    def _append(self, node: Node) -> Ref:
        self.nodes.append(node)
        self._made[node.name] = node
        return Ref(node.name)

    def _meta(self, ref: Ref) -> TensorMeta:
        node = self._made.get(ref.name) or self.graph[ref.name]
        return node.meta

    def _fresh(self, kind: str) -> str:
        i = 0
        while (name := f"{self.base}_{kind}{i}") in self.graph or name in self._made:
            i += 1
        return name


def _meta_tensor(meta: TensorMeta) -> torch.Tensor:
    if meta.strides is None:
        return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    return torch.empty_strided(meta.shape, meta.strides, dtype=meta.dtype, device="meta")


def _described(value: torch.Tensor, strides_known: bool) -> TensorMeta:
    meta = TensorMeta.of(value)
    return meta if strides_known else TensorMeta(meta.shape, meta.dtype, meta.nbytes)


def _alias(value: torch.Tensor, inputs: dict[str, torch.Tensor], order: list[str]) -> tuple[int, int] | None:
    """``(input position, 0)`` when ``value`` is a view of that input, else ``None``."""
    return next(((i, 0) for i, name in enumerate(order) if value._base is inputs[name]), None)
