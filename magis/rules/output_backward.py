"""An activation's backward from its output instead of its input: an operator choice
(MONeT, ICLR'22, §3, "output-activated" operators).

ReLU6 (``hardtanh(x, 0, 6)``) and leaky ReLU let autograd save their *input* for the
backward, while the gradient only asks where the input lies, which the output tells just as
well: ``y = clamp(x, lo, hi)`` is strictly inside ``(lo, hi)`` exactly where ``x`` is, and
``leaky_relu(x, s)`` with ``s > 0`` is positive exactly where ``x`` is (NaN stays NaN and
fails every comparison either way). Reading the output, which the next layer saves anyway,
frees the input: with ``inplace=True`` activations (torchvision's MobileNetV2) the captured
step even clones every batch-norm output for those backwards, a copy the rewrite removes.
The gradient is the same kernel's on the same decisions: equal bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from magis.ir.graph import Graph, Node, Ref
from magis.rules.rewrite import Rewrite, prune_dead

aten = torch.ops.aten

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
