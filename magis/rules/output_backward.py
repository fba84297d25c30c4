"""Backwards from outputs instead of inputs: operator choices of MONeT (ICLR'22, §3,
"output-activated" operators).

ReLU6 (``hardtanh(x, 0, 6)``) and leaky ReLU let autograd save their *input* for the
backward, while the gradient only asks where the input lies, which the output tells just as
well: ``y = clamp(x, lo, hi)`` is strictly inside ``(lo, hi)`` exactly where ``x`` is, and
``leaky_relu(x, s)`` with ``s > 0`` is positive exactly where ``x`` is (NaN stays NaN and
fails every comparison either way). Reading the output, which the next layer saves anyway,
frees the input: with ``inplace=True`` activations (torchvision's MobileNetV2) the captured
step even clones every batch-norm output for those backwards, a copy the rewrite removes.
The gradient is the same kernel's on the same decisions: equal bit for bit.

Batch norm followed by ReLU (:func:`batch_norms_from_outputs`): autograd saves the batch
norm's input ``y`` for its backward and the ReLU's output ``r`` for the ReLU's backward and
the next layer's; the batch norm's output ``z`` tells both backwards what they need.
ReLU's backward asks only where ``z > 0``. Batch norm's asks for ``xhat = (y - mean) *
invstd``, which is ``(z - bias) / weight``: the backward kernel given ``z`` as its input,
``bias`` as the mean, ``1 / weight`` as the inverse deviation and ``weight**2 * invstd``
as the weight computes the same formula (``dweight = sum(dz * xhat)``, ``dbias = sum(dz)``,
``dy = weight * invstd * (dz - mean(dz) - xhat * mean(dz * xhat))``) without a temporary
the size of ``y``. Saving ``z`` alone (``r = relu(z)`` is recomputed, a pointwise op, by
:mod:`magis.rules.remat` where that pays) is MONeT's choice for BN-ReLU; before an
activation whose backward reads its input (SiLU, GELU, hardswish) ``z`` is saved already,
and the batch norm's ``y`` goes. It rounds
differently (relative 1e-16 in float64, 1e-7 in float32) and it divides by the weight:
the step holds only while every channel's ``|bias| < DIVISOR_RATIO * |weight|``
(the rounding of ``z`` is magnified ``|bias / weight|`` times; a zero weight loses
``xhat``), which the runtime checks each time it binds the module
(``Signature.divided_by``, :func:`magis.backend.runtime.bind`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import replace

import torch

from magis.ir.graph import Graph, Node, Ref, Role
from magis.rules.builder import NodeBuilder
from magis.rules.rewrite import Rewrite, prune_dead

aten = torch.ops.aten
#: batch norm's training forward as capture records it, and its backward
BATCH_NORM = aten._native_batch_norm_legit_functional.default
BATCH_NORM_BACKWARD = aten.native_batch_norm_backward.default

#: ops that pass a value on unchanged (what capture puts between a forward value and its saved copy)
_SAME_VALUE = (aten.clone.default, aten.alias.default, aten.detach.default)


def _value_of(graph: Graph, name: str) -> str:
    """The node whose value ``name`` is, through clones, aliases and detaches."""
    while graph[name].target in _SAME_VALUE:
        name = graph[name].inputs[0]
    return name


def _forward_output(graph: Graph, backward: Node) -> str | None:
    """The forward activation whose output ``backward`` (reading its input) may read instead."""
    if not isinstance(backward.args[1], Ref):
        return None
    source = _value_of(graph, backward.args[1].name)
    for reader in graph.successors[source]:
        forward = graph[reader]
        if backward.target is aten.hardtanh_backward.default and forward.target is aten.hardtanh.default:
            lo, hi = backward.args[2:4]
            if tuple(forward.args[1:3]) == (lo, hi) and lo < hi:
                return reader
        if backward.target is aten.leaky_relu_backward.default and forward.target is aten.leaky_relu.default:
            slope, is_result = backward.args[2:4]
            if not is_result and slope > 0 and tuple(forward.args[1:2] or (0.01,)) == (slope,):
                return reader
    return None


def backward_from_outputs(graph: Graph) -> list[Rewrite]:
    """The M-Rule: every ReLU6 / leaky-ReLU backward that reads its input made to read the
    forward's output (module docstring), in one rewrite; copies left unread are removed."""
    rewired: dict[str, Node] = {}
    for node in graph.nodes:
        if node.target not in (aten.hardtanh_backward.default, aten.leaky_relu_backward.default):
            continue
        output = _forward_output(graph, node)
        if output is None or graph.index[output] > graph.index[node.name]:
            continue
        args = list(node.args)
        args[1] = Ref(output)
        if node.target is aten.leaky_relu_backward.default:
            args[3] = True  # self_is_result
        rewired[node.name] = replace(node, args=tuple(args))
    if not rewired:
        return []
    nodes = tuple(rewired.get(n.name, n) for n in graph.nodes)
    copies = {p for name in rewired for p in graph[name].inputs}  # left unread: removed
    rewritten = prune_dead(Graph(nodes, graph.outputs, graph.signature, graph.order_edges), copies)
    return [Rewrite(rewritten, f"backward from outputs: {len(rewired)} activations")]


def _readers(graph: Graph, name: str) -> list[str]:
    """The nodes that read ``name``'s value, directly or through clones, aliases and detaches."""
    found = []
    for reader in graph.successors[name]:
        found += _readers(graph, reader) if graph[reader].target in _SAME_VALUE else [reader]
    return found


def _activation_backwards(graph: Graph, output: str) -> list[str] | None:
    """The backwards to make read ``output``: those of the one ReLU or ReLU6 that reads it (each
    reading ``output``, the activation's result or a copy of either: they ask only where
    ``output`` lies); ``[]`` where another backward reads ``output`` already (SiLU's, GELU's,
    hardswish's read their input); None where no backward would read it (nothing to gain)."""
    activations = [r for r in graph.successors[output] if graph[r].target in (aten.relu.default, aten.hardtanh.default)]
    found: list[str] = []
    if len(activations) == 1:
        activation = graph[activations[0]]
        if activation.target is aten.relu.default:
            backward, bounds = aten.threshold_backward.default, (0,)
        else:  # ReLU6 and other clamps
            backward, bounds = aten.hardtanh_backward.default, tuple(activation.args[1:])
        if activation.target is aten.relu.default or (len(bounds) == 2 and bounds[0] < bounds[1]):
            readers = _readers(graph, output) + _readers(graph, activation.name)
            found = [r for r in readers if graph[r].target is backward and tuple(graph[r].args[2:]) == bounds]
    if found or any(graph[r].role is Role.BACKWARD for r in _readers(graph, output)):
        return found
    return None


def _batch_norm_forward(graph: Graph, backward: Node) -> tuple[Node, str] | None:
    """The training batch norm whose backward ``backward`` is, and the ``getitem`` of its output."""
    source, weight = backward.args[1], backward.args[2]
    if not isinstance(source, Ref) or backward.args[7] is not True:
        return None
    for reader in graph.successors[source.name]:
        forward = graph[reader]
        if forward.target is BATCH_NORM and forward.args[0] == source and forward.args[1] == weight:
            elements = [graph[c] for c in graph.successors[reader]]
            outputs = [e.name for e in elements if e.target is operator.getitem and e.args[1] == 0]
            return (forward, outputs[0]) if len(outputs) == 1 else None
    return None


def batch_norms_from_outputs(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """The M-Rule: every training batch norm followed by a ReLU (or ReLU6) has its backward and
    the activation's read the batch norm's output (module docstring), as does every one whose
    output a backward reads already (before SiLU, GELU, hardswish), in one rewrite; the
    weights divided by are recorded in ``signature.divided_by``. Only float32/float64 outputs
    (a narrower one's rounding would be magnified by the division) and weights that are the
    module's parameters (bound, and so checked, at each step). The rewrite's order is ``order``
    (default: the node order) with each backward's new operands made right before it."""
    rewired: dict[str, Node] = {}
    added: list[Node] = []
    placed: dict[str, str] = {}  # new node -> the backward whose place it takes
    divided_by: list[tuple[str, str]] = []
    for node in graph.nodes:
        if node.target is not BATCH_NORM_BACKWARD:
            continue
        found = _batch_norm_forward(graph, node)
        backwards = None if found is None else _activation_backwards(graph, found[1])
        if backwards is None or graph[found[1]].meta.dtype not in (torch.float32, torch.float64):
            continue
        forward, output = found
        weight, bias, invstd = forward.args[1], forward.args[2], node.args[6]
        build = NodeBuilder(graph, node.name)
        parameters = graph.signature.parameters
        if isinstance(weight, Ref) and isinstance(bias, Ref) and {weight.name, bias.name} <= parameters.keys():
            square = build.add("square", aten.mul.Tensor, (weight, weight))
            scale = build.add("scale", aten.mul.Tensor, (square, invstd))
            mean, deviation = bias, build.add("reciprocal", aten.reciprocal.default, (weight,))
            divided_by.append((weight.name, bias.name))
        elif weight is None and bias is None:  # the output is xhat itself: nothing divides
            scale = invstd
            mean = build.add("zero", aten.zeros_like.default, (invstd,))
            deviation = build.add("one", aten.ones_like.default, (invstd,))
        else:
            continue
        args = list(node.args)
        args[1], args[2], args[5], args[6] = Ref(output), scale, mean, deviation
        rewired[node.name] = replace(node, args=tuple(args))
        added += build.nodes
        placed.update({n.name: node.name for n in build.nodes})
        for name in backwards:
            activation = graph[name]
            rewired[name] = replace(activation, args=(activation.args[0], Ref(output), *activation.args[2:]))
    if not rewired:
        return []
    placed.update({name: name for name in rewired})
    copies = {p for name in rewired for p in graph[name].inputs}  # left unread: removed
    rewritten = graph.replace(remove=rewired, add=[*added, *rewired.values()], in_place_of=placed)
    signature = replace(rewritten.signature, divided_by=rewritten.signature.divided_by + tuple(divided_by))
    rewritten = prune_dead(Graph(rewritten.nodes, rewritten.outputs, signature, rewritten.order_edges), copies)
    operands: dict[str, list[str]] = {}
    for node in added:
        operands.setdefault(placed[node.name], []).append(node.name)
    order = order if order is not None else [n.name for n in graph.nodes]
    scheduled = tuple(n for name in order for n in (*operands.get(name, ()), name) if n in rewritten.index)
    touched = frozenset(rewired) | {n.name for n in added}
    touched |= {name for name in copies if name not in rewritten.index}
    count = sum(node.target is BATCH_NORM_BACKWARD for node in rewired.values())
    return [Rewrite(rewritten, f"batch norm from output: {count} batch norms", scheduled, touched)]
