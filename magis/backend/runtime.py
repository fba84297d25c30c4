"""Run a graph's training step (or inference step) on real tensors in a given schedule.

The graph is lowered for the schedule (:mod:`magis.backend.program`) and run as
generated code (:mod:`magis.backend.codegen`, the default) or by the interpreter
(:mod:`magis.backend.interpreter`). Parameters, buffers and inputs are bound by name
from the user's module; the step returns the loss, every parameter gradient and the
new buffer values (which it can write back, as an eager step mutates BatchNorm
statistics in place).
"""

from __future__ import annotations

import operator
import types
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


class ModuleTensors:
    """The tensors that ``names`` (``(qualified_name, kind)``: ``kind="_parameters"`` or
    ``"_buffers"``) spell in ``model``, any of a tied tensor's names as ``named_parameters``
    spells them; None where a name spells none.

    Binding runs at every step: the submodules on the names' paths are looked up once (each
    from its parent), and each call (:meth:`current`) checks by identity that each is still
    its parent's, looking them up again where one was replaced, then reads every tensor from
    its holder's dict (a parameter set anew is read anew). RandWire's 624 tensors in 503
    submodules took 1 ms a call to look up name by name, of a 17 ms forward."""

    def __init__(self, model: torch.nn.Module, names: Sequence[tuple[str, str]]) -> None:
        self.model = model
        self.names = tuple(names)
        self._look_up()

    def _look_up(self) -> None:
        modules: dict[str, torch.nn.Module | None] = {"": self.model}
        links: list[tuple[torch.nn.Module, str, torch.nn.Module | None]] = []  # parent, name there, child

        def submodule(path: str) -> torch.nn.Module | None:
            if path not in modules:
                parent_path, _, part = path.rpartition(".")
                parent = submodule(parent_path)
                modules[path] = None if parent is None else parent._modules.get(part)
                if parent is not None:
                    links.append((parent, part, modules[path]))
            return modules[path]

        holders = [submodule(name.rpartition(".")[0]) for name, _ in self.names]
        self._links = tuple(zip(*links)) if links else ((), (), ())
        self._holders = [_NOWHERE if holder is None else holder for holder in holders]
        self._kinds = [kind for _, kind in self.names]
        self._leaves = [name.rpartition(".")[2] for name, _ in self.names]

    def current(self) -> list[torch.Tensor | None]:
        """Each name's tensor now."""
        parents, parts, children = self._links
        if not all(map(operator.is_, map(dict.get, map(_SUBMODULES, parents), parts), children)):
            self._look_up()
        return list(map(dict.get, map(getattr, self._holders, self._kinds), self._leaves))


_SUBMODULES = operator.attrgetter("_modules")
#: where a name whose submodule is missing looks for its tensor
_NOWHERE = types.SimpleNamespace(_parameters={}, _buffers={})
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


class ModuleInputs:
    """A graph's parameter and buffer inputs bound to a model's tensors, made once for a model a
    plan runs again and again (:class:`ModuleTensors`): each call checks every tensor's dtype
    and shape against the graph's in one pass, naming the first that differs."""

    def __init__(self, graph: Graph, model: torch.nn.Module) -> None:
        sig = graph.signature
        self.graph = graph
        self.nodes = (*sig.parameters, *sig.buffers)
        kinds = ["_parameters"] * len(sig.parameters) + ["_buffers"] * len(sig.buffers)
        self.tensors = ModuleTensors(model, list(zip([*sig.parameters.values(), *sig.buffers.values()], kinds)))
        metas = [graph[node].outputs[0] for node in self.nodes]
        self._dtypes = [None if meta is None else meta.dtype for meta in metas]
        self._shapes = [None if meta is None else meta.shape for meta in metas]

    def bound(self) -> dict[str, torch.Tensor]:
        """The input nodes bound to the module's tensors now (detached)."""
        found = self.tensors.current()
        try:
            fits = list(map(_DTYPE, found)) == self._dtypes and list(map(_SHAPE, found)) == self._shapes
        except AttributeError:  # a name that spells no tensor
            fits = False
        if not fits:
            self._refuse(found)
        return dict(zip(self.nodes, map(torch.Tensor.detach, found)))

    def buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers that the graph reads (every buffer a step updates), by name, now."""
        return {
            name: tensor
            for (name, kind), tensor in zip(self.tensors.names, self.tensors.current())
            if kind == "_buffers"
        }

    @staticmethod
    def of(graph: Graph, model: torch.nn.Module, found: ModuleInputs | None) -> ModuleInputs:
        """``found`` where it binds ``graph`` to ``model``, else those inputs found anew."""
        if found is None or found.graph is not graph or found.tensors.model is not model:
            return ModuleInputs(graph, model)
        return found

    def _refuse(self, found: list[torch.Tensor | None]) -> None:
        """Raise :class:`RuntimeBindError` for the first tensor missing or unlike the graph's."""
        for node, (name, kind), tensor in zip(self.nodes, self.tensors.names, found):
            what = "parameter" if kind == "_parameters" else "buffer"
            if tensor is None:
                raise RuntimeBindError(f"the module has no {what} {name!r} that the graph was captured with")
            meta = self.graph[node].outputs[0]
            if meta is not None and (tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape):
                raise RuntimeBindError(
                    f"{what} {name!r} is {tensor.dtype} of shape {tuple(tensor.shape)}; the graph was captured with "
                    f"{meta.dtype} of shape {meta.shape} (the model was cast or resized since): optimize again"
                )


def bind(
    graph: Graph,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    optimizer: torch.optim.Optimizer | None = None,
    module_inputs: ModuleInputs | None = None,
) -> dict[str, Any]:
    """The graph's input nodes bound to the module's tensors, the user inputs and, for a graph
    that holds the optimizer's update, ``optimizer`` and its states (:mod:`magis.frontend.optimizer`).
    ``module_inputs``: the graph's parameters and buffers found in ``model`` before, by a
    caller that binds it at every step (found here where not given, or made for another)."""
    sig = graph.signature
    env: dict[str, Any] = ModuleInputs.of(graph, model, module_inputs).bound()
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
    module_inputs: ModuleInputs | None = None,
) -> StepResult:
    """Run an already lowered program (see :func:`lower`); ``optimizer`` is the one whose
    update the graph holds, if it holds one. ``runtime`` names how it runs, or is the
    program's step made once (:data:`StepRunner`) by the caller who runs it many times, as
    ``module_inputs`` are the program's parameters and buffers found in ``model`` (:func:`bind`)."""
    graph = program.graph
    module_inputs = ModuleInputs.of(graph, model, module_inputs)
    env = bind(graph, model, example_inputs, optimizer, module_inputs)
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
        buffers = module_inputs.buffers()  # not named_buffers(): a walk of every module at every step
        with torch.no_grad():
            for name, new in result.buffer_updates.items():
                buffers[name].copy_(new)
    return result
