"""What the magis runtime spends beyond the operators' own times, measured once per
machine (MAGIS §5: the simulator prices the step the runtime runs).

Each instruction of the generated step (:mod:`magis.backend.codegen`) stores its result
and frees what died; a ``getitem`` picks an element, which no operator profile times;
and each step binds its inputs to the module's tensors. On a CPU binding is the
larger part.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from magis.backend.codegen import generate
from magis.backend.program import lower
from magis.backend.runtime import ModuleInputs, bind
from magis.cost.op_timing import synchronizer
from magis.ir.graph import Graph, Node, Ref, Role, Signature, TensorMeta

#: instructions of the program that measures the runtime's own costs, and how many
#: times it runs (the fastest run counts).
OVERHEAD_PROGRAM_OPS = 64
OVERHEAD_ROUNDS = 30


@dataclass(frozen=True)
class RuntimeCosts:
    """What the generated step (:mod:`magis.backend.codegen`) spends beyond the operators'
    profiled times: ``instruction_s`` per instruction (storing the result, freeing the
    values that died), ``getitem_s`` per ``getitem`` instruction (picking the element,
    which no profile times),
    and what binding the step's inputs costs (:func:`magis.backend.runtime.bind`):
    ``lookup_s`` per submodule on the way to a parameter or buffer (checked to be its
    parent's still), ``input_s`` per input bound (:func:`binding_seconds`)."""

    instruction_s: float
    getitem_s: float
    lookup_s: float
    input_s: float


def lookup_steps(signature: Signature) -> int:
    """How many submodules binding checks on the way to the step's parameters and buffers
    (:class:`magis.backend.runtime.ModuleTensors`): every module path that leads to
    one of them, the root left out."""
    paths: set[str] = set()
    for name in (*signature.parameters.values(), *signature.buffers.values()):
        parts = name.split(".")[:-1]
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return len(paths)


def binding_seconds(graph: Graph, costs: RuntimeCosts) -> float:
    """Seconds a step spends binding ``graph``'s inputs to the module's tensors and the user's inputs."""
    inputs = sum(1 for node in graph.nodes if node.is_input)
    return costs.lookup_s * lookup_steps(graph.signature) + costs.input_s * inputs


def _block_seconds(fn: Callable[[], Any], device: torch.device, rounds: int) -> float:
    """Fastest of ``rounds`` timed runs of ``fn`` (after one warm-up run)."""
    sync = synchronizer(device)
    fn()
    runs = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - start)
    return min(runs)


def measure_runtime_costs(device: torch.device, rounds: int = OVERHEAD_ROUNDS) -> RuntimeCosts:
    """The runtime's own costs on ``device``, measured in a few milliseconds.

    A program of :data:`OVERHEAD_PROGRAM_OPS` ``neg`` instructions on one element, each
    result freed by the next, runs as generated code; the same calls run in a plain loop,
    as the profiler calls an operator; the difference per instruction (never below zero)
    is ``instruction_s``. A plain loop of subscripts gives ``getitem_s``. Binding ``n`` parameters one
    submodule deep, then two deep, gives ``lookup_s`` and ``input_s`` (two equations,
    two unknowns). Each is the fastest of ``rounds`` runs: a busy
    moment only slows some runs down.
    """
    n = OVERHEAD_PROGRAM_OPS
    one = TensorMeta((1,), torch.float32, 4)
    nodes = [Node("x", None, outputs=(one,), aliases=(None,), role=Role.INPUT)]
    for i in range(n):
        previous = Ref(nodes[-1].name)
        nodes.append(Node(f"neg{i}", torch.ops.aten.neg.default, (previous,), outputs=(one,), aliases=(None,)))
    step = generate(lower(Graph(tuple(nodes), outputs=(nodes[-1].name,))))
    x, pair = torch.ones(1, device=device), (None, None)
    neg_args = (x,)  # built once, as the profiler's calls are

    def calls() -> None:
        for _ in range(n):
            torch.ops.aten.neg.default(*neg_args)

    def getitems() -> None:
        for _ in range(n):
            pair[1]

    def binding(depth: int) -> Callable[[], Any]:
        """Binding ``n`` parameters, each held ``depth`` submodules deep."""
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # initialising draws
            layers: list[torch.nn.Module] = [torch.nn.Linear(1, 1, bias=False, device=device) for _ in range(n)]
        for _ in range(depth - 1):
            layers = [torch.nn.Sequential(layer) for layer in layers]
        holder = torch.nn.Sequential(*layers)
        names = [name for name, _ in holder.named_parameters()]
        weight = TensorMeta((1, 1), torch.float32, 4)  # a Linear(1, 1)'s, as binding checks
        weights = tuple(Node(f"p{i}", None, outputs=(weight,), aliases=(None,), role=Role.INPUT) for i in range(n))
        graph = Graph(weights, outputs=(), signature=Signature(parameters={w.name: p for w, p in zip(weights, names)}))
        found = ModuleInputs(graph, holder)  # as a plan finds its model's tensors once
        return lambda: bind(graph, holder, (), module_inputs=found)

    with torch.no_grad():
        runtime_s = _block_seconds(lambda: step({"x": x}), device, rounds)
        calls_s = _block_seconds(calls, device, rounds)
        getitem_s = _block_seconds(getitems, device, rounds)
        one_deep_s = _block_seconds(binding(depth=1), device, rounds)
        two_deep_s = _block_seconds(binding(depth=2), device, rounds)
    lookup_s = max(0.0, (two_deep_s - one_deep_s) / n)
    return RuntimeCosts(
        instruction_s=max(0.0, (runtime_s - calls_s) / n),
        getitem_s=getitem_s / n,
        lookup_s=lookup_s,
        input_s=max(0.0, one_deep_s / n - lookup_s),
    )
