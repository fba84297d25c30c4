"""Gradient accumulation, the peer most users try first: k micro-batches, gradients summed in ``.grad``.

A step of batch B becomes k steps of batch B/k, each ``backward()`` of its mean loss
times 1/k (transformers' ``Trainer`` with ``gradient_accumulation_steps = k``), run
for real by :func:`magis.backend.eager.eager_step`. For the simulator,
:func:`accumulated_graph` strings together k copies of one micro-batch's captured
step (plain, checkpointed or partitioned by ``torch.compile``) the way eager PyTorch
runs them: the full batch is resident and each micro-batch's inputs are views of it;
the first micro-batch's gradients become the ``.grad`` tensors, alive to the end,
and each later one is added into them in place (``AccumulateGrad``) and freed;
batch-norm statistics carry from one micro-batch to the next.

The result is the full batch's gradient only when every micro-batch's mean is over
equally many terms and nothing else ties the samples together.
:func:`gradient_differences` names what breaks that in a step: training-mode batch
norm (statistics of B/k samples), dropout (masks drawn per micro-batch: another
sample of the same distribution, not the full batch's masks), and a mean loss over
labels of which some are ignored (``ignore_index``, masked-token losses) in uneven
numbers per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from magis.analysis.axes import bind
from magis.backend.eager import split_batch
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta, map_refs
from magis.rules.separable import NLL_LOSSES

aten = torch.ops.aten
_MEAN = 1  # torch's Reduction enum


def accumulated_graph(
    micro: Graph, order: Sequence[str], micro_batches: int, together: bool = False
) -> tuple[Graph, tuple[str, ...]]:
    """``micro_batches`` copies of the micro-batch step ``micro`` (run in ``order``) as one graph, and its order.

    Copy ``i``'s nodes are named ``mb<i>/<name>``; parameters and buffers are shared,
    user inputs become the full batch (resident) sliced per copy. A gradient is added
    into ``.grad`` right after it is made (autograd's ``AccumulateGrad``), or, with
    ``together``, once the copy's last node ran (a compiled backward returns every
    gradient at once). Raises ValueError for ``micro_batches`` below 1.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches}")
    micro.check_schedule(order)
    sums = _Sums()
    nodes = _batch_inputs(micro, micro_batches)
    edges: list[tuple[str, str]] = []
    for i in range(micro_batches):
        nodes += _micro_batch_inputs(micro, i)
        nodes += _copy(micro, order, i, sums, together)
        edges += _copy_edges(micro, order, i)
        sums.carry_buffers(micro, i)
    graph = _summed(micro, nodes, edges, sums, micro_batches - 1)
    return graph, tuple(n.name for n in graph.nodes)


@dataclass
class _Sums:
    """What the copies so far left: the node holding each parameter's ``.grad``, the loss summed
    over them, and each buffer's latest value (batch-norm statistics carry to the next copy)."""

    gradients: dict[str, str] = field(default_factory=dict)  # parameter -> node holding its .grad so far
    loss: str = ""
    buffers: dict[str, str] = field(default_factory=dict)  # buffer input node -> its latest value

    def add_gradient(self, param: str, gradient: str, outputs: tuple, i: int) -> list[Node]:
        """Copy ``i``'s ``gradient`` of ``param`` into ``.grad``: the first copy's is ``.grad``, a later
        one is added into it in place (``AccumulateGrad``); the node that adds, if any."""
        if i == 0:
            self.gradients[param] = gradient
            return []
        add = Node(
            f"mb{i}/grad/{param}",
            aten.add_.Tensor,
            (Ref(self.gradients[param]), Ref(gradient)),
            outputs=outputs,
            aliases=((0, 0),),
            role=Role.GRADIENT,
        )
        self.gradients[param] = add.name
        return [add]

    def add_loss(self, loss: Node, i: int) -> list[Node]:
        """Copy ``i``'s ``loss`` into the total reported; the node that adds, if any."""
        if i == 0:
            self.loss = loss.name
            return []
        total = Node(
            f"mb{i}/loss_total",
            aten.add.Tensor,
            (Ref(self.loss), Ref(loss.name)),
            outputs=loss.outputs,
            aliases=(None,),
            role=Role.LOSS,
        )
        self.loss = total.name
        return [total]

    def carry_buffers(self, micro: Graph, i: int) -> None:
        """The buffers copy ``i`` updates are what the next copy reads."""
        sig = micro.signature
        buffer_inputs = {bname: node for node, bname in sig.buffers.items()}
        for bname, node in sig.buffer_updates.items():
            self.buffers[buffer_inputs[bname]] = f"mb{i}/{node}"


def _batch_inputs(micro: Graph, micro_batches: int) -> list[Node]:
    """The inputs every copy shares: parameters and buffers as they are, user inputs as the full batch."""
    users = set(micro.signature.user_inputs)
    shared = [n for n in micro.nodes if n.is_input and n.name not in users]
    return [*shared, *(_whole_batch(micro[name], micro_batches) for name in micro.signature.user_inputs)]


def _micro_batch_inputs(micro: Graph, i: int) -> list[Node]:
    """Copy ``i``'s user inputs: views of the ``i``-th slice of the full batch."""
    nodes = []
    for name in micro.signature.user_inputs:
        meta = micro[name].meta
        size = meta.shape[0]
        nodes.append(
            Node(
                f"mb{i}/{name}",
                aten.slice.Tensor,
                (Ref(name), 0, i * size, (i + 1) * size),
                outputs=(meta,),
                aliases=((0, 0),),
                role=Role.ACTIVATION,
            )
        )
    return nodes


def _copy(micro: Graph, order: Sequence[str], i: int, sums: _Sums, together: bool) -> list[Node]:
    """Copy ``i`` of the step's nodes in ``order``, reading its own inputs and the buffers' latest values;
    each gradient is added into ``.grad`` right after it (``together``: after the copy's last node)
    and the loss into the total."""
    sig = micro.signature
    params = _parameter_of(micro)
    users = set(sig.user_inputs)

    def ren(ref: Ref) -> Ref:
        name = ref.name
        if name not in users and micro[name].is_input:
            return Ref(sums.buffers.get(name, name))
        return Ref(f"mb{i}/{name}")

    nodes: list[Node] = []
    pending: list[Node] = []
    for name in order:
        node = micro[name]
        if node.is_input:
            continue
        copy = replace(node, name=f"mb{i}/{name}", args=map_refs(node.args, ren), kwargs=map_refs(node.kwargs, ren))
        if name in params and i > 0 and node.target is aten.clone.default:
            # the copy into the parameter's layout (capture's gradients_laid_out_as_parameters) is
            # the first micro-batch's alone: eager adds a later one into .grad as it is
            (pending if together else nodes).extend(sums.add_gradient(params[name], copy.args[0].name, node.outputs, i))
            continue
        nodes.append(copy)
        if name in params:
            (pending if together else nodes).extend(sums.add_gradient(params[name], copy.name, copy.outputs, i))
        if name == sig.loss:
            nodes += sums.add_loss(copy, i)
    return nodes + pending


def _copy_edges(micro: Graph, order: Sequence[str], i: int) -> list[tuple[str, str]]:
    """The step's order edges within copy ``i``, and, after the first, the random stream carried
    from the previous copy: the micro-batches draw from one random stream, one after another."""
    edges = [(f"mb{i}/{a}", f"mb{i}/{b}") for a, b in micro.order_edges]
    randoms = [name for name in order if micro[name].random]
    if i and randoms:
        edges.append((f"mb{i - 1}/{randoms[-1]}", f"mb{i}/{randoms[0]}"))
    return edges


def _summed(micro: Graph, nodes: list[Node], edges: list[tuple[str, str]], sums: _Sums, last: int) -> Graph:
    """The copies as one step: its loss the total, its gradients the ``.grad`` sums, its buffers
    the last copy's; the other outputs the last copy's."""
    sig = micro.signature
    final = {sig.loss: sums.loss, **{node: sums.gradients[param] for node, param in _parameter_of(micro).items()}}
    outputs = tuple(final.get(name, f"mb{last}/{name}") for name in micro.outputs)
    signature = replace(
        sig,
        loss=sums.loss,
        gradients=dict(sums.gradients),
        buffer_updates={bname: f"mb{last}/{node}" for bname, node in sig.buffer_updates.items()},
    )
    return Graph(tuple(nodes), outputs, signature, tuple(edges))


def _parameter_of(micro: Graph) -> dict[str, str]:
    """The parameter each gradient node of ``micro`` is the gradient of."""
    return {node: param for param, node in micro.signature.gradients.items()}


def _whole_batch(node: Node, micro_batches: int) -> Node:
    """The full-batch input whose micro-batches are ``node``'s shape."""
    meta = node.meta
    shape = (meta.shape[0] * micro_batches, *meta.shape[1:])
    return replace(node, outputs=(TensorMeta(shape, meta.dtype, meta.nbytes * micro_batches, meta.strides),))


def gradient_differences(graph: Graph, example_inputs: Sequence[Any], micro_batches: int) -> str | None:
    """Why ``micro_batches``-way accumulation of the step ``graph`` (captured on ``example_inputs``,
    the full batch) does not give the full batch's gradient; ``None`` when it does."""
    if micro_batches == 1:
        return None
    reasons = []
    if any(_training_batch_norm(n) for n in graph.nodes):
        reasons.append("batch norm normalises each micro-batch by its own statistics")
    if any(n.random for n in graph.nodes):
        reasons.append("dropout draws other masks per micro-batch")
    ignored = {bind(n)["ignore_index"] for n in graph.nodes if n.target in NLL_LOSSES and bind(n)["reduction"] == _MEAN}
    counts = _label_counts(example_inputs, ignored, micro_batches)
    if counts is not None:
        reasons.append(f"the mean loss is over {'/'.join(map(str, counts))} labels per micro-batch, not equally many")
    return "; ".join(reasons) or None


def _training_batch_norm(node: Node) -> bool:
    name = node.op_name
    if "batch_norm" not in name or "backward" in name or "no_training" in name:
        return False
    return bool(bind(node).get("training", True))


def _label_counts(example_inputs: Sequence[Any], ignored: set[int], micro_batches: int) -> list[int] | None:
    """Labels counted per micro-batch in the first integer input holding an ignored label, when uneven."""
    for chunks in zip(*split_batch(example_inputs, micro_batches)):
        first = chunks[0]
        if not isinstance(first, torch.Tensor) or first.is_floating_point() or is_fake(first):
            continue
        for ignore in ignored:
            counts = [int((c != ignore).sum()) for c in chunks]
            if len(set(counts)) > 1:
                return counts
    return None
