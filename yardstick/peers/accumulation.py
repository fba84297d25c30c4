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
from dataclasses import replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from magis.analysis.dim_rules import bind
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
    sig = micro.signature
    users = set(sig.user_inputs)
    shared = [n for n in micro.nodes if n.is_input and n.name not in users]
    full = [_whole_batch(micro[name], micro_batches) for name in sig.user_inputs]
    nodes: list[Node] = [*shared, *full]
    grad_nodes = {node: param for param, node in sig.gradients.items()}
    accumulated: dict[str, str] = {}  # parameter -> node holding its .grad so far
    updates: dict[str, str] = {}  # buffer input node -> its latest value
    buffer_inputs = {bname: node for node, bname in sig.buffers.items()}
    loss_total = ""
    edges: list[tuple[str, str]] = []
    randoms = [name for name in order if micro[name].random]
    for i in range(micro_batches):

        def name_in_copy(name: str, i: int = i) -> str:
            if name in users:
                return f"mb{i}/{name}"
            if micro[name].is_input:
                return updates.get(name, name)
            return f"mb{i}/{name}"

        def ren(ref: Ref) -> Ref:
            return Ref(name_in_copy(ref.name))

        for k, name in enumerate(sig.user_inputs):
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
            assert full[k].name == name
        pending: list[Node] = []
        for name in order:
            node = micro[name]
            if node.is_input:
                continue
            copy = replace(node, name=f"mb{i}/{name}", args=map_refs(node.args, ren), kwargs=map_refs(node.kwargs, ren))
            nodes.append(copy)
            param = grad_nodes.get(name)
            if param is not None:
                if i == 0:
                    accumulated[param] = copy.name
                else:  # .grad += this micro-batch's gradient, in place
                    acc = Node(
                        f"mb{i}/grad/{param}",
                        aten.add_.Tensor,
                        (Ref(accumulated[param]), Ref(copy.name)),
                        outputs=copy.outputs,
                        aliases=((0, 0),),
                        role=Role.GRADIENT,
                    )
                    (pending if together else nodes).append(acc)
                    accumulated[param] = acc.name
            if name == sig.loss:
                if i == 0:
                    loss_total = copy.name
                else:
                    total = Node(
                        f"mb{i}/loss_total",
                        aten.add.Tensor,
                        (Ref(loss_total), Ref(copy.name)),
                        outputs=copy.outputs,
                        aliases=(None,),
                        role=Role.LOSS,
                    )
                    nodes.append(total)
                    loss_total = total.name
        nodes += pending
        edges += [(f"mb{i}/{a}", f"mb{i}/{b}") for a, b in micro.order_edges]
        if i and randoms:  # the micro-batches draw from one random stream, one after another
            edges.append((f"mb{i - 1}/{randoms[-1]}", f"mb{i}/{randoms[0]}"))
        for bname, node in sig.buffer_updates.items():
            updates[buffer_inputs[bname]] = f"mb{i}/{node}"
    last = micro_batches - 1
    final = {
        sig.loss: loss_total,
        **{node: accumulated[param] for node, param in grad_nodes.items()},
    }
    outputs = tuple(final.get(name, f"mb{last}/{name}") for name in micro.outputs)
    signature = replace(
        sig,
        loss=loss_total,
        gradients=dict(accumulated),
        buffer_updates={bname: f"mb{last}/{node}" for bname, node in sig.buffer_updates.items()},
    )
    graph = Graph(tuple(nodes), outputs, signature, tuple(edges))
    return graph, tuple(n.name for n in graph.nodes)


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
