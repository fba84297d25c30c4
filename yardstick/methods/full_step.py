"""Full steps: each peer's training step with the optimizer's update, and magis planning the whole of it.

A training step ends with ``optimizer.step()``: the optimizer's states (AdamW: two per
parameter) are resident like the weights, and the gradients are held until the update
reads them. The methods here are the peers of the rest of the yardstick with that update
(issue #29), all with :func:`make_optimizer`, torch's ``AdamW`` at its default
hyperparameters (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2):

- ``eager+step`` — ``loss.backward(); optimizer.step()``: the reference of a comparison of
  full steps (:data:`~yardstick.methods.method_registry.FULL_STEP_REFERENCE`);
- ``eager+step-in-backward`` — PyTorch's optimizer-in-backward: one ``AdamW`` per parameter,
  stepped from ``register_post_accumulate_grad_hook`` as soon as its gradient is final, which
  then frees the gradient (torch's tutorial "How to save memory by fusing the optimizer step
  into the backward pass"; torchtune's ``optimizer_in_bwd``);
- ``accumulate+step`` (``accumulate@4+step``), ``checkpoint-block+step`` and ``compile+step``
  (``compile+step@0.5``) — those peers, then ``optimizer.step()`` on the gradients they leave
  (accumulation: once, after the last micro-batch);
- ``magis-optimize-lat+step`` (``magis-optimize-lat+step@1.1``) — the M-Optimizer in latency
  mode over the step with its update (:func:`magis.frontend.optimizer.with_optimizer`), as
  ``magis.optimize(..., optimizer=AdamW)`` plans it: the lowest simulated peak within ``L``
  times the simulated latency of eager's full step, run by the magis runtime.

Real (tiny and small, on this machine): every variant runs on a build of its own
(:meth:`~yardstick.methods.subject.Subject.own_build`), so all start from the same weights
although each step changes them. The optimizer's states are made before the first step, as
its first step makes them, and are resident (:attr:`Runnable.resident`), as the simulator
counts them: the first, metered step peaks as every later one. A full step leaves no
gradient; what it used is read back from the first moment after the first step
(``exp_avg = (1 - beta1) * gradient``, :func:`first_gradients`) and checked against the
reference's like any method's gradients.

Simulated: the peer's graph with :func:`~magis.frontend.optimizer.with_optimizer`'s update
after its whole backward (after the last micro-batch). On the paper preset the update is
CUDA's default, one multi-tensor (``foreach``) kernel per operation whose temporaries are as
large as the group; at tiny and small it is the loop over the parameters that this CPU runs
(:func:`on_cuda`). Step-in-backward is the same graph with the update split per parameter
(:func:`magis.rules.early_update.early_updates`), each placed right after the last node it
must follow in the captured order: its gradient, and every reader of the parameter.

All full-step methods are opt-in: a comparison runs them when named, and one that names only
them is a comparison against ``eager+step``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from magis.backend.program import lower
from magis.backend.runtime import StepResult, run_program
from magis.cost.latency import estimate_latency
from magis.cost.memory import simulate_memory
from magis.frontend.optimizer import start_states, with_optimizer
from magis.frontend.step import UserStep, as_batch
from magis.ir.graph import Graph
from magis.plan import generated_step
from magis.rules.early_update import every_parameter_early
from magis.search.m_optimizer import Objective, SearchResult, m_optimize
from yardstick.methods import magis_methods
from yardstick.methods.accumulate_peers import micro_batch_details
from yardstick.methods.checkpoint_peers import CHECKPOINT_BLOCK
from yardstick.methods.compile_peer import compile_real, compile_simulate
from yardstick.methods.eager_peer import eager_real, eager_simulate
from yardstick.methods.method_registry import (
    ACCUMULATE,
    FULL_STEP_REFERENCE,
    LATENCY_LIMITS,
    MAGIS,
    PEER,
    Method,
    Runnable,
    Simulated,
    register,
)
from yardstick.methods.subject import Subject

Real = Callable[[Subject, float | None], Runnable]
Simulate = Callable[[Subject, float | None], Simulated]

IN_BACKWARD = "eager+step-in-backward"
MAGIS_STEP = "magis-optimize-lat+step"


def make_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    """The optimizer of every full step: ``torch.optim.AdamW`` at its default hyperparameters."""
    return torch.optim.AdamW(params)


def on_cuda(subject: Subject) -> bool:
    """Whether the subject's update is simulated as CUDA runs it (the paper preset, priced on a GPU
    profile) or as this CPU does (tiny and small, measured here): see the module docstring."""
    return subject.preset == "paper"


def trained(subject: Subject) -> list[str]:
    """The parameters the captured step computes a gradient for: those the optimizer updates."""
    return list(subject.graph.signature.gradients)


# ----------------------------------------------------------------------------------- real


def first_gradients(
    optimizers: Mapping[str, tuple[torch.optim.Optimizer, torch.nn.Parameter]],
) -> Callable[[], dict[str, torch.Tensor]]:
    """What reads, after the first step, the gradient each parameter's update used: its first
    moment over ``1 - beta1`` (from zero, ``exp_avg.lerp_(grad, 1 - beta1)`` is ``(1 - beta1) * grad``)."""

    def read() -> dict[str, torch.Tensor]:
        out = {}
        for name, (optimizer, param) in optimizers.items():
            group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
            out[name] = optimizer.state[param]["exp_avg"] / (1.0 - group["betas"][0])
        return out

    return read


def _with_optimizer(
    model: torch.nn.Module, subject: Subject
) -> tuple[dict[str, torch.nn.Parameter], torch.optim.AdamW, list[str], list[torch.Tensor]]:
    """``model``'s parameters by name, a new AdamW of them, the names it trains and the states its
    first step would make, made now (resident from the first, metered step on)."""
    params = dict(model.named_parameters())
    optimizer = make_optimizer(model.parameters())
    names = trained(subject)
    return params, optimizer, names, start_states(optimizer, [params[n] for n in names])


def stepped(runnable: Runnable, subject: Subject) -> Runnable:
    """``runnable``'s step, then ``optimizer.step()`` on the gradients it returns: the parameters of
    its build's model get them as ``.grad``, are updated, and lose them (``zero_grad``)."""
    model = runnable.built.model
    params, optimizer, names, states = _with_optimizer(model, subject)

    def step(scope: AbstractContextManager) -> StepResult:
        result = runnable.step(scope)
        loss, gradients = result.loss, result.gradients
        del result
        for name, gradient in gradients.items():
            params[name].grad = gradient
        del gradients
        with scope:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, {}, {})

    used = first_gradients({n: (optimizer, params[n]) for n in names})
    return Runnable(step, runnable.built, runnable.gradient_note, tuple(states), used)


def after_backward(real: Real, own_build: bool = True) -> Real:
    """The real step of a peer whose ``real`` runs the backward, with the optimizer's step after it,
    on a build of its own (``own_build=False``: ``real`` makes one itself, as checkpointing does)."""

    def full(subject: Subject, budget: float | None) -> Runnable:
        return stepped(real(subject.own_build() if own_build else subject, budget), subject)

    return full


def _in_backward_real(subject: Subject, _budget: float | None) -> Runnable:
    """Per-parameter AdamW stepped from ``register_post_accumulate_grad_hook``, then ``.grad`` freed."""
    built = subject.own_build().built
    model = built.model
    params = dict(model.named_parameters())
    names = trained(subject)
    optimizers = {params[n]: make_optimizer([params[n]]) for n in names}
    states = [t for p, optimizer in optimizers.items() for t in start_states(optimizer, [p])]

    def update(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    for param in optimizers:
        param.register_post_accumulate_grad_hook(update)
    user = UserStep(built.loss_fn, None)

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            for p in model.parameters():
                p.grad = None
            loss = user.loss(model, as_batch(built.example_inputs))
            loss.backward()
            return StepResult(loss.detach(), {}, {})

    used = first_gradients({n: (optimizers[params[n]], params[n]) for n in names})
    return Runnable(step, built, None, tuple(states), used)


# ------------------------------------------------------------------------------ simulated


def with_update(subject: Subject, model: torch.nn.Module, simulated: Simulated) -> Simulated:
    """The step ``simulated`` (a graph of ``model``'s step and its order) with the optimizer's update
    after its whole backward, as eager's ``optimizer.step()`` runs: the states first, as resident
    inputs, the update nodes last."""
    graph, order = simulated
    full = with_optimizer(graph, make_optimizer(model.parameters()), model, on_cuda=on_cuda(subject))
    if full.signature.gradients:
        left = ", ".join(full.signature.gradients)
        raise RuntimeError(f"the optimizer does not update {left}: the graph's parameters are not the model's")
    had = set(order)
    added = [n for n in full.nodes if n.name not in had]
    inputs = [n.name for n in added if n.is_input]
    return full, (*inputs, *order, *(n.name for n in added if not n.is_input))


def eager_step_graph(subject: Subject) -> Simulated:
    """Eager's full step as the simulator sees it: the captured step, then the update (made once)."""
    return subject.once("eager+step", lambda: with_update(subject, subject.built.model, eager_simulate(subject, None)))


def _eager_simulate(subject: Subject, _budget: float | None) -> Simulated:
    if subject.micro_batches == 1:
        return eager_step_graph(subject)
    return with_update(subject, subject.built.model, eager_simulate(subject, None))


def in_backward_graph(graph: Graph, order: Iterable[str]) -> Simulated:
    """``graph`` with each param group's update split per parameter, each placed right after the last
    node it must follow in ``order`` (:func:`~magis.rules.early_update.every_parameter_early`)."""
    order = tuple(order)
    return every_parameter_early(graph, order) or (graph, order)


def _in_backward_simulate(subject: Subject, _budget: float | None) -> Simulated:
    return in_backward_graph(*eager_step_graph(subject))


def simulated_after_backward(simulate: Simulate) -> Simulate:
    """The simulated step of a peer (``simulate``, a graph of the subject's model), with the update after it."""

    def full(subject: Subject, budget: float | None) -> Simulated:
        return with_update(subject, subject.built.model, simulate(subject, budget))

    return full


# ------------------------------------------------------------------------------ the facts


def _bytes(graph: Graph, nodes: Iterable[str]) -> int:
    """Bytes of the storages of ``nodes``, each storage once."""
    keys = {key for node in nodes for key in graph.storages[node] if key is not None}
    return sum(graph.storage_bytes[key] for key in keys)


def step_facts(subject: Subject, _budget: float | None = None) -> dict[str, Any]:
    """What every plan of the subject's full step holds (the floor: weights, buffers, optimizer states
    and inputs, resident throughout) and the gradients' bytes, which a full step holds only until
    their update: the details of ``eager+step``'s row."""
    graph, order = eager_step_graph(subject)
    sig = graph.signature
    parts = {
        "weight_bytes": _bytes(graph, sig.parameters),
        "buffer_bytes": _bytes(graph, sig.buffers),
        "optimizer_state_bytes": _bytes(graph, sig.optimizer_states),
        "input_bytes": _bytes(graph, sig.user_inputs),
    }
    floor = simulate_memory(graph, order).persistent_bytes
    captured = subject.graph
    return {
        **parts,
        "floor_bytes": floor,
        "gradient_bytes": _bytes(captured, captured.signature.gradients.values()),
        "on_cuda": on_cuda(subject),
    }


# ---------------------------------------------------------------------------------- magis


def captured_full_step(subject: Subject) -> tuple[int, float]:
    """Eager's full step's simulated peak and latency, priced as the M-Optimizer's searches price
    (:func:`~yardstick.methods.magis_methods.search_model`): what its limits are taken against."""

    def make() -> tuple[int, float]:
        graph, order = eager_step_graph(subject)
        latency = estimate_latency(graph, order, magis_methods.search_model(subject)).total_s
        return simulate_memory(graph, order).peak, latency

    return subject.once("captured_full_step", make)


def optimized_full_step(subject: Subject, limit: float) -> SearchResult:
    """The M-Optimizer's lowest peak for the full step within ``limit`` times eager's full step's
    simulated latency, searched for ``magis_methods.OPTIMIZE_SECONDS`` (run once per limit)."""

    def make() -> SearchResult:
        _, latency = captured_full_step(subject)
        graph, _ = eager_step_graph(subject)
        objective = Objective("latency", latency_s=limit * latency)
        model = magis_methods.search_model(subject)
        seconds, states = magis_methods.OPTIMIZE_SECONDS, magis_methods.OPTIMIZE_STATES
        return m_optimize(graph, objective, model, seconds, states, progress=False)

    return subject.once(("optimized_full_step", limit), make)


def _magis_simulate(subject: Subject, limit: float | None) -> Simulated:
    assert limit is not None
    best = optimized_full_step(subject, limit).best
    return best.graph, best.order


def _magis_real(subject: Subject, limit: float | None) -> Runnable:
    """The plan run by the magis runtime, its update applied by AdamW's own math to a build of its own."""
    graph, order = _magis_simulate(subject, limit)
    program = lower(graph, order)
    run = generated_step(program)  # generated once, as a plan does: not a step's cost
    own = subject.own_build()
    model = own.built.model
    params, optimizer, names, states = _with_optimizer(model, subject)

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            return run_program(program, model, own.inputs, optimizer=optimizer, runtime=run)

    used = first_gradients({n: (optimizer, params[n]) for n in names})
    return Runnable(step, own.built, None, tuple(states), used)


def _magis_details(subject: Subject, limit: float | None) -> dict[str, Any]:
    assert limit is not None
    return magis_methods.search_details(optimized_full_step(subject, limit), *captured_full_step(subject))


#: what every full-step method is
_FULL = {"opt_in": True, "full_step": True}

register(
    Method(
        FULL_STEP_REFERENCE,
        "eager PyTorch's full step: loss.backward(); optimizer.step() (AdamW; foreach on CUDA)",
        PEER,
        after_backward(eager_real),
        _eager_simulate,
        details=step_facts,
        **_FULL,
    )
)
register(
    Method(
        IN_BACKWARD,
        "per-parameter AdamW stepped from register_post_accumulate_grad_hook: each gradient freed once applied",
        PEER,
        _in_backward_real,
        _in_backward_simulate,
        **_FULL,
    )
)
register(
    Method(
        f"{ACCUMULATE}+step",
        "gradient accumulation over k micro-batches, then optimizer.step() after the last",
        PEER,
        after_backward(eager_real),
        _eager_simulate,
        micro_batched=True,
        details=micro_batch_details,
        **_FULL,
    )
)
register(
    Method(
        "checkpoint-block+step",
        "every block checkpointed, then optimizer.step()",
        PEER,
        after_backward(CHECKPOINT_BLOCK[0], own_build=False),
        simulated_after_backward(CHECKPOINT_BLOCK[1]),
        **_FULL,
    )
)
register(
    Method(
        "compile+step",
        "torch.compile's min-cut partitioner under activation_memory_budget, then optimizer.step()",
        PEER,
        after_backward(compile_real),
        simulated_after_backward(compile_simulate),
        budgeted=True,
        **_FULL,
    )
)
register(
    Method(
        MAGIS_STEP,
        "magis' M-Optimizer over the step with AdamW's update: lowest simulated peak within L x eager+step's latency",
        MAGIS,
        _magis_real,
        _magis_simulate,
        latency_limits=LATENCY_LIMITS,
        details=_magis_details,
        **_FULL,
    )
)
