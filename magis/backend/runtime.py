"""Execute a graph on real tensors in a given schedule.

The interpreter runs the nodes in the schedule's order and drops its reference to
every value right after the value's last reader ran, so memory follows the
simulator's timeline (:mod:`magis.cost.memory`). Swap transfers (Store and Load,
:mod:`magis.backend.transfer`) run on a side stream on CUDA, each reader of a
loaded tensor waiting for its copy; on a CPU they run in place. Parameters, buffers and inputs
are bound by name from the user's module; the step returns the loss, every
parameter gradient and the new buffer values (which it can write back, as an
eager step mutates BatchNorm statistics in place).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from magis.backend.transfer import Load, Store, TransferStreams
from magis.frontend.optimizer import bound_optimizer_inputs
from magis.ir.graph import Graph, Node, Ref, is_view, map_refs


class RuntimeBindError(ValueError):
    """The module or inputs do not match the captured graph."""


@dataclass(frozen=True)
class Instruction:
    """One step: run ``node`` then forget the values in ``free``; on CUDA, first wait for
    the copies of the Loads in ``waits`` (whose tensors the node reads)."""

    node: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    free: tuple[str, ...]
    waits: tuple[str, ...] = ()


@dataclass(frozen=True)
class Program:
    """A graph lowered to a straight-line list of instructions for one schedule."""

    graph: Graph
    order: tuple[str, ...]
    instructions: tuple[Instruction, ...]

    @property
    def swaps(self) -> bool:
        """Whether the program moves tensors to and from host memory."""
        return any(isinstance(ins.fn, (Store, Load)) for ins in self.instructions)


@dataclass
class StepResult:
    """What a training step returns."""

    loss: torch.Tensor
    gradients: dict[str, torch.Tensor]
    buffer_updates: dict[str, torch.Tensor]


def lower(graph: Graph, order: Sequence[str] | None = None) -> Program:
    """Lower ``graph`` in ``order`` (default: its node order) to a :class:`Program`."""
    order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
    graph.check_schedule(order)
    pos = {name: i for i, name in enumerate(order)}
    keep = set(graph.outputs) | set(graph.inputs)
    last_use: dict[str, int] = {}
    for name in order:
        for p in graph[name].inputs:
            last_use[p] = max(last_use.get(p, -1), pos[name])
    frees: dict[int, list[str]] = {}
    for name in order:
        if name in keep:
            continue
        frees.setdefault(last_use.get(name, pos[name]), []).append(name)
    loads = {n.name for n in graph.nodes if isinstance(n.target, Load)}
    instructions = []
    for i, name in enumerate(order):
        node = graph[name]
        if node.is_input:
            continue
        waits = ()
        if loads and not is_view(node):  # a view launches nothing: its readers wait instead
            waits = tuple(sorted({k[0] for p in node.inputs for k in graph.storages[p] if k and k[0] in loads}))
        fn = _owning_its_result(node.target) if node.target in _REDUCED_IN_PLACE else node.target
        instructions.append(Instruction(name, fn, node.args, dict(node.kwargs), tuple(frees.get(i, ())), waits))
    return Program(graph, order, tuple(instructions))


#: Loss kernels whose reduced result keeps the storage of the elementwise loss they reduced in
#: place: on CPU (torch 2.13) ``mse_loss`` of two 128x64 float64 tensors returns a 0-dim tensor
#: on 65,536 bytes, held as long as the loss is. The simulator counts the result's own bytes.
_REDUCED_IN_PLACE = frozenset(
    {
        torch.ops.aten.mse_loss.default,
        torch.ops.aten.smooth_l1_loss.default,
        torch.ops.aten.binary_cross_entropy.default,
        torch.ops.aten.soft_margin_loss.default,
    }
)


def _owning_its_result(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel``, its result copied out of a storage larger than itself (the copy is a few
    bytes; the storage it frees is the size of the loss's input)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out = kernel(*args, **kwargs)
        return out.clone() if out.untyped_storage().nbytes() > out.nbytes else out

    return run


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
        if tensor is None:
            what = "parameter" if kind == "_parameters" else "buffer"
            raise RuntimeBindError(f"the module has no {what} {name!r} that the graph was captured with")
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
    return env


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


def execute(
    program: Program,
    env: dict[str, Any],
    seconds: list[float] | None = None,
    emit: Callable[[str, Any], None] | None = None,
) -> dict[str, Any]:
    """Run the instructions; ``env`` holds the bound inputs and receives the outputs.

    With ``seconds``, the wall time of each instruction (mapping its arguments, the
    call, freeing what died) is appended to it: the in-step profile of
    :func:`magis.cost.op_timing.measure_in_step`. With ``emit``, each value is handed
    to ``emit(node, value)`` as soon as it is made, before what died is freed (a
    fissioned region merges a part's results as they come).
    """

    def value(ref: Ref) -> Any:
        return env[ref.name]

    streams = _transfer_streams(program, env)
    clock = time.perf_counter
    with torch.no_grad():
        for ins in program.instructions:
            if seconds is not None:
                start = clock()
            args = map_refs(ins.args, value)
            kwargs = map_refs(ins.kwargs, value) if ins.kwargs else {}
            if streams is None:
                env[ins.node] = ins.fn(*args, **kwargs)
            elif isinstance(ins.fn, (Store, Load)):
                env[ins.node] = streams.run(ins.node, ins.fn, *args)
            else:
                streams.wait_for(ins.waits)
                env[ins.node] = ins.fn(*args, **kwargs)
            del args, kwargs
            if emit is not None:
                emit(ins.node, env[ins.node])
            for name in ins.free:
                del env[name]
            if seconds is not None:
                seconds.append(clock() - start)
        if streams is not None:
            streams.finish()
    return env


def _transfer_streams(program: Program, env: dict[str, Any]) -> TransferStreams | None:
    """A side stream for the swaps of a program that runs on CUDA, else ``None``."""
    if not program.swaps:
        return None
    device = next((v.device for v in env.values() if isinstance(v, torch.Tensor) and v.is_cuda), None)
    return None if device is None else TransferStreams(device)


def run_step(
    graph: Graph,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    order: Sequence[str] | None = None,
    apply_buffer_updates: bool = True,
) -> StepResult:
    """Run one training step of ``graph`` on ``model``'s tensors in ``order``."""
    program = lower(graph, order)
    return run_program(program, model, example_inputs, apply_buffer_updates)


def run_program(
    program: Program,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    apply_buffer_updates: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
) -> StepResult:
    """Run an already lowered program (see :func:`lower`); ``optimizer`` is the one whose
    update the graph holds, if it holds one."""
    graph = program.graph
    env = execute(program, bind(graph, model, example_inputs, optimizer))
    sig = graph.signature
    result = StepResult(
        loss=env[sig.loss],
        gradients={p: env[n] for p, n in sig.gradients.items()},
        buffer_updates={b: env[n] for b, n in sig.buffer_updates.items()},
    )
    if apply_buffer_updates and result.buffer_updates:
        buffers = dict(model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, new in result.buffer_updates.items():
                buffers[name].copy_(new)
    return result
