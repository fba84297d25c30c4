"""AOTAutograd's joint fx graph of a training step, converted into :class:`magis.ir.Graph`.

The exported graph is functional (no in-place op is left, buffer updates are outputs);
this module reads each node's role off the export's signature, storage aliasing (views,
``getitem``) off the fake tensors in ``meta['val']``, so the simulator counts memory
exactly as the allocator does, and which ops draw random numbers, kept in their order.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from magis.frontend.step import CaptureError
from magis.ir.graph import Graph, Node, Ref, Role, Signature, TensorMeta


@dataclass(frozen=True, eq=False)
class Constant:
    """A tensor baked into the traced program (made inside ``forward``, e.g. ``torch.tensor(-inf)``)."""

    value: torch.Tensor
    __name__ = "constant"

    def __call__(self) -> torch.Tensor:
        return self.value


def _unprefix(name: str) -> str:
    return name.removeprefix("model.")


def graph_from_fx(gm: torch.fx.GraphModule, sig: Any) -> Graph:
    """Convert AOTAutograd's fx graph and its signature into a :class:`Graph`: a joint graph
    (its first user output the loss, the others what the step returns beside it: its
    ``results``), or a forward alone (``trace_joint=False``: its user outputs are the step's
    ``results``)."""
    joint = sig.backward_signature is not None
    signature = Signature(
        parameters={k: _unprefix(v) for k, v in sig.inputs_to_parameters.items()},
        buffers={k: _unprefix(v) for k, v in sig.inputs_to_buffers.items()},
        user_inputs=tuple(sig.user_inputs),
        loss=sig.user_outputs[0] if joint else "",
        gradients={_unprefix(p): n for n, p in sig.backward_signature.gradients_to_parameters.items()} if joint else {},
        buffer_updates={_unprefix(b): name for name, b in sig.buffers_to_mutate.items()},
        results=tuple(sig.user_outputs[1:] if joint else sig.user_outputs),
    )
    return graph_from_step_fx(gm, signature)


def graph_from_step_fx(gm: torch.fx.GraphModule, signature: Signature) -> Graph:
    """Convert a functional fx graph of a whole training step (or of an inference step) into a :class:`Graph`.

    ``gm`` holds forward, loss and backward, with fake values in ``meta['val']`` (see
    :func:`magis.frontend.capture.propagate_fake_values`); its outputs are the step's outputs. ``signature``
    names its parameter, buffer and user-input placeholders, the loss node, and the
    gradient and buffer-update nodes; node roles are read from it.
    """
    fx_nodes = list(gm.graph.nodes)
    output_node = fx_nodes[-1]
    assert output_node.op == "output"
    out_args = list(output_node.args[0])
    grads = signature.gradients
    updates = signature.buffer_updates
    loss = signature.loss
    # a forward alone (an inference step) is all forward
    loss_ancestors = {n.name for n in gm.graph.nodes} if signature.inference else _fx_ancestors(gm, loss)

    storage_owner: dict[StorageWeakRef, tuple[str, int]] = {}
    elements: dict[str, tuple[tuple[str, int] | None, ...]] = {}  # node -> root storage per element
    nodes: list[Node] = []
    for fn in fx_nodes[:-1]:
        if fn.op == "placeholder":
            target, args, kwargs = None, (), ()
            role = (
                Role.PARAMETER
                if fn.name in signature.parameters
                else Role.BUFFER
                if fn.name in signature.buffers
                else Role.INPUT
            )
        elif fn.op == "get_attr":
            target, args, kwargs, role = Constant(getattr(gm, fn.target)), (), (), Role.CONSTANT
        elif fn.op == "call_function":
            target = fn.target
            _check_supported(fn)
            args = _to_refs(fn.args)
            kwargs = tuple(sorted((k, _to_refs(v)) for k, v in fn.kwargs.items()))
            role = _role(fn.name, loss, loss_ancestors, grads, updates)
        else:
            raise CaptureError(f"unexpected fx node {fn.op} {fn.target} in the captured graph")
        val = fn.meta.get("val")
        tuple_output = isinstance(val, (tuple, list))
        vals = list(val) if tuple_output else [val]
        inputs = [n.name for n in fn.all_input_nodes]
        inputs = list(dict.fromkeys(inputs))
        metas: list[TensorMeta | None] = []
        aliases: list[tuple[int, int] | None] = []
        roots: list[tuple[str, int] | None] = []
        for e, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                if v is not None:
                    raise CaptureError(f"op {fn.target} returns a non-tensor value ({type(v).__name__})")
                metas.append(None)
                aliases.append(None)
                roots.append(None)
                continue
            key = StorageWeakRef(v.untyped_storage())
            metas.append(TensorMeta.of(v))
            root = storage_owner.get(key)
            if root is None:
                storage_owner[key] = (fn.name, e)
                aliases.append(None)
                roots.append((fn.name, e))
            else:
                aliases.append(_alias_position(root, inputs, elements, fn))
                roots.append(root)
        elements[fn.name] = tuple(roots)
        random = draws_random_numbers(target, fn.args, fn.kwargs)
        nodes.append(
            Node(
                name=fn.name,
                target=target,
                args=args,
                kwargs=kwargs,
                outputs=tuple(metas),
                aliases=tuple(aliases),
                role=role,
                random=random,
                tuple_output=tuple_output,
            )
        )

    outputs = tuple(a.name for a in out_args if isinstance(a, torch.fx.Node))
    nodes = _drop_dead(nodes, set(outputs))
    randoms = [n.name for n in nodes if n.random]
    order_edges = tuple(itertools.pairwise(randoms))
    return Graph(tuple(nodes), outputs, signature, order_edges)


def draws_random_numbers(target: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the op reads the random stream: it is tagged ``nondeterministic_seeded``,
    unless its randomness is a ``dropout_p`` argument that is zero (fused attention
    without dropout draws nothing, and so may be split or recomputed like any op)."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    dropout_p = args[position] if position < len(args) else kwargs.get("dropout_p", 0.0)
    return dropout_p != 0


def _alias_position(
    root: tuple[str, int],
    inputs: list[str],
    elements: dict[str, tuple[tuple[str, int] | None, ...]],
    fn: torch.fx.Node,
) -> tuple[int, int]:
    """The (input position, element) whose storage this view shares."""
    for pos, name in enumerate(inputs):
        for k, r in enumerate(elements[name]):
            if r == root:
                return (pos, k)
    raise CaptureError(f"{fn.name} ({fn.target}) aliases a tensor that is not one of its inputs")


def _check_supported(fn: torch.fx.Node) -> None:
    target = fn.target
    if target is operator.getitem:
        return
    if not isinstance(target, torch._ops.OpOverload):
        raise CaptureError(f"unsupported operation {target!r} in the captured graph (node {fn.name})")
    if target._schema.is_mutable:
        raise CaptureError(f"in-place op {target} survived functionalization (node {fn.name}); it cannot be reordered")


def _to_refs(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return Ref(value.name)
    if isinstance(value, tuple):
        return tuple(_to_refs(v) for v in value)
    if isinstance(value, list):
        return [_to_refs(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_refs(v) for k, v in value.items()}
    return value


def _fx_ancestors(gm: torch.fx.GraphModule, name: str) -> set[str]:
    by_name = {n.name: n for n in gm.graph.nodes}
    seen: set[str] = set()
    stack = [by_name[name]]
    while stack:
        n = stack.pop()
        if n.name not in seen:
            seen.add(n.name)
            stack.extend(n.all_input_nodes)
    return seen


def _role(name: str, loss: str, forward: set[str], grads: dict[str, str], updates: dict[str, str]) -> Role:
    if name == loss:
        return Role.LOSS
    if name in grads.values():
        return Role.GRADIENT
    if name in updates.values():
        return Role.BUFFER_UPDATE
    return Role.ACTIVATION if name in forward else Role.BACKWARD


def _drop_dead(nodes: list[Node], outputs: set[str]) -> list[Node]:
    """Remove pure nodes whose value nobody reads (AOTAutograd leaves some ``detach``)."""
    used: set[str] = set(outputs)
    keep: list[Node] = []
    for n in reversed(nodes):
        if n.name in used or n.is_input or n.random:
            keep.append(n)
            used.update(n.inputs)
    return keep[::-1]
