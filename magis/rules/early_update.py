"""Early updates: each parameter updated as soon as its gradient is final (issue #29).

Eager's step updates a whole param group after the backward (on CUDA with one
multi-tensor kernel per operation, :class:`~magis.frontend.optimizer.ParameterUpdate`
with ``foreach``), so every gradient is held until the last is computed. PyTorch's
optimizer-in-backward pattern (per-parameter optimizers stepped from
``register_post_accumulate_grad_hook``; torchtune's ``optimizer_in_bwd``, LOMO) updates
each parameter as soon as its gradient is final and frees the gradient. :func:`early_updates`
is that pattern as an M-Rule: it splits a group's update into one update per parameter,
each placed in the schedule right after the last node it must follow (its gradient, and
every reader of the parameter, which the update overwrites). The split costs kernel
launches (a multi-tensor kernel per operation becomes one kernel per parameter), so the
search weighs it like any rule, and against fission: a fissioned weight gradient is final
only after the last part, which is where the update then goes. A split-off Adam/AdamW update of
a parameter above :data:`~magis.frontend.optimizer.PIECE_BYTES` runs slice by slice (exact: the
update is elementwise), so its ``sqrt(v)`` temporaries hold a slice instead of the parameter: on
a CPU, whose eager step loops over the parameters, the largest one (a tied embedding) otherwise
makes the step's peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from magis.frontend.optimizer import ParameterUpdate, piece_bytes, update_node, update_pieces, update_workspace
from magis.ir.graph import Graph, Node, Ref
from magis.rules.rewrite import Rewrite

aten = torch.ops.aten

#: slices at least, of an update that adds a tied weight's two gradients itself
SUMMED_PIECES = 8

#: shares of a group's gradient bytes whose largest parameters a candidate updates early: a
#: group's bytes sit in a few matrices, its launches in many small tensors (biases, norms)
BYTE_SHARES = (0.5, 0.9)


def early_updates(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """Split each multi-parameter update of ``graph`` into per-parameter updates: for every
    parameter of the group, and for the fewest largest parameters that hold each share of
    :data:`BYTE_SHARES` of its gradient bytes (the others stay one grouped update)."""
    order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
    found = []
    for node in graph.nodes:
        target = node.target
        if not isinstance(target, ParameterUpdate) or len(target.params) < 2:
            continue
        sizes = dict(zip(target.params, (graph[g].meta.nbytes for g in target.gradients(node))))
        largest = sorted(target.params, key=lambda p: -sizes[p])
        total, candidates = sum(sizes.values()), {}
        for share in BYTE_SHARES:
            covered, chosen = 0, []
            for name in largest:
                if covered >= share * total:
                    break
                chosen.append(name)
                covered += sizes[name]
            candidates[tuple(chosen)] = None
        candidates[target.params] = None
        found += [_split(graph, order, node, chosen) for chosen in candidates]
    return found


def every_parameter_early(graph: Graph, order: Sequence[str] | None = None) -> tuple[Graph, tuple[str, ...]] | None:
    """``graph`` with every update of more than one parameter split into per-parameter updates, and
    an order placing each as early as it can go: PyTorch's optimizer-in-backward, for peers that
    run it. None where no update holds more than one parameter."""
    order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
    split = False
    for node in [n for n in graph.nodes if isinstance(n.target, ParameterUpdate) and len(n.target.params) > 1]:
        rewrite = _split(graph, order, node, node.target.params, in_pieces=False)
        graph, order, split = rewrite.graph, rewrite.order, True
    return (graph, order) if split else None


def _split(graph: Graph, order: Sequence[str], group: Node, chosen: tuple[str, ...], in_pieces: bool = True) -> Rewrite:
    """``graph`` with the update of each parameter of ``chosen`` taken out of ``group`` into a node
    of its own, placed as early as the schedule allows; ``in_pieces``: Adam's of a large parameter
    in slices (PyTorch's optimizer-in-backward, which :func:`every_parameter_early` stands for, runs
    each parameter's update whole)."""
    target: ParameterUpdate = group.target
    per = 2 + len(target.states)
    head, rest = group.args[:2], group.args[2:]
    slices = {name: rest[i * per : (i + 1) * per] for i, name in enumerate(target.params)}
    clipped = head[1] is not None
    added = []
    summed = []  # gradient sums taken into a sliced update
    for name in chosen:
        node, gradient_sum = _single_update(graph, group, name, slices[name], in_pieces)
        added.append(node)
        summed += [gradient_sum] if gradient_sum else []
    kept = tuple(name for name in target.params if name not in chosen)
    remove = [group.name, *summed]
    if kept:
        args = (*head, *(a for name in kept for a in slices[name]))
        rest_target = replace(target, params=kept)
        sizes = [_bytes(graph, a) for a in args[2::per]]
        added.append(update_node(graph, rest_target, args, update_workspace(rest_target, sizes, clipped)))
    rewritten = graph.replace(remove=remove, add=added)
    outputs = tuple(o for o in rewritten.outputs if o != group.name) + tuple(n.name for n in added)
    rewritten = Graph(rewritten.nodes, outputs, rewritten.signature, rewritten.order_edges)
    what = "every parameter" if not kept else f"the {len(chosen)} largest parameters"
    return Rewrite(
        rewritten,
        f"update {what} of param group {target.group} as soon as its gradient is final",
        order=_earliest(rewritten, [n for n in order if n not in remove], [n.name for n in added]),
        touched=frozenset({*remove, *(n.name for n in added)}),
    )


def _single_update(graph: Graph, group: Node, name: str, own: Sequence, in_pieces: bool) -> tuple[Node, str | None]:
    """The update of parameter ``name`` of ``group`` (``own``: its parameter, gradient and states), in
    slices where it is an Adam's of a large parameter and ``in_pieces``, reading a tied weight's
    two gradients itself where that pays; and the name of the gradient's sum it then replaces."""
    target: ParameterUpdate = group.target
    head, meta = group.args[:2], graph[own[0].name].meta
    pieces = update_pieces(meta) if in_pieces and target.kind in ("adam", "adamw") else 1
    terms = _gradient_terms(graph, own[1].name, group.name) if pieces > 1 else None
    if terms is not None:
        # the terms stay whole through the update, beside three slices (the sum, Adam's two
        # temporaries), where the sum's add held three weights: it pays from 4 slices on
        pieces = max(pieces, min(SUMMED_PIECES, meta.shape[0]))
        if 3 * piece_bytes(meta, pieces) >= meta.nbytes:
            terms = None
    args = (*head, own[0], terms[0], *own[2:], terms[1]) if terms else (*head, *own)
    single = replace(target, params=(name,), pieces=pieces, summed=terms is not None)
    workspace = update_workspace(single, [piece_bytes(meta, pieces)], head[1] is not None)
    return update_node(graph, single, args, workspace), own[1].name if terms else None


def _gradient_terms(graph: Graph, gradient: str, update: str) -> tuple[Ref, Ref] | None:
    """The two tensors whose sum ``gradient`` is, where nothing but ``update`` reads it: a tied
    weight's gradient, the sum of its two uses' (a language model's embedding and output
    projection). The update then adds them a slice at a time, and the whole sum, as large as
    the weight, never exists (eager's ``AccumulateGrad`` adds the second into the first in place)."""
    node = graph[gradient]
    if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if not (isinstance(a, Ref) and isinstance(b, Ref)) or gradient in graph.outputs:
        return None
    if graph.consumers.get(gradient) != (update,):
        return None
    same = (graph[a.name].meta, graph[b.name].meta)
    if any((m.shape, m.dtype) != (node.meta.shape, node.meta.dtype) for m in same):
        return None  # a broadcast or promoting sum: its slices are not the terms' slices
    return a, b


def _bytes(graph: Graph, ref: Ref) -> int:
    return graph[ref.name].meta.nbytes


def _earliest(graph: Graph, order: list[str], new: list[str]) -> tuple[str, ...]:
    """``order`` with each of ``new`` inserted right after the last node it must follow."""
    placed = list(order)
    for name in new:
        preds = set(graph.predecessors[name])
        at = max((i for i, n in enumerate(placed) if n in preds), default=-1) + 1
        placed.insert(at, name)
    return tuple(placed)
