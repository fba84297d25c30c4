"""In-place activations: an operator choice (MONeT, ICLR'22, §3 "operator optimizations").

MONeT chooses, per operator, among implementations that compute the same values but keep
different tensors alive. The simplest choice: an activation (ReLU, hardtanh/ReLU6,
leaky ReLU, ELU, SiLU, GELU, sigmoid, tanh, hardswish) writes its result into its input's
storage when nothing else ever reads that input (the batch norm's output a ReLU follows:
batch norm's backward reads its own input, ReLU's backward its output). The functional op
holds input and output at once; in place, one tensor. The values are the same kernel's,
bit for bit.

The captured graph is functional (AOTAutograd removes every in-place op), so the rule
turns ``aten.relu(x)`` into ``aten.relu_(x)``, whose output is ``x``'s storage (the IR's
alias) and which the IR knows writes ``x`` (:func:`magis.ir.graph.writes`, from the
schema's ``Tensor(a!)``). It applies only where that cannot change any value:

- ``x`` owns a whole storage that is neither resident (a weight, buffer, input) nor a
  graph output, laid out like the op's output;
- the op is the storage's only reader, through any view (so no reader, before or after,
  sees the overwritten values; SiLU's and GELU's backward read their input, so in a
  training step those stay functional, as do activations of a saved input).

A recomputation of the op for a later reader would read ``x`` overwritten: the remat rule
refuses to recompute an op whose input a writer changed before (:mod:`magis.rules.remat`).
One rewrite applies every such choice at once: in place is never slower (the same
kernel) and never holds more memory, so there is nothing to trade per operator.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from magis.ir.graph import Graph, Node, Ref, is_view
from magis.rules.rewrite import Rewrite

aten = torch.ops.aten

#: each activation's in-place twin (same arguments, first one written)
IN_PLACE = {
    aten.relu.default: aten.relu_.default,
    aten.hardtanh.default: aten.hardtanh_.default,
    aten.leaky_relu.default: aten.leaky_relu_.default,
    aten.elu.default: aten.elu_.default,
    aten.silu.default: aten.silu_.default,
    aten.gelu.default: aten.gelu_.default,
    aten.sigmoid.default: aten.sigmoid_.default,
    aten.tanh.default: aten.tanh_.default,
    aten.hardswish.default: aten.hardswish_.default,
}


def storage_readers(graph: Graph) -> dict[tuple[str, int], set[str]]:
    """The nodes that read each storage, through any view (a view itself reads nothing)."""
    readers: dict[tuple[str, int], set[str]] = {}
    for node in graph.nodes:
        if is_view(node):
            continue
        for name in node.inputs:
            for key in graph.storages[name]:
                if key is not None:
                    readers.setdefault(key, set()).add(node.name)
    return readers


def output_storages(graph: Graph) -> set[tuple[str, int]]:
    """The storages ``graph``'s outputs hold (never written over)."""
    return {key for name in graph.outputs for key in graph.storages[name] if key is not None}


def overwritable(
    graph: Graph, source: str, node: Node, readers: dict[tuple[str, int], set[str]], held: set[tuple[str, int]]
) -> bool:
    """Whether ``node`` may write its result into ``source`` (module docstring): ``source`` owns a
    whole storage, laid out as the result, that is not resident, not ``held`` by an output, and
    read by ``node`` alone (``readers``: :func:`storage_readers`)."""
    key, meta = graph.storages[source][0], graph[source].meta
    return not (
        key is None
        or len(graph[source].outputs) != 1
        or key[0] in graph.persistent
        or key in held
        or readers.get(key) != {node.name}
        or graph.storage_bytes[key] != meta.nbytes
        or meta != node.meta
    )


def in_place_candidates(graph: Graph) -> list[str]:
    """The activations of ``graph`` that may write into their input (module docstring), in node order."""
    readers, held = storage_readers(graph), output_storages(graph)
    return [
        node.name
        for node in graph.nodes
        if node.target in IN_PLACE
        and node.args
        and isinstance(node.args[0], Ref)
        and overwritable(graph, node.args[0].name, node, readers, held)
    ]


def in_place(graph: Graph, names: list[str]) -> Graph:
    """``graph`` with the activations ``names`` (from :func:`in_place_candidates`) run in place:
    each writes its first argument and returns it (its output aliases input 0)."""
    chosen = set(names)
    nodes = tuple(
        replace(node, target=IN_PLACE[node.target], aliases=((0, 0),)) if node.name in chosen else node
        for node in graph.nodes
    )
    return Graph(nodes, graph.outputs, graph.signature, graph.order_edges)


def in_place_rewrites(graph: Graph) -> list[Rewrite]:
    """The M-Rule: every activation that can run in place, at once (module docstring)."""
    names = in_place_candidates(graph)
    if not names:
        return []
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return [Rewrite(in_place(graph, names), f"in place: {len(names)} activations ({shown})")]
