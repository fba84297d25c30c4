"""Dimension rules: which axis of an operator each tensor dimension is (MAGIS §4.1).

The D-Graph (:mod:`magis.analysis.dgraph`) needs, for every operator, how its output
dimensions and reduce axes line up with its inputs' dimensions, as an
:class:`~magis.analysis.axes.OpDims` (:mod:`magis.analysis.axes` says what its
fields mean). This module finds it for a node: graph inputs and ``getitem`` need no
rule; any other operator is looked up in the rules of the operators that compute
(:mod:`magis.analysis.compute_dims`) and of those that move data
(:mod:`magis.analysis.layout_dims`), and any other operator tagged ``pointwise`` is
elementwise. Every rule links only what is exact; an operator without a rule gets
``None`` from :func:`op_dims` and is never fissioned.
"""

from __future__ import annotations

import operator
from types import MappingProxyType
from typing import Any

import torch

from magis.analysis.axes import NoRule, OpCall, OpDims, Rule, Shape, bind, getitem_dims, input_dims
from magis.analysis.compute_dims import COMPUTE_RULES, pointwise
from magis.analysis.layout_dims import LAYOUT_RULES
from magis.ir.graph import Graph

#: aten operator -> rule. Any other operator tagged ``pointwise`` uses :func:`~magis.analysis.compute_dims.pointwise`.
RULES: dict[Any, Rule] = {**COMPUTE_RULES, **LAYOUT_RULES}


def rule_for(target: Any) -> Rule | None:
    """The rule of an aten operator, or ``None`` when it has none."""
    rule = RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return pointwise
    return rule


def op_dims(graph: Graph, name: str, source: OpDims | None = None) -> OpDims | None:
    """The :class:`~magis.analysis.axes.OpDims` of node ``name``, or ``None`` when no rule describes it.

    Graph inputs have one axis per dimension. A ``getitem`` needs ``source``, the dims
    of the tuple it reads (:func:`~magis.analysis.axes.getitem_dims`).
    """
    node = graph[name]
    meta = node.outputs[0] if node.outputs else None
    if node.is_input:
        return None if meta is None else input_dims(meta.shape)  # the optimizer's handle holds no tensor
    if node.target is operator.getitem:
        return None if source is None else getitem_dims(source, node.args[1], meta.shape)
    rule = rule_for(node.target)
    if rule is None:
        return None
    shapes = {ref.name: _shape_of(graph, ref.name) for ref in node.refs}
    try:
        return rule(OpCall(node, MappingProxyType(bind(node)), MappingProxyType(shapes)))
    except NoRule:
        return None


def _shape_of(graph: Graph, name: str) -> Shape:
    meta = graph[name].outputs[0]
    return () if meta is None else meta.shape
