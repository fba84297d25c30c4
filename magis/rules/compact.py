"""Compact saved tensors (Echo §IV-B, layer specifics): a mask instead of a feature map.

- ReLU: the backward of ``relu`` is ``threshold_backward(grad, out, 0)``, which needs
  only where ``out <= 0``. Where a ReLU's output is saved past the peak for nothing
  else, :func:`compact` keeps ``le(out, 0)`` (a bool, one byte an element) from the
  forward and the backward becomes ``where(mask, 0, grad)``: the same values, NaN
  included, from a quarter of the bytes (fp32).
- Dropout: the backward keeps the bool mask already; what a training step also saves
  is the dropout's scaled output, for the operator that reads it (a matmul's weight
  gradient). :func:`compact` recomputes that output from the mask, ``input * mask *
  scale``, one operator and no new random numbers (:mod:`magis.rules.remat`), where
  the dropout's input is kept anyway.

Both are proposed, like every rule here, only around the memory hot-spots and only
where Echo's estimate (Echo §IV-A) finds bytes saved at the peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from magis.ir.graph import Graph, Node, Ref
from magis.rules.remat import RematError, plan_recompute, with_copies
from magis.rules.rewrite import (
    Rewrite,
    SavedTensor,
    Timeline,
    kept_alive,
    net_saving,
    prune_dead,
    rebuild,
    saved_tensors,
)

aten = torch.ops.aten


def compact(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """Echo's compact saved tensors around the hot-spots of ``order``: ReLU outputs kept as
    masks, dropout outputs recomputed from their masks."""
    timeline = Timeline.of(graph, order)
    found = []
    for saved in saved_tensors(graph, timeline):
        owner = graph[saved.storage[0]]
        if owner.target is aten.relu.default and _only_threshold_backward(graph, saved):
            rewrite = _relu_mask(graph, timeline, saved)
        elif owner.target is aten.native_dropout.default and saved.storage[1] == 0:
            rewrite = _dropout_from_mask(graph, timeline, saved)
        else:
            continue
        memory = None if rewrite is None else timeline.not_raised_by(rewrite.graph)
        if rewrite is not None and memory is not None:
            found.append(replace(rewrite, memory=memory))
    return found


def _only_threshold_backward(graph: Graph, saved: SavedTensor) -> bool:
    """Every reader after the peak is ``threshold_backward(grad, relu, 0)``, reading the ReLU's
    output itself (or a ``detach``/``alias`` of it, as capture leaves them)."""
    relu = saved.storage[0]
    return all(
        graph[r].target is aten.threshold_backward.default
        and _unchanged(graph, graph[r].args[1].name) == relu
        and graph[r].args[2] == 0
        for r in saved.late
    )


def _unchanged(graph: Graph, name: str) -> str:
    """The node whose value ``name`` is, through ``detach`` and ``alias``."""
    while graph[name].target in (aten.detach.default, aten.alias.default):
        name = graph[name].inputs[0]
    return name


def _relu_mask(graph: Graph, timeline: Timeline, saved: SavedTensor) -> Rewrite | None:
    relu = graph[saved.storage[0]]
    meta = relu.meta
    mask_meta = replace(meta, dtype=torch.bool, nbytes=meta.numel)
    name = graph.fresh_name(f"{relu.name}_mask")
    mask = Node(name, aten.le.Scalar, (Ref(relu.name), 0), (), (mask_meta,), (None,), relu.role)
    saving = net_saving(timeline, saved.freed, dict.fromkeys(saved.freed, mask_meta.nbytes))
    if saving is None:
        return None
    readers = [
        replace(graph[r], target=aten.where.ScalarSelf, args=(Ref(mask.name), 0.0, graph[r].args[0]), kwargs=())
        for r in saved.late
    ]
    order = list(timeline.order)
    order.insert(order.index(relu.name) + 1, mask.name)
    result = prune_dead(rebuild(graph, order, [mask, *readers]), saved.carriers)
    description = (
        f"compact {relu.name}: a bool mask kept for {len(readers)} ReLU backward(s), {saving} bytes saved at the peak"
    )
    touched = {mask.name, *saved.late} | (set(graph.index) - set(result.index))
    return Rewrite(result, description, tuple(n.name for n in result.nodes), frozenset(touched), saving)


def _dropout_from_mask(graph: Graph, timeline: Timeline, saved: SavedTensor) -> Rewrite | None:
    try:
        segment = plan_recompute(graph, saved, timeline, max_ops=1)
    except RematError:
        return None
    saving = net_saving(timeline, saved.freed, kept_alive(graph, timeline, segment.reads, saved.first_late))
    if saving is None:
        return None
    result = with_copies(graph, saved, timeline, segment)
    description = f"compact {saved.storage[0]}: output recomputed from its mask, {saving} bytes saved at the peak"
    touched = {n.name for n in segment.nodes} | set(saved.late) | (set(graph.index) - set(result.index))
    return Rewrite(result, description, tuple(n.name for n in result.nodes), frozenset(touched), saving)
