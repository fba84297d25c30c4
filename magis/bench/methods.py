"""The methods a benchmark compares, as a registry: magis and its peers, one code path for all.

Every method gives, for a workload at a preset (a :class:`Subject`), two things:

- ``real(subject, budget)``: a :class:`Runnable`, a
  :data:`~magis.bench.protocol.Step` that runs one training step for real and
  returns the loss and the gradients (checked against eager PyTorch's by
  :mod:`magis.bench.compare`), and the model whose weights it uses;
- ``simulate(subject, budget)``: the graph and operator order the method would run,
  for magis' simulator (peak memory) and cost model (latency).

Measured and simulated figures of one method therefore come from the same
configuration of it, and at tiny/small sizes they can be checked against each
other. Adding a method is one :func:`register` call. A ``budgeted`` method runs
once per memory budget (``compile@0.5``).

Peers (what a practitioner reaches for today):

- ``eager`` — plain PyTorch: forward, loss, ``backward()``. The reference.
- ``checkpoint-block`` — activation checkpointing of every block:
  transformers' ``gradient_checkpointing_enable()``, or ``torch.utils.checkpoint``
  around each block of other models (:mod:`magis.bench.checkpointing`).
- ``checkpoint-sqrt`` — √n segments of blocks, each checkpointed (Chen et al. 2016).
- ``compile`` — ``torch.compile``'s min-cut partitioner under
  ``torch._functorch.config.activation_memory_budget`` (:mod:`magis.frontend.partitioned`).

magis:

- ``magis-captured`` — the captured graph run by the magis runtime in captured order.
- ``magis-scheduled`` — the same graph in the memory-optimal order of :func:`magis.schedule.schedule`.
- ``magis-fission`` — the step made separable along its samples with one F-Tree node
  enabled (:func:`magis.search.single_fission.best_single_fission`): the fewest parts
  whose simulated peak is within ``budget`` times the scheduled peak (``magis-fission@0.5``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from magis.backend.eager import eager_step
from magis.backend.runtime import StepResult, lower, run_program
from magis.bench.checkpointing import checkpoint_every_block, checkpoint_sqrt_segments
from magis.bench.protocol import Step
from magis.frontend.capture import capture
from magis.frontend.checkpointed import capture_checkpointed
from magis.frontend.partitioned import (
    GraphRecorder,
    capture_partitioned,
    check_budget,
    compile_backend,
    memory_budget,
)
from magis.ir.graph import Graph
from magis.models import Built, build_workload
from magis.search.single_fission import SingleFission, choose_within, single_fission_options

#: what ``simulate`` returns: a graph and the order of its nodes the method runs
Simulated = tuple[Graph, Sequence[str]]

PEER = "peer"
MAGIS = "magis"


class MethodUnavailable(RuntimeError):
    """A registered method cannot run in this installation (the message says why)."""


@dataclass(eq=False)
class Subject:
    """One workload at one preset: what every method of a comparison works on.

    The model (real tensors, or fake ones for the paper preset), its captured graph
    and the memory-optimal order of it are made once and shared by the methods
    that need them; a method that changes the model works on its own
    :meth:`rebuild` (the same weights and inputs: builds are seeded).
    """

    workload: str
    preset: str
    batch: int | None = None
    seed: int = 0
    built: Built = field(init=False)

    def __post_init__(self) -> None:
        self.built = self.rebuild()

    def rebuild(self) -> Built:
        """A new build of the workload, identical to :attr:`built`."""
        return build_workload(self.workload, self.preset, self.batch, self.seed)

    @property
    def inputs(self) -> tuple:
        return tuple(self.built.example_inputs)

    @cached_property
    def graph(self) -> Graph:
        """The training step captured by :func:`magis.frontend.capture.capture`."""
        return capture(self.built.model, self.inputs, self.built.loss_fn)

    @cached_property
    def single_fissions(self) -> list[SingleFission]:
        """The scheduled step and each single fission of it (one enumeration for every budget)."""
        return single_fission_options(self.graph, self.scheduled_order)

    def single_fission(self, budget: float) -> SingleFission:
        """magis' best single fission within ``budget`` times the scheduled peak."""
        return choose_within(self.single_fissions, int(budget * self.single_fissions[0].peak_bytes))

    @cached_property
    def scheduled_order(self) -> tuple[str, ...]:
        """The captured graph's memory-optimal order (:func:`magis.schedule.schedule`)."""
        try:
            from magis.schedule import schedule
        except ImportError as err:
            raise MethodUnavailable(f"magis.schedule.schedule is not available ({err})") from err
        return tuple(schedule(self.graph).order)


@dataclass(frozen=True)
class Runnable:
    """A method's real step, and the build it runs: its weights, buffers and inputs are resident memory."""

    step: Step
    built: Built


@dataclass(frozen=True)
class Method:
    """A way to run a training step, for real and as a graph for the simulator."""

    name: str
    description: str
    kind: str  # PEER or MAGIS
    real: Callable[[Subject, float | None], Runnable]
    simulate: Callable[[Subject, float | None], Simulated]
    budgeted: bool = False  # runs once per activation memory budget


@dataclass(frozen=True)
class Variant:
    """A method at one budget (``None`` for a method without one): one row of a comparison."""

    method: Method
    budget: float | None = None

    @property
    def name(self) -> str:
        return self.method.name if self.budget is None else f"{self.method.name}@{self.budget:g}"


METHODS: dict[str, Method] = {}
REFERENCE = "eager"
DEFAULT_BUDGETS = (1.0, 0.5, 0.1)


def register(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (its name must be new)."""
    if method.name in METHODS:
        raise ValueError(f"a method called {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def variants(names: Sequence[str] | None = None, budgets: Sequence[float] = DEFAULT_BUDGETS) -> list[Variant]:
    """The variants to compare: ``names`` (default: every method), eager first, one per budget.

    Raises ValueError naming the valid choices for an unknown method or a budget
    outside ``(0, 1]``.
    """
    names = list(METHODS) if names is None else list(names)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    if not budgets:
        raise ValueError("give at least one activation memory budget")
    budgets = [check_budget(b) for b in budgets]
    ordered = [REFERENCE, *dict.fromkeys(n for n in names if n != REFERENCE)]
    out: list[Variant] = []
    for name in ordered:
        method = METHODS[name]
        out += [Variant(method, b) for b in budgets] if method.budgeted else [Variant(method)]
    return out


# --------------------------------------------------------------------- steps
def _eager(built: Built) -> Runnable:
    """An eager PyTorch step of ``built`` (the subject's build, or a changed rebuild)."""

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            return eager_step(built.model, built.example_inputs, built.loss_fn)

    return Runnable(step, built)


def _runtime(subject: Subject, order: Sequence[str], graph: Graph | None = None) -> Runnable:
    """``graph`` (default: the captured one) run by the magis runtime in ``order``."""
    program = lower(subject.graph if graph is None else graph, order)

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            return run_program(program, subject.built.model, subject.inputs)

    return Runnable(step, subject.built)


def _in_order(graph: Graph) -> Simulated:
    return graph, [n.name for n in graph.nodes]


# --------------------------------------------------------------------- peers
def _eager_real(subject: Subject, _budget: float | None) -> Runnable:
    return _eager(subject.built)


def _eager_simulate(subject: Subject, _budget: float | None) -> Simulated:
    return _in_order(subject.graph)


def _checkpointing(apply: Callable[[torch.nn.Module, tuple], Any]) -> tuple[Callable, Callable]:
    """``real`` and ``simulate`` of a checkpointing peer: ``apply(model, inputs)`` changes a rebuild."""

    def checkpointed(subject: Subject) -> Built:
        built = subject.rebuild()
        apply(built.model, tuple(built.example_inputs))
        return built

    def real(subject: Subject, _budget: float | None) -> Runnable:
        return _eager(checkpointed(subject))

    def simulate(subject: Subject, _budget: float | None) -> Simulated:
        built = checkpointed(subject)
        return _in_order(capture_checkpointed(built.model, built.example_inputs, built.loss_fn))

    return real, simulate


def _compile_real(subject: Subject, budget: float | None) -> Runnable:
    assert budget is not None
    recorder = GraphRecorder()
    compiled = torch.compile(subject.built.model, backend=compile_backend(recorder))

    def step(scope: AbstractContextManager) -> StepResult:
        recorder.scope, calls = scope, recorder.calls
        try:
            with memory_budget(budget):
                result = eager_step(compiled, subject.inputs, subject.built.loss_fn)
        finally:
            recorder.scope = None
        if recorder.calls == calls:
            raise RuntimeError("torch.compile ran the step eagerly: no compiled graph was called")
        grads = {name.removeprefix("_orig_mod."): g for name, g in result.gradients.items()}
        return StepResult(result.loss, grads, {})

    return Runnable(step, subject.built)


def _compile_simulate(subject: Subject, budget: float | None) -> Simulated:
    assert budget is not None
    return _in_order(capture_partitioned(subject.built.model, subject.inputs, subject.built.loss_fn, budget))


# --------------------------------------------------------------------- magis
def _captured_real(subject: Subject, _budget: float | None) -> Runnable:
    return _runtime(subject, [n.name for n in subject.graph.nodes])


def _scheduled_real(subject: Subject, _budget: float | None) -> Runnable:
    return _runtime(subject, subject.scheduled_order)


def _scheduled_simulate(subject: Subject, _budget: float | None) -> Simulated:
    return subject.graph, subject.scheduled_order


def _fission_real(subject: Subject, budget: float | None) -> Runnable:
    assert budget is not None
    chosen = subject.single_fission(budget)
    return _runtime(subject, chosen.order, chosen.graph)


def _fission_simulate(subject: Subject, budget: float | None) -> Simulated:
    assert budget is not None
    chosen = subject.single_fission(budget)
    return chosen.graph, chosen.order


register(Method("eager", "eager PyTorch: forward, loss, backward()", PEER, _eager_real, _eager_simulate))
register(
    Method(
        "checkpoint-block",
        "activation checkpointing of every block (transformers gradient_checkpointing_enable, torch.utils.checkpoint)",
        PEER,
        *_checkpointing(lambda model, _inputs: checkpoint_every_block(model)),
    )
)
register(
    Method(
        "checkpoint-sqrt",
        "checkpointing of sqrt(n) segments of blocks (Chen et al. 2016)",
        PEER,
        *_checkpointing(checkpoint_sqrt_segments),
    )
)
register(
    Method(
        "compile",
        "torch.compile's min-cut partitioner under activation_memory_budget",
        PEER,
        _compile_real,
        _compile_simulate,
        budgeted=True,
    )
)
register(Method("magis-captured", "magis runtime, captured order", MAGIS, _captured_real, _eager_simulate))
register(Method("magis-scheduled", "magis runtime, memory-optimal order", MAGIS, _scheduled_real, _scheduled_simulate))
register(
    Method(
        "magis-fission",
        "magis runtime, the step made separable with one fissioned region: fewest parts within budget x scheduled peak",
        MAGIS,
        _fission_real,
        _fission_simulate,
        budgeted=True,
    )
)
