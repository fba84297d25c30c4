"""Turn a :class:`~magis.ir.Graph` and a schedule back into runnable torch.fx code.

The result is an ordinary ``torch.fx.GraphModule`` whose ``forward`` takes the
graph's inputs (in ``graph.inputs`` order) and returns ``graph.outputs``; fx's code
generator drops every value after its last use, so the generated code frees
memory as the magis runtime does.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx

from magis.ir.graph import Graph, Ref, map_refs


def to_fx(graph: Graph, order: Sequence[str] | None = None) -> torch.fx.GraphModule:
    """An fx ``GraphModule`` running ``graph``'s nodes in ``order`` (default: node order)."""
    order = list(order) if order is not None else [n.name for n in graph.nodes]
    graph.check_schedule(order)
    calls = [(name, graph[name].target, graph[name].args, graph[name].kwargs_dict()) for name in order]
    return fx_module([call for call in calls if call[1] is not None], graph.inputs, graph.outputs)


def fx_module(
    calls: Iterable[tuple[str, Any, tuple, dict[str, Any]]],
    inputs: Sequence[str],
    outputs: Sequence[str],
    boxed: bool = False,
) -> torch.fx.GraphModule:
    """An fx ``GraphModule`` whose ``forward`` takes ``inputs`` and makes each ``(name, target,
    args, kwargs)`` of ``calls`` in turn (a :class:`Ref` in the arguments reads the input or the
    call of that name), returning the values named in ``outputs``. ``boxed``: it takes the
    inputs as one list, which a compiler may empty to free each input after its last use
    (the placeholder is marked ``steal_arg``, as compiled autograd marks its own)."""
    fx_graph = torch.fx.Graph()
    if boxed:
        box = fx_graph.placeholder("args")
        box.meta["steal_arg"] = True
        values = {name: fx_graph.call_function(operator.getitem, (box, i)) for i, name in enumerate(inputs)}
    else:
        values = {name: fx_graph.placeholder(name) for name in inputs}

    def lookup(ref: Ref) -> torch.fx.Node:
        return values[ref.name]

    for name, target, args, kwargs in calls:
        values[name] = fx_graph.call_function(target, tuple(map_refs(args, lookup)), map_refs(kwargs, lookup))
        values[name].name = name
    fx_graph.output(tuple(values[o] for o in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), fx_graph)
