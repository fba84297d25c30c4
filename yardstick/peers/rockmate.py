"""Rockmate 2.0 (``pip install rockmate``; Zhao et al., ICML 2023) as a measured-only peer.

Rockmate traces the model with its own graph builder (rkgb: ``torch.export``, or the
TorchScript tracer when export's graph does not parse), solves a rematerialization
schedule (``generate_config("rockmate")``: rotor's dynamic program over the sequence
of blocks, each block's options by an ILP solved with PuLP's CBC) and runs it as a new
``nn.Module``. It needs CUDA: its module, its profiler and its timers are hard-wired to
``torch.device("cuda")`` (on a CPU-only torch its constructor fails in
``torch.cuda.current_stream``). So ``rockmate@B`` runs only where ``rockmate`` imports
and CUDA is available, and only for real: its schedule is no magis graph, so it has
no simulation (:class:`~yardstick.methods.MethodUnavailable` says so).

The budget: Rockmate's ``budget`` is bytes for the activations of the step it
schedules (its README: "keeping activations under the given budget"); parameters,
inputs and gradients are outside it. ``rockmate@B`` gives it ``B`` times eager's
activations on the same GPU: eager's measured step peak (``max_memory_allocated``)
minus the parameters, buffers and inputs resident before the step and the parameter
gradients it leaves — the share ``compile@B`` and ``checkmate@B`` scale too.

Gradients: Rockmate 2.0 steps an optimizer itself on the small ("minor") parameters
at the end of its backward, and sets their ``.grad`` to ``None`` after. Its optimizer
is a constructor argument, so it is given :class:`GradientKeeper`, an optimizer that
leaves the parameters as they are and keeps the gradients handed to it; the step's
gradients are the parameters' ``.grad`` and those kept ones.

Measured on an H100 with torch 2.11 (2026-11-22, ``.gpu``-carried wheels of rockmate
2.0.0 and rkgb 2.0.0): rkgb traced none of resnet50, bert-base, vit-base and unet at
the small preset nor btlm-3b at tiny. ``torch.export``'s code did not parse (a lifted
constant tensor it cannot place, ``VariableInfo`` without ``requires_grad``) and the
TorchScript fallback failed on a dtype it could not read or on a tuple output. The
method then raises :class:`~yardstick.methods.MethodUnavailable` with both errors, so
the yardstick names the failure instead of running a different step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from magis.backend.runtime import StepResult
from magis.frontend.capture import LossFn, default_loss

#: seconds CBC may spend on one ILP of Rockmate's bottom solver (its default: 60)
ILP_TIME_LIMIT_S = 10
#: the bottom solver's peak and saved-memory budgets per block (``generate_config("rockmate")``: 10 x 10
#: ILPs per distinct block); fewer keep the solve within minutes on the largest workloads
BUDGET_POINTS = 4


def unavailable_reason() -> str | None:
    """Why Rockmate cannot run here (``None``: it can)."""
    try:
        import rockmate  # noqa: F401
    except Exception as err:  # ImportError, or a broken install (rkgb, pulp, configmypy)
        return f"rockmate is not importable ({type(err).__name__}: {err}); install rockmate>=2.0 and its dependencies"
    if not torch.cuda.is_available():
        return "Rockmate needs a CUDA device (its module and profiler are hard-wired to torch.device('cuda'))"
    return None


class GradientKeeper(torch.optim.Optimizer):
    """An "optimizer" that changes nothing and keeps the gradients of its parameters at each step."""

    def __init__(self, params: Any, **_ignored: Any) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    KEPT[id(p)] = p.grad.detach().clone()


#: gradients kept by every :class:`GradientKeeper` since :func:`_collect` last emptied it (id(param) -> grad)
KEPT: dict[int, torch.Tensor] = {}


class _Loss1(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def loss(self, output: Any) -> torch.Tensor:
        return default_loss(output) if self.loss_fn is None else self.loss_fn(output)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(x0))


class _Loss2(_Loss1):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.loss(self.model(x0, x1))


class _Loss3(_Loss1):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.loss(self.model(x0, x1, x2))


def loss_module(model: torch.nn.Module, inputs: Sequence[Any], loss_fn: LossFn | None) -> torch.nn.Module:
    """The model and its loss as one module of named positional inputs returning the scalar loss.

    rkgb maps inputs to ``forward``'s parameter names, so ``*inputs`` will not do, and the
    name ``input`` is avoided (newer ``torch.export`` aliases it, which rkgb 2.0 cannot parse).
    """
    wrappers = {1: _Loss1, 2: _Loss2, 3: _Loss3}
    if len(inputs) not in wrappers:
        raise ValueError(f"Rockmate's wrapper takes 1 to 3 positional inputs, not {len(inputs)}")
    return wrappers[len(inputs)](model, loss_fn)


def activation_bytes(model: torch.nn.Module, inputs: Sequence[Any], loss_fn: LossFn | None) -> tuple[int, int]:
    """Eager's measured CUDA step peak and its activations' share of it (see the module's docstring)."""
    from magis.backend.eager import eager_step

    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    eager_step(model, inputs, loss_fn)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return peak, max(peak - resident - grads, 0)


@dataclass
class RockmateStep:
    """A Rockmate module built for ``budget`` (bytes of activations) and one training step of it."""

    model: torch.nn.Module
    inputs: tuple
    loss_fn: LossFn | None
    budget_bytes: int
    ilp_time_limit_s: float = ILP_TIME_LIMIT_S
    budget_points: int = BUDGET_POINTS
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import rkgb
        from rkgb.core.partitioned import PartitionerSequence
        from rockmate import from_config, generate_config

        wrapped = loss_module(self.model, self.inputs, self.loss_fn)
        config = generate_config("rockmate")
        config.solver.bottom.hilp.time_limit = self.ilp_time_limit_s
        config.solver.bottom.hilp.nb_bdg_save = config.solver.bottom.hilp.nb_bdg_peak = self.budget_points
        start = time.perf_counter()

        def build(**graph: Any) -> Any:
            """Rockmate's module of ``wrapped`` (from ``graph``, rkgb's result, where given)."""
            return from_config(
                wrapped,
                self.inputs,
                self.budget_bytes,
                config=config,
                gpu_optim=GradientKeeper,
                cpu_optim=GradientKeeper,
                **graph,
            )

        tracer = "torch.export"
        try:
            self.module = build()
        except Exception as export_err:  # rkgb cannot parse export's graph: its TorchScript path
            tracer = f"torch.jit.trace (torch.export failed: {type(export_err).__name__}: {export_err})"
            try:
                res = rkgb.rkgb.Result(
                    wrapped,
                    model_args=self.inputs,
                    partitioners=[PartitionerSequence()],  # generate_config("rockmate")'s partitioner
                    inspection_device=torch.device("cuda"),
                    use_jit_instead_of_dynamo=True,
                )
                self.module = build(rkgb_res=res)
            except Exception as jit_err:
                raise RuntimeError(
                    f"with torch.export: {type(export_err).__name__}: {export_err}; "
                    f"with torch.jit.trace: {type(jit_err).__name__}: {jit_err}"
                ) from jit_err
        if self.module.op_sched is None:
            raise RuntimeError(f"Rockmate found no schedule within {self.budget_bytes} bytes of activations")
        self.details = {
            "rockmate_budget_bytes": int(self.budget_bytes),
            "solve_s": round(time.perf_counter() - start, 2),
            "tracer": tracer,
            "schedules_found": len(self.module.list_solutions),
            "simulated_time": float(sum(self.module.op_sched.time)),
            "ilp_time_limit_s": self.ilp_time_limit_s,
            "budget_points": self.budget_points,
        }

    def __call__(self, scope: AbstractContextManager) -> StepResult:
        params = dict(self.model.named_parameters())
        for p in params.values():
            p.grad = None
        KEPT.clear()
        with scope:
            loss = self.module(*self.inputs)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
            torch.cuda.synchronize()
        grads = {}
        for name, p in params.items():
            g = KEPT.get(id(p), p.grad)
            if g is not None:
                grads[name] = g.detach().clone()
        KEPT.clear()
        for p in params.values():
            p.grad = None
        return StepResult(loss.detach(), grads, {})


def to_device(inputs: Sequence[Any], device: torch.device) -> tuple:
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
