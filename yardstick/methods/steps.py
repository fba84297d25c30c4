"""What the families of methods build their steps from: an eager PyTorch step, a magis-runtime step,
and a traced step's graph for the simulator, each over the subject's micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from magis.backend.codegen import runs_compiled_code
from magis.backend.eager import eager_step
from magis.backend.program import lower
from magis.backend.runtime import StepResult, run_program
from magis.frontend.capture import CaptureError, LossFn
from magis.ir.graph import Graph
from magis.models import Built
from magis.plan import PlanRuntime, generated_step
from yardstick.methods.method_registry import MethodUnavailable, Runnable, Simulated
from yardstick.methods.subject import Subject
from yardstick.peers.accumulation import accumulated_graph, gradient_differences


def eager_runnable(built: Built, subject: Subject, model: torch.nn.Module | None = None) -> Runnable:
    """An eager PyTorch step of ``built`` (the subject's build, or a changed rebuild) over the
    subject's micro-batches; ``model`` (default: ``built.model``) is what runs it."""
    model = built.model if model is None else model
    k = subject.micro_batches

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            try:
                return eager_step(model, built.example_inputs, built.loss_fn, k)
            except ValueError as err:  # e.g. batch norm of one value per channel
                if k == 1:
                    raise
                raise MethodUnavailable(f"a micro-batch of {subject.batch_size // k} does not run: {err}") from err

    note = gradient_differences(subject.graph, built.example_inputs, k) if k > 1 else None
    return Runnable(step, built, note)


def runtime_runnable(
    subject: Subject, order: Sequence[str], graph: Graph | None = None, runtime: PlanRuntime = "generated"
) -> Runnable:
    """``graph`` (default: the captured one) run by the magis runtime in ``order``, as ``runtime``
    runs a plan (:data:`magis.plan.PLAN_RUNTIMES`: generated code by default); compiled as
    ``magis.optimize(..., compile=True)`` compiles it, each segment kept compiled only where its
    trial on the subject's device wins (``Plan.timed``, the default)."""
    program = lower(subject.graph if graph is None else graph, order)
    device = next(p.device for p in subject.built.model.parameters())
    run = (
        "interpreted"
        if runtime == "interpreted"
        else generated_step(program, compile=runtime == "compiled", timed_on=device)
    )
    if runtime == "compiled":  # compile now: Inductor's seconds are not the step's
        with torch.random.fork_rng():
            run_program(program, subject.built.model, subject.inputs, apply_buffer_updates=False, runtime=run)

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            return run_program(program, subject.built.model, subject.inputs, runtime=run)

    return Runnable(step, subject.built, compiled=runs_compiled_code(run))


def planned_steps(
    plan: Callable[[Subject, float], Simulated], runtime: PlanRuntime = "generated"
) -> tuple[Callable[[Subject, float | None], Runnable], Callable[[Subject, float | None], Simulated]]:
    """``real`` and ``simulate`` of a method whose ``plan`` at a variant's budget or limit is a graph
    and order: run by the magis runtime (as ``runtime``), and simulated as they are."""

    def real(subject: Subject, limit: float | None) -> Runnable:
        assert limit is not None
        graph, order = plan(subject, limit)
        return runtime_runnable(subject, order, graph, runtime)

    def simulate(subject: Subject, limit: float | None) -> Simulated:
        assert limit is not None
        return plan(subject, limit)

    return real, simulate


def in_order(graph: Graph) -> Simulated:
    """``graph`` and the order its nodes stand in."""
    return graph, [n.name for n in graph.nodes]


def traced(
    subject: Subject, built: Built, trace: Callable[[torch.nn.Module, tuple, LossFn], Graph], compiled: bool = False
) -> Simulated:
    """The graph of ``built``'s step as ``trace(model, inputs, loss_fn)`` captures it, in its order;
    for an accumulating subject, its micro-batches one after another (:func:`accumulated_graph`;
    a ``compiled`` backward hands its gradients to ``.grad`` all at once)."""
    if subject.micro_batches == 1:
        return in_order(trace(built.model, tuple(built.example_inputs), built.loss_fn))
    try:
        micro = trace(*subject.micro_step(built))
    except (ValueError, CaptureError) as err:  # e.g. batch norm of one value per channel
        size = subject.batch_size // subject.micro_batches
        raise MethodUnavailable(f"a micro-batch of {size} does not run: {err}") from err
    return accumulated_graph(micro, [n.name for n in micro.nodes], subject.micro_batches, together=compiled)
