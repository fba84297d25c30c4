"""torch.compile's min-cut partitioner as a peer: its forward and backward graphs as one :class:`Graph`.

``torch.compile`` traces the joint forward+backward graph with AOTAutograd and
splits it with ``min_cut_rematerialization_partition``: the forward saves some
tensors for the backward and the backward recomputes the rest. The knob
``torch._functorch.config.activation_memory_budget`` (in ``(0, 1]``, default 1)
trades the two. Its documentation (``torch/_functorch/config.py``): 1.0 is the
activation memory of the default, runtime-optimised strategy (which recomputes
only cheap fusible ops), 0.0 that of checkpointing the whole compiled region, and
in between the partitioner "solves a 0-1 knapsack to find the minimum recompute
necessary to stay below the activation memory budget", with run time estimated
from FLOPs. Recomputation in the backward is Chen et al. 2016's idea.

This module holds what the real run (``torch.compile`` with :func:`compile_backend`)
and the simulation (:func:`capture_partitioned`, on fake tensors) share: the same
AOTAutograd settings and partitioner, and a compiler that records the graphs it is
given and runs them as the ``aot_eager`` backend does (``boxed_nop``: the boxed
calling convention lets each graph free its inputs after their last use).

Three choices, all to keep the peer computing eager PyTorch's step:

- No decomposition table. ``aot_eager_decomp_partition`` adds inductor's
  decompositions, which turn ``native_dropout`` into ``rand_like`` + compare: the
  random stream then differs from eager's and the gradients could not be checked
  against it. The partitioner is the same; it sees aten ops as eager runs them.
- Buffer mutations stay in the forward graph (``keep_inference_input_mutations``, as
  inductor does). Otherwise AOTAutograd writes BatchNorm statistics back after the
  forward, and under a budget below 1 the partitioner may save those very buffers
  for the backward, which then fails autograd's version check.
- Random ops are never recomputed (see :func:`partition`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.fx
from functorch.compile import aot_function, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from magis.frontend.capture import (
    CaptureError,
    LossFn,
    default_loss,
    explain_capture_failure,
    propagate_fake_values,
)
from magis.frontend.fx_graph import graph_from_step_fx
from magis.ir.graph import Graph, Signature

aten = torch.ops.aten


def partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> tuple:
    """The partitioner torch.compile uses for training graphs, random ops always saved.

    ``min_cut_rematerialization_partition`` as ``aot_eager_decomp_partition`` calls it.
    Under a budget below 1 its knapsack may recompute ``native_dropout`` in the
    backward; without CUDA's functionalized RNG that draws a new mask and the
    gradients are wrong. Random ops are marked ``MUST_SAVE`` (what the partitioner
    does by itself at budget 1), so the peer computes the same step as eager.
    """
    for node in joint.graph.nodes:
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)


def check_budget(budget: float) -> float:
    """``budget`` if it is a valid ``activation_memory_budget``, else a ValueError saying why."""
    if not isinstance(budget, (int, float)) or not 0.0 < float(budget) <= 1.0:
        raise ValueError(f"an activation memory budget must be in (0, 1], got {budget!r}")
    return float(budget)


@contextlib.contextmanager
def memory_budget(budget: float) -> Iterator[None]:
    """Partition under ``torch._functorch.config.activation_memory_budget = budget``."""
    with torch._functorch.config.patch(activation_memory_budget=check_budget(budget)):
        yield


class GraphRecorder:
    """An AOTAutograd forward/backward compiler that keeps each fx graph and runs it eagerly.

    ``graphs`` lists the graphs in the order they were compiled (forward, then
    backward once it first runs); ``calls`` counts the compiled graphs run so far.
    While ``scope`` is set, every graph runs inside it: a ``TorchDispatchMode`` meter
    cannot wrap a whole compiled step (dynamo runs eager code under an active
    dispatch mode), but it can wrap each compiled graph.
    """

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.calls = 0
        self.scope: AbstractContextManager | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
        self.graphs.append(gm)
        run = boxed_nop(gm, list(example_inputs))

        def boxed(args: list) -> Any:
            self.calls += 1
            with self.scope or contextlib.nullcontext():
                return run(args)

        boxed._boxed_call = True  # type: ignore[attr-defined]
        return boxed


def compile_backend(recorder: GraphRecorder) -> Callable:
    """A ``torch.compile`` backend: AOTAutograd, the min-cut partitioner, graphs run by ``recorder``.

    The budget is read when a graph is partitioned: compile under :func:`memory_budget`.
    """
    return aot_autograd(
        fw_compiler=recorder, bw_compiler=recorder, partition_fn=partition, keep_inference_input_mutations=True
    )


def capture_partitioned(
    model: torch.nn.Module, example_inputs: Sequence[Any], loss_fn: LossFn | None = None, budget: float = 1.0
) -> Graph:
    """The training step as ``torch.compile`` partitions it under ``budget``, as one :class:`Graph`.

    Traces ``loss_fn(model(*example_inputs))`` with AOTAutograd on fake tensors (real
    weights are not touched), with the settings of :func:`compile_backend`, and
    stitches the forward and backward graphs together: forward first, the tensors it
    saves flowing into the backward, the loss's gradient seeded with ones as
    ``loss.backward()`` does. Outputs: loss, gradients, buffer updates.
    """
    check_budget(budget)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    tensors = [*params.values(), *buffers.values(), *example_inputs]
    mode = detect_fake_mode(tensors) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [_fake(mode, t) for t in tensors]
    names = [*params, *buffers]

    def step(*args: Any) -> torch.Tensor:
        state = dict(zip(names, args))
        output = torch.func.functional_call(model, state, tuple(args[len(names) :]))
        return default_loss(output) if loss_fn is None else loss_fn(output)

    recorder = GraphRecorder()
    compiled = aot_function(
        step, fw_compiler=recorder, bw_compiler=recorder, partition_fn=partition, keep_inference_input_mutations=True
    )
    try:
        with memory_budget(budget):
            compiled(*fakes).backward()
    except Exception as err:
        raise CaptureError(explain_capture_failure(err)) from err
    if len(recorder.graphs) != 2:
        raise CaptureError(f"expected one forward and one backward graph, AOTAutograd made {len(recorder.graphs)}")
    forward, backward = recorder.graphs
    return stitch(forward, backward, list(params), list(buffers))


def _fake(mode: FakeTensorMode, value: Any) -> Any:
    """``value`` as a fake tensor of ``mode`` (unchanged if it is one already or not a tensor)."""
    if isinstance(value, torch.Tensor) and detect_fake_mode([value]) is None:
        return mode.from_tensor(value)
    return value


def stitch(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, parameters: list[str], buffers: list[str]
) -> Graph:
    """One :class:`Graph` from AOTAutograd's partitioned forward and backward graphs.

    The forward's placeholders are the parameters, then the buffers, then the user
    inputs (named by ``parameters`` and ``buffers``); its first output is the loss,
    the others are saved for the backward, whose placeholders carry the same names.
    A forward ``copy_`` into a buffer (a kept input mutation) becomes that buffer's
    update output. The backward's tangent is ``ones_like(loss)``; its outputs are one
    gradient (or ``None``) per forward placeholder.
    """
    root = torch.nn.Module()  # holds the constants the graphs read (get_attr)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}  # forward or backward node -> stitched node
    constants = itertools.count()

    def copy(node: torch.fx.Node, source: torch.fx.GraphModule) -> torch.fx.Node:
        if node.op != "get_attr":
            return graph.node_copy(node, env.__getitem__)
        name = f"constant_{next(constants)}"  # the two graphs may use the same attribute names
        setattr(root, name, getattr(source, node.target))
        new = graph.get_attr(name)
        new.meta = dict(node.meta)
        return new

    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    n_params, n_state = len(parameters), len(parameters) + len(buffers)
    updates: dict[str, torch.fx.Node] = {}
    forward_outputs: Sequence[Any] = ()
    for node in forward.graph.nodes:
        if node.op == "output":
            forward_outputs = node.args[0]
        elif node.target is aten.copy_.default and node.args[0] in placeholders[n_params:n_state]:
            updates[buffers[placeholders.index(node.args[0]) - n_params]] = env[node.args[1]]
        else:
            env[node] = copy(node, forward)
    loss = env[forward_outputs[0]]
    saved = {n.name: env[n] for n in forward_outputs[1:]}
    tangent = graph.call_function(aten.ones_like.default, (loss,))
    gradients: Sequence[Any] = ()
    for node in backward.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                env[node] = tangent
            elif node.name in saved:
                env[node] = saved[node.name]
            else:
                raise CaptureError(f"the backward reads {node.name}, which the forward does not save")
        elif node.op == "output":
            gradients = node.args[0]
        else:
            env[node] = copy(node, backward)
    if len(gradients) != len(placeholders):
        raise CaptureError(f"the backward returns {len(gradients)} gradients for {len(placeholders)} inputs")
    grads = {name: env[g] for name, g in zip(parameters, gradients) if g is not None}
    graph.output((loss, *grads.values(), *updates.values()))
    gm = torch.fx.GraphModule(root, graph)
    propagate_fake_values(gm)
    inputs = [env[p].name for p in placeholders]
    signature = Signature(
        parameters=dict(zip(inputs, parameters)),
        buffers=dict(zip(inputs[n_params:], buffers)),
        user_inputs=tuple(inputs[n_state:]),
        loss=loss.name,
        gradients={name: node.name for name, node in grads.items()},
        buffer_updates={name: node.name for name, node in updates.items()},
    )
    return graph_from_step_fx(gm, signature)
