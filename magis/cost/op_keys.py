"""What decides an operator's latency, as a stable text key (MAGIS §5: the per-op profile).

The profiled cost model times each distinct operator application once: op overload,
input shapes, dtypes and strides, constant arguments, output shapes (:func:`op_key`).
The IR records shapes only, so strides are replayed on meta tensors
(:func:`replay_strides`). On a CPU an operator's time inside its step also depends on
the model around it (:func:`step_context`, :func:`in_step_key`).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping
from typing import Any

import torch

from magis.backend.runtime import bind_arguments
from magis.ir.graph import Graph, Node, Signature, is_view

#: strides of each output element of a node (``None`` for a missing optional output).
Strides = tuple[int, ...]
NodeStrides = tuple[Strides | None, ...]


def measurable(node: Node) -> bool:
    """An aten operator that can be run and timed on its own."""
    return isinstance(node.target, torch._ops.OpOverload)


def contiguous_strides(shape: tuple[int, ...]) -> Strides:
    """Row-major strides of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def is_row_major(shape: tuple[int, ...], strides: Strides) -> bool:
    """Row-major, ignoring the stride of size-1 dimensions (it never matters)."""
    return all(s == c for size, s, c in zip(shape, strides, contiguous_strides(shape)) if size != 1)


def replay_strides(graph: Graph, every_op: bool = False) -> dict[str, NodeStrides]:
    """The strides of every output element, replaying the graph's views on meta tensors.

    The IR records shapes only, but strides decide how fast an op runs (a transposed
    operand, a broadcast with stride 0). Views and ``getitem`` are replayed on meta
    tensors (cheap: their meta kernels are native); every other operator is taken to
    write contiguous outputs, as nearly all aten kernels do on contiguous inputs
    (running them on meta would go through Python decompositions, ~1 ms each), unless
    ``every_op``: then each runs on meta too, for the layouts the step's values really
    have (an elementwise op keeps a transposed input's layout), which code compiled for a
    segment's inputs must be tried on (BTLM small: a segment tried on contiguous inputs
    ran 8% faster compiled, and 5% slower on the step's own).
    """
    meta = torch.device("meta")
    values: dict[str, Any] = {}
    strides: dict[str, NodeStrides] = {}
    for node in graph.nodes:
        value = None
        if node.target is operator.getitem or (measurable(node) and (every_op or is_view(node))):
            try:
                args, kwargs = bind_arguments(node, values.__getitem__, meta)
                value = node.target(*args, **kwargs)
            except Exception:  # a view without a meta kernel: assume contiguous
                value = None
        elements = list(value) if isinstance(value, (tuple, list)) else [value]
        if len(elements) != len(node.outputs) or not all(
            isinstance(v, torch.Tensor) and tuple(v.shape) == m.shape
            for v, m in zip(elements, node.outputs)
            if m is not None
        ):
            elements = [None if m is None else torch.empty(m.shape, dtype=m.dtype, device=meta) for m in node.outputs]
        values[node.name] = tuple(elements) if node.tuple_output or not elements else elements[0]
        strides[node.name] = tuple(None if v is None else tuple(v.stride()) for v in elements)
    return strides


def op_key(graph: Graph, name: str, strides: Mapping[str, NodeStrides]) -> str:
    """A stable text key for one operator application: what decides its latency.

    Op overload, each input's shape, dtype and (when not contiguous) strides, the
    constant arguments, and the output shapes; never node names.
    """
    node = graph[name]

    def describe(input_name: str) -> str:
        parts = []
        for meta, stride in zip(graph[input_name].outputs, strides[input_name]):
            if meta is None:
                parts.append("None")
                continue
            layout = "" if is_row_major(meta.shape, stride) else f"@{list(stride)}"
            parts.append(f"{str(meta.dtype).removeprefix('torch.')}{list(meta.shape)}{layout}")
        return "T(" + ",".join(parts) + ")"

    args, kwargs = bind_arguments(node, describe, torch.device("cpu"))
    outputs = [None if m is None else (str(m.dtype).removeprefix("torch."), list(m.shape)) for m in node.outputs]
    return f"{node.op_name}{args!r}{sorted(kwargs.items())!r}->{outputs!r}"


def step_context(signature: Signature) -> str:
    """Which model a step trains, as a short digest of its parameters' and buffers' names.

    An operator's time inside a step depends on the step around it (what its
    neighbours left in the caches): the same convolution timed inside U-Net++ and
    inside U-Net differs by 5-10% on a CPU. Every graph of one model (its captured
    step, fission variants, rewrites) shares the context; other models have their own.
    """
    names = "\n".join(sorted((*signature.parameters.values(), *signature.buffers.values())))
    return hashlib.sha1(names.encode()).hexdigest()[:12]


def node_key(graph: Graph, name: str, keys: Mapping[str, str]) -> str | None:
    """A node's key in any step: its op key (``keys``), or for a ``getitem`` the element
    it picks of an operator with an op key; ``None`` for anything else."""
    node = graph[name]
    if node.target is operator.getitem and node.inputs and node.inputs[0] in keys:
        return f"getitem{list(node.args[1:])!r} of {keys[node.inputs[0]]}"
    return keys.get(name)


def in_step_key(graph: Graph, name: str, keys: Mapping[str, str], context: str) -> str | None:
    """The key of a node's time in its step: :func:`node_key` inside the model ``context``
    (:func:`step_context`)."""
    key = node_key(graph, name, keys)
    return None if key is None else f"{context}: {key}"
