"""In-place operators: an operator choice (MONeT, ICLR'22, §3 "operator optimizations").

MONeT chooses, per operator, among implementations that compute the same values but keep
different tensors alive. The simplest choice: an operator writes its result into an input's
storage when nothing else ever reads that input. The functional op holds input and output
at once; in place, one tensor. The values are the same kernel's, bit for bit. Three kinds:

- an activation (ReLU, hardtanh/ReLU6, leaky ReLU, ELU, SiLU, GELU, sigmoid, tanh,
  hardswish): the batch norm's output a ReLU follows (batch norm's backward reads its own
  input, ReLU's backward its output);
- a forward's elementwise sum, difference, product, quotient or multiply-add (``addcmul``),
  into its first argument, or into either argument of a sum or product (IEEE addition and
  multiplication do not depend on operand order): a residual connection's sum, the running
  sum of a weighted aggregation (RandWire's nodes, :mod:`magis.rules.multiply_add`);
- a matrix product accumulated into its first argument (``addmm``: the partial products of a
  partitioned convolution, :mod:`magis.rules.multiply_add`); BLAS reads and writes each
  element of it once, with ``beta = 1``;
- batch norm in eval mode (an inference plan's), through ``native_batch_norm.out`` with its
  input as ``out``: the convolution's output it normalises. The kernel reads and writes each
  element at the same index, with the functional op's arithmetic.

The captured graph is functional (AOTAutograd removes every in-place op), so the rule
turns ``aten.relu(x)`` into ``aten.relu_(x)``, whose output is ``x``'s storage (the IR's
alias) and which the IR knows writes ``x`` (:func:`magis.ir.graph.writes`, from the
schema's ``Tensor(a!)``). It applies only where that cannot change any value:

- ``x`` owns a whole storage that is neither resident (a weight, buffer, input) nor a
  graph output, laid out like the op's output (so a sum broadcasting ``x`` up never
  writes it);
- the op is the storage's only reader, through any view and through no other of its
  arguments (so no reader, before or after, sees the overwritten values; SiLU's and GELU's
  backward read their input, so in a training step those stay functional, as do
  activations of a saved input).

A recomputation of the op for a later reader would read ``x`` overwritten: the remat rule
refuses to recompute an op whose input a writer changed before (:mod:`magis.rules.remat`).
One rewrite applies every such choice at once: in place is never slower (the same
kernel) and never holds more memory, so there is nothing to trade per operator.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta, is_view, writes
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
#: ops elementwise in their first argument: their in-place twins (that argument written)
ELEMENTWISE_IN_PLACE = {
    aten.add.Tensor: aten.add_.Tensor,
    aten.mul.Tensor: aten.mul_.Tensor,
    aten.sub.Tensor: aten.sub_.Tensor,
    aten.div.Tensor: aten.div_.Tensor,
    aten.addcmul.default: aten.addcmul_.default,
    aten.addmm.default: aten.addmm_.default,
}
#: the binary ops whose arguments may swap: IEEE sums and products do not depend on operand order
COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor})
#: batch norm in eval mode, written into its input by ``native_batch_norm.out`` (a kernel of its own
#: that writes ``out``; the ``out=`` form of the captured op computes a new tensor and copies it)
EVAL_BATCH_NORM = aten._native_batch_norm_legit_no_training.default
EVAL_BATCH_NORM_INTO = aten.native_batch_norm.out


def storage_readers(graph: Graph) -> dict[tuple[str, int], set[str]]:
    """The nodes that read each storage, through any view (a view itself reads nothing; an
    in-place operator, whose result is its input's storage too, reads all its arguments)."""
    readers: dict[tuple[str, int], set[str]] = {}
    for node in graph.nodes:
        if is_view(node) and not writes(node):
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
    """Whether ``node`` may write its result (its first output) into ``source`` (module
    docstring): ``source`` owns a whole storage, laid out as the result, that is not resident,
    not ``held`` by an output, seen as laid out there (not through a transpose: the result would
    be a view of another layout than its storage's), and read by ``node`` alone (``readers``: :func:`storage_readers`;
    the operators that made ``source`` in place, which ran before it, aside),
    through no other of its arguments (an elementwise kernel reading a transposed view of what
    it writes would read values it already wrote)."""
    key, meta = graph.storages[source][0], graph[source].meta
    return not (
        key is None
        or len(graph[source].outputs) != 1
        or key[0] in graph.persistent
        or key in held
        or readers.get(key, set()) - _alias_chain(graph, source) != {node.name}
        or graph.storage_bytes[key] != meta.nbytes
        or meta != node.outputs[0]
        or any(key in graph.storages[other] for other in node.inputs if other != source)
        or graph[key[0]].outputs[key[1]] != meta  # a view laid out otherwise than its storage (a transpose)
    )


def _alias_chain(graph: Graph, name: str) -> set[str]:
    """``name`` and the nodes whose storage it shares, back to the one that allocated it (a
    batch norm written into its convolution's output: the item, the batch norm, the convolution)."""
    chain, element = {name}, 0
    while len(graph[name].aliases) > element and (alias := graph[name].aliases[element]) is not None:
        name, element = graph[name].inputs[alias[0]], alias[1]
        chain.add(name)
    return chain


def written_argument(
    graph: Graph, node: Node, readers: dict[tuple[str, int], set[str]], held: set[tuple[str, int]]
) -> int | None:
    """The position of the argument ``node`` may write its result into (an activation's input,
    either term of a sum or product, a batch norm's input), or ``None``."""
    if node.target in IN_PLACE or (node.target is EVAL_BATCH_NORM and isinstance(node.args[3], Ref)):
        positions: tuple[int, ...] = (0,)
    elif node.role is not Role.ACTIVATION:
        return None  # a backward's sums build gradients, which the step hands over in their weight's layout
    elif node.target in COMMUTATIVE and node.kwargs_dict().get("alpha", 1) == 1:
        positions = (0, 1)
    elif node.target in ELEMENTWISE_IN_PLACE:
        positions = (0,)
    else:
        return None
    return next(
        (
            position
            for position in positions
            if len(node.args) > position
            and isinstance(node.args[position], Ref)
            and overwritable(graph, node.args[position].name, node, readers, held)
        ),
        None,
    )


def in_place_candidates(graph: Graph) -> list[str]:
    """The operators of ``graph`` that may write into an input (module docstring), in node order."""
    readers, held = storage_readers(graph), output_storages(graph)
    return [node.name for node in graph.nodes if written_argument(graph, node, readers, held) is not None]


def in_place(graph: Graph, names: list[str]) -> Graph:
    """``graph`` with the operators ``names`` (from :func:`in_place_candidates`) run in place: each
    writes the argument :func:`written_argument` names and returns it (its output aliases it)."""
    readers, held = storage_readers(graph), output_storages(graph)
    chosen = set(names)
    nodes: list[Node] = []
    for node in graph.nodes:
        position = written_argument(graph, node, readers, held) if node.name in chosen else None
        if position is None:
            nodes.append(node)
        elif node.target is EVAL_BATCH_NORM:
            empties = [_empty(graph, f"{node.name}_statistic{i}", node.args[3], node) for i in (1, 2)]
            nodes.extend([*empties, _batch_norm_into_input(node, *(Ref(e.name) for e in empties))])
        elif node.target in ELEMENTWISE_IN_PLACE:
            args = node.args if position == 0 else (node.args[1], node.args[0], *node.args[2:])
            nodes.append(replace(node, target=ELEMENTWISE_IN_PLACE[node.target], args=args, aliases=((0, 0),)))
        else:
            nodes.append(replace(node, target=IN_PLACE[node.target], aliases=((0, 0),)))
    return Graph(tuple(nodes), graph.outputs, graph.signature, graph.order_edges)


def _empty(graph: Graph, name: str, like: Ref, node: Node) -> Node:
    """An empty tensor of the dtype of ``node``'s statistics, made from ``like`` (resident: no
    reader of an activation is added)."""
    dtype = node.outputs[1].dtype
    meta = TensorMeta((0,), dtype, 0, (1,))
    return Node(
        graph.fresh_name(name), aten.new_empty.default, (like, [0]), (("dtype", dtype),), (meta,), (None,), node.role
    )


def _batch_norm_into_input(node: Node, save_mean: Ref, save_invstd: Ref) -> Node:
    """An eval-mode batch norm run by ``native_batch_norm.out`` into its input. The kernel also
    writes the statistics it returns (left empty in eval mode) into ``save_mean`` and
    ``save_invstd``, two empty tensors of its own (shared, they would order every batch norm
    after every reader of another one's output: a node reads all of a node's elements)."""
    x, weight, bias, running_mean, running_var, momentum, eps = node.args
    into = replace(
        node,
        target=EVAL_BATCH_NORM_INTO,
        args=(x, weight, bias, running_mean, running_var, False, momentum, eps),
        kwargs=(("out", x), ("save_mean", save_mean), ("save_invstd", save_invstd)),
        outputs=(node.outputs[0], *(TensorMeta((0,), node.outputs[1].dtype, 0, (1,)) for _ in (1, 2))),
    )
    position = {name: i for i, name in enumerate(into.inputs)}
    return replace(into, aliases=tuple((position[ref.name], 0) for ref in (x, save_mean, save_invstd)))


def in_place_rewrites(graph: Graph) -> list[Rewrite]:
    """The M-Rule: every operator that can run in place, at once (module docstring)."""
    names = in_place_candidates(graph)
    if not names:
        return []
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return [Rewrite(in_place(graph, names), f"in place: {len(names)} operators ({shown})")]
