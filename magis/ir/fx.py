"""Turn a :class:`~magis.ir.Graph` and a schedule back into runnable torch.fx code.

The result is an ordinary ``torch.fx.GraphModule`` whose ``forward`` takes the
graph's inputs (in ``graph.inputs`` order) and returns ``graph.outputs``; fx's code
generator drops every value after its last use, so the generated code frees
memory as the magis runtime does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx

from magis.ir.graph import Graph, Ref, map_refs


def to_fx(graph: Graph, order: Sequence[str] | None = None) -> torch.fx.GraphModule:
    """An fx ``GraphModule`` running ``graph``'s nodes in ``order`` (default: node order)."""
    order = list(order) if order is not None else [n.name for n in graph.nodes]
    graph.check_schedule(order)
    fx_graph = torch.fx.Graph()
    values: dict[str, torch.fx.Node] = {}
    for name in graph.inputs:
        values[name] = fx_graph.placeholder(name)

    def lookup(ref: Ref) -> torch.fx.Node:
        return values[ref.name]

    for name in order:
        node = graph[name]
        if node.is_input:
            continue
        args = map_refs(node.args, lookup)
        kwargs = map_refs(dict(node.kwargs), lookup)
        values[name] = fx_graph.call_function(node.target, tuple(args), kwargs)
        values[name].name = name
    fx_graph.output(tuple(values[o] for o in graph.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), fx_graph)
