"""``rockmate``: Rockmate 2.0's schedule (rotor + ILP, the ``rockmate`` package) within ``B`` times
eager's measured activations on the GPU (:mod:`yardstick.peers.rockmate`).

Opt-in (``--methods rockmate``; not in the default set) and measured only: it needs ``rockmate``
and CUDA, and is skipped with the reason otherwise; it has no simulation.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from magis.backend.runtime import StepResult
from magis.models import Built
from yardstick.methods.method_registry import PEER, Method, MethodUnavailable, Runnable, Simulated, register
from yardstick.methods.subject import Subject
from yardstick.peers import rockmate


def _rockmate_step(subject: Subject, budget: float) -> tuple[rockmate.RockmateStep, Built]:
    """Rockmate's module for ``subject`` at ``budget`` on the GPU, and the build it runs (solved once per budget)."""
    reason = rockmate.unavailable_reason()
    if reason is not None:
        raise MethodUnavailable(reason)
    if subject.micro_batches != 1:
        raise MethodUnavailable("rockmate is not combined with gradient accumulation")

    def make() -> tuple[rockmate.RockmateStep, Built]:
        built = subject.rebuild()
        device = torch.device("cuda")
        model = built.model.to(device)
        inputs = rockmate.to_device(built.example_inputs, device)
        eager_peak, activations = rockmate.activation_bytes(model, inputs, built.loss_fn)
        try:
            step = rockmate.RockmateStep(model, inputs, built.loss_fn, int(budget * activations))
        except Exception as err:  # Rockmate's tracer or solvers fail on this model or budget
            raise MethodUnavailable(f"Rockmate failed: {type(err).__name__}: {err}") from err
        step.details |= {"eager_cuda_peak_bytes": eager_peak, "eager_cuda_activation_bytes": activations}
        return step, Built(model, inputs, built.loss_fn)

    return subject.once(("rockmate", budget), make)


def _real(subject: Subject, budget: float | None) -> Runnable:
    assert budget is not None
    rk_step, built = _rockmate_step(subject, budget)

    def step(scope: AbstractContextManager) -> StepResult:
        result = rk_step(scope)  # eager's reference runs on the CPU: compared there
        return StepResult(result.loss.cpu(), {n: g.cpu() for n, g in result.gradients.items()}, {})

    return Runnable(step, built)


def _simulate(_subject: Subject, _budget: float | None) -> Simulated:
    raise MethodUnavailable("rockmate is measured only: its schedule is not a magis graph")


def _details(subject: Subject, budget: float | None) -> dict[str, Any]:
    assert budget is not None
    return dict(_rockmate_step(subject, budget)[0].details)


register(
    Method(
        "rockmate",
        "Rockmate 2.0 (rotor + ILP rematerialization) within budget x eager's activations; needs rockmate and CUDA",
        PEER,
        _real,
        _simulate,
        budgeted=True,
        details=_details,
        opt_in=True,
    )
)
