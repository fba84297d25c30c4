"""``compile``: ``torch.compile``'s min-cut partitioner under
``torch._functorch.config.activation_memory_budget`` (``compile@0.5``), and ``inductor``: the
same partition compiled by Inductor, as users run ``torch.compile`` (``inductor@1``).

``compile`` runs the partitioner's forward and backward graphs eagerly, each one metered: a
memory peer, not ``torch.compile``'s speed. ``inductor`` (opt-in: compiling takes minutes on a
CPU) is that speed; its peak is its allocator's. Both are simulated as the partitioner's graphs
(:mod:`yardstick.peers.partitioned_capture`).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from magis.backend.runtime import StepResult
from magis.frontend.capture import LossFn
from magis.ir.graph import Graph
from yardstick.methods.method_registry import PEER, Method, Runnable, Simulated, register
from yardstick.methods.steps import eager_runnable, traced
from yardstick.methods.subject import Subject
from yardstick.peers.partitioned_capture import GraphRecorder, capture_partitioned, compile_backend, memory_budget

#: dynamo's recompile limit while a compiled peer runs: room for each budget at each micro-batch count
MAX_COMPILED_VARIANTS = 64


def compile_real(subject: Subject, budget: float | None) -> Runnable:
    assert budget is not None
    recorder = GraphRecorder()
    compiled = torch.compile(subject.built.model, backend=compile_backend(recorder))
    inner = eager_runnable(subject.built, subject, compiled)

    def step(scope: AbstractContextManager) -> StepResult:
        recorder.scope, calls = scope, recorder.calls
        try:
            with memory_budget(budget), _room_for_every_variant():
                result = inner.step(contextlib.nullcontext())
        finally:
            recorder.scope = None
        if recorder.calls == calls:
            raise RuntimeError("torch.compile ran the step eagerly: no compiled graph was called")
        grads = {name.removeprefix("_orig_mod."): g for name, g in result.gradients.items()}
        return StepResult(result.loss, grads, {})

    return Runnable(step, subject.built, inner.gradient_note)


def _room_for_every_variant() -> AbstractContextManager:
    """Dynamo's recompile limit raised for one compiled step: every ``compile@B`` variant of a
    comparison (and of each micro-batch count) compiles the same ``forward`` code object with
    its own backend, and past the limit (8 by default) dynamo runs the step eagerly."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    return config.patch(**{name: MAX_COMPILED_VARIANTS})


def inductor_real(subject: Subject, budget: float | None) -> Runnable:
    """``torch.compile(model)`` as a user calls it (Inductor, its default backend) under
    ``budget``, drawing random numbers as eager does (``fallback_random``): the step a compiled
    plan must beat in time. Compiled here, by one step (Inductor's seconds and scratch are not
    the step's); Inductor allocates its buffers below the dispatcher, so the row's peak is the
    allocator's (``Runnable.compiled``)."""
    assert budget is not None
    compiled = torch.compile(subject.built.model)
    inner = eager_runnable(subject.built, subject, compiled)

    def step(scope: AbstractContextManager) -> StepResult:
        # eager's random ops (Inductor's own generator would draw other dropout masks: another step)
        with memory_budget(budget), _room_for_every_variant(), torch._inductor.config.patch(fallback_random=True):
            result = inner.step(scope)
        grads = {name.removeprefix("_orig_mod."): g for name, g in result.gradients.items()}
        return StepResult(result.loss, grads, {})

    with torch.random.fork_rng():
        step(contextlib.nullcontext())
    return Runnable(step, subject.built, inner.gradient_note, compiled=True)


def compile_simulate(subject: Subject, budget: float | None) -> Simulated:
    assert budget is not None

    def trace(model: torch.nn.Module, inputs: tuple, loss_fn: LossFn) -> Graph:
        return capture_partitioned(model, inputs, loss_fn, budget)

    return traced(subject, subject.built, trace, compiled=True)


register(
    Method(
        "compile",
        "torch.compile's min-cut partitioner under activation_memory_budget",
        PEER,
        compile_real,
        compile_simulate,
        budgeted=True,
    )
)
register(
    Method(
        "inductor",
        "torch.compile as users call it (Inductor) under activation_memory_budget: timed, its peak the allocator's",
        PEER,
        inductor_real,
        compile_simulate,
        budgeted=True,
        opt_in=True,
    )
)
