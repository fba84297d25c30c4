"""Run a graph's training step (or inference step) on real tensors in a given schedule.

The graph is lowered for the schedule (:mod:`magis.backend.program`) and run as
generated code (:mod:`magis.backend.codegen`, the default) or by the interpreter
(:mod:`magis.backend.interpreter`). Parameters, buffers and inputs are bound by name
from the user's module; the step returns the loss, every parameter gradient and the
new buffer values (which it can write back, as an eager step mutates BatchNorm
statistics in place).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from magis.backend.codegen import generate
from magis.backend.interpreter import execute
from magis.backend.program import Program, lower
from magis.frontend.optimizer import bound_optimizer_inputs
from magis.ir.graph import Graph, Node, Ref, map_refs

#: how a program runs: ``generated`` Python (:mod:`magis.backend.codegen`) or ``interpreted``
#: instruction by instruction (:mod:`magis.backend.interpreter`, slower)
Runtime = Literal["generated", "interpreted"]
RUNTIMES: tuple[Runtime, ...] = ("generated", "interpreted")
#: a program's step made once and run on each call's bound ``env``, adding the graph's outputs
#: to it: a :class:`~magis.backend.codegen.GeneratedStep`, or one replayed as a CUDA graph
#: (:class:`~magis.backend.cuda_graph.CudaGraphStep`)
StepRunner = Callable[[dict[str, Any]], dict[str, Any]]


#: a batch norm's backward taken from its output divides by the weight (``Signature.divided_by``,
#: :mod:`magis.rules.output_backward`), magnifying the output's rounding ``|bias / weight|`` times:
#: the step runs while every channel's ``|bias| < DIVISOR_RATIO * |weight|`` (a zero weight never)
DIVISOR_RATIO = 1024.0


class RuntimeBindError(ValueError):
    """The module or inputs do not match the captured graph."""


class DivisorError(RuntimeBindError):
    """A weight the step divides by breaks the bound the step holds under (:data:`DIVISOR_RATIO`)."""


@dataclass
class StepResult:
    """What a step returns: a training step's loss and gradients, or an inference step's
    ``outputs`` (its graph's ``signature.results``; ``loss`` is None); new buffer values."""

    loss: torch.Tensor | None
    gradients: dict[str, torch.Tensor]
    buffer_updates: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...] = ()


def module_tensors(model: torch.nn.Module, names: Sequence[tuple[str, str]]) -> list[torch.Tensor | None]:
    """For each ``(qualified_name, kind)`` of ``names``, the parameter
    (``kind="_parameters"``) or buffer (``"_buffers"``) that the name spells in
    ``model`` (any of a tied tensor's names, as ``named_parameters`` spells them), or None.

    Each submodule on the names' paths is looked up once, from its parent, instead of
    walking every submodule: binding runs at every step, and a step binds far fewer
    tensors than a large model has modules."""
    modules: dict[str, torch.nn.Module | None] = {"": model}

    def submodule(path: str) -> torch.nn.Module | None:
        if path not in modules:
            parent_path, _, part = path.rpartition(".")
            parent = submodule(parent_path)
            modules[path] = None if parent is None else parent._modules.get(part)
        return modules[path]

    found: list[torch.Tensor | None] = []
    for name, kind in names:
        path, _, leaf = name.rpartition(".")
        holder = submodule(path)
        found.append(None if holder is None else getattr(holder, kind).get(leaf))
    return found


def bind(
    graph: Graph, model: torch.nn.Module, example_inputs: Sequence[Any], optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """The graph's input nodes bound to the module's tensors, the user inputs and, for a graph
    that holds the optimizer's update, ``optimizer`` and its states (:mod:`magis.frontend.optimizer`)."""
    sig = graph.signature
    wanted = [(node, name, "_parameters") for node, name in sig.parameters.items()]
    wanted += [(node, name, "_buffers") for node, name in sig.buffers.items()]
    env: dict[str, Any] = {}
    for (node, name, kind), tensor in zip(wanted, module_tensors(model, [(name, kind) for _, name, kind in wanted])):
        what = "parameter" if kind == "_parameters" else "buffer"
        if tensor is None:
            raise RuntimeBindError(f"the module has no {what} {name!r} that the graph was captured with")
        meta = graph[node].outputs[0]
        if meta is not None and (tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape):
            raise RuntimeBindError(
                f"{what} {name!r} is {tensor.dtype} of shape {tuple(tensor.shape)}; the graph was captured with "
                f"{meta.dtype} of shape {meta.shape} (the model was cast or resized since): optimize again"
            )
        env[node] = tensor.detach()
    flat = [x for x in example_inputs]
    if len(flat) != len(sig.user_inputs):
        raise RuntimeBindError(f"the graph takes {len(sig.user_inputs)} inputs, got {len(flat)}")
    for node, value in zip(sig.user_inputs, flat):
        meta = graph[node].outputs[0]
        if isinstance(value, torch.Tensor) and meta is not None and tuple(value.shape) != meta.shape:
            raise RuntimeBindError(
                f"input {node} has shape {tuple(value.shape)}, the graph was captured with {meta.shape}"
            )
        env[node] = value.detach() if isinstance(value, torch.Tensor) else value
    env.update(bound_optimizer_inputs(graph, model, optimizer))
    broken = broken_divisor(graph, env)
    if broken is not None:
        raise DivisorError(broken)
    return env


def broken_divisor(graph: Graph, tensors: dict[str, torch.Tensor]) -> str | None:
    """Why the weights the step divides by (``graph.signature.divided_by``), bound by node in
    ``tensors``, break :data:`DIVISOR_RATIO`, naming the first; None where none does (one
    device synchronisation for them all)."""
    pairs = graph.signature.divided_by
    if not pairs:
        return None
    within = [(tensors[bias].abs() < DIVISOR_RATIO * tensors[weight].abs()).all() for weight, bias in pairs]
    if bool(torch.stack(within).all()):
        return None
    weight, bias = pairs[[bool(w) for w in within].index(False)]
    w, b = tensors[weight].detach(), tensors[bias].detach()
    channel = int((b.abs() >= DIVISOR_RATIO * w.abs()).nonzero()[0, 0])
    name = graph.signature.parameters.get(weight, weight)
    return (
        f"the plan takes the backward of the batch norm whose weight is {name!r} from its output "
        f"(MONeT's choice for batch norm before ReLU), dividing by that weight, which holds while every "
        f"channel's |bias| < {DIVISOR_RATIO:g} x |weight|: channel {channel} has weight {float(w[channel]):.3g} "
        f"and bias {float(b[channel]):.3g} now. Plan the step again: magis.optimize leaves this choice "
        "out where the weights break it (magis.planned does so by itself)"
    )


def bind_arguments(node: Node, value: Callable[[str], Any], device: torch.device) -> tuple[tuple, dict[str, Any]]:
    """The node's ``args, kwargs`` with every :class:`Ref` replaced by ``value(name)``
    and every device argument (of factory ops) by ``device``."""

    def resolve(ref: Ref) -> Any:
        return value(ref.name)

    def place(x: Any) -> Any:  # aten schemas take a device only as a whole argument
        return device if isinstance(x, torch.device) else x

    args = tuple(place(a) for a in map_refs(node.args, resolve))
    kwargs = {k: place(v) for k, v in map_refs(node.kwargs_dict(), resolve).items()}
    return args, kwargs


def run_step(
    graph: Graph,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    order: Sequence[str] | None = None,
    apply_buffer_updates: bool = True,
    runtime: Runtime | StepRunner = "generated",
) -> StepResult:
    """Run one training step of ``graph`` on ``model``'s tensors in ``order`` (``runtime``: as
    :func:`run_program` says; a generated step must be of this graph in this order)."""
    program = lower(graph, order)
    return run_program(program, model, example_inputs, apply_buffer_updates, runtime=runtime)


def run_program(
    program: Program,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    apply_buffer_updates: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    runtime: Runtime | StepRunner = "generated",
) -> StepResult:
    """Run an already lowered program (see :func:`lower`); ``optimizer`` is the one whose
    update the graph holds, if it holds one. ``runtime`` names how it runs, or is the
    program's step made once (:data:`StepRunner`) by the caller who runs it many times."""
    graph = program.graph
    env = bind(graph, model, example_inputs, optimizer)
    if callable(runtime):
        runtime(env)
    elif runtime == "interpreted":
        execute(program, env)
    elif runtime == "generated":
        generate(program)(env)
    else:
        raise ValueError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    sig = graph.signature
    result = StepResult(
        loss=None if sig.inference else env[sig.loss],
        gradients={p: env[n] for p, n in sig.gradients.items()},
        buffer_updates={b: env[n] for b, n in sig.buffer_updates.items()},
        outputs=tuple(env[n] for n in sig.results),
    )
    if apply_buffer_updates and result.buffer_updates:
        buffers = dict(model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, new in result.buffer_updates.items():
                buffers[name].copy_(new)
    return result
