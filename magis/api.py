"""The public face of magis: capture a training step, profile it, optimize it.

The step is the user's, as they write it (docs/design.md, "The user's side of the
contract"): the batch as their DataLoader yields it (a tuple of positional arguments,
a mapping of keyword arguments, or one tensor) and ``loss_fn(output)`` or their own
``training_step(model, *batch)`` (:mod:`magis.frontend.step`); or, with
``optimize(..., inference=True)``, the model's forward alone.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from magis.backend.eager import compare_gradients
from magis.backend.runtime import Runtime, StepRunner, broken_divisor
from magis.backend.verify import Verification, forked_rng, run_both, verify_step
from magis.cost.latency import CannotTime, ProfiledCostModel, cost_model, estimate_latency
from magis.cost.memory import MemoryProfile, simulate_memory
from magis.cost.op_timing import StepsTimed, time_in_turns
from magis.cost.workspace import measure_workspaces, with_workspaces
from magis.frontend.capture import capture_forward, capture_timed
from magis.frontend.conditions import (
    Conditions,
    refuse_gradient_hooks,
    refuse_gradients_off,
    warn_if_evaluating,
    warn_of_hooks,
)
from magis.frontend.grad_seed import with_grad_seed
from magis.frontend.optimizer import unplanned_reason, with_optimizer
from magis.frontend.step import BatchSpec, LossFn, TrainingStep, UserStep, as_batch, user_model
from magis.ir.graph import Graph
from magis.plan import InfeasibleLimit, Plan
from magis.rules.output_backward import batch_norms_from_outputs
from magis.search.m_optimizer import DEFAULT_MAX_STATES, Objective, SearchResult, m_optimize
from magis.search.timed_choice import TimeSteps, timed_choice

#: latency limit (ratio to the captured step) when neither limit is given
DEFAULT_LATENCY_RATIO = 1.10
#: share of the time budget (and seconds at least) for timing the plans nearest the search's
#: choice in turns with the step they are compared to (:func:`_confirmed_by_timing`)
TIMED_SHARE = 0.1
TIMED_MIN_S = 2.0
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
#: ProfileReport's keys that only a run (``run=True``) fills
_RUN_KEYS = ("measured_peak_bytes", "eager_peak_bytes", "max_grad_error", "missing_gradients", "extra_gradients")


def is_fake(model: torch.nn.Module) -> bool:
    """True when the model's weights are fake or meta tensors (nothing can run)."""
    return any(isinstance(p, FakeTensor) or p.device.type == "meta" for p in model.parameters())


@dataclass(frozen=True)
class ProfileReport:
    """What :func:`profile` returns; :meth:`to_dict` is its JSON form.

    The simulated figures of the captured step in its captured order; with ``run=True``
    also both measured peaks (the magis runtime's and eager PyTorch's), the largest
    relative gradient difference (the loss counts as one more gradient) and the
    parameters whose gradient only one of the two computed (:func:`measure_against_eager`).
    """

    model: str
    nodes: int
    weight_bytes: int
    persistent_bytes: int
    simulated_peak_bytes: int
    simulated_latency_s: float
    device: str
    capture_seconds: float
    simulate_seconds: float
    measured_peak_bytes: int | None = None
    eager_peak_bytes: int | None = None
    max_grad_error: float | None = None
    missing_gradients: list[str] | None = None
    extra_gradients: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the run's keys only where the step ran."""
        ran = self.measured_peak_bytes is not None
        return {k: v for k, v in asdict(self).items() if ran or k not in _RUN_KEYS}


def profile(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    training_step: TrainingStep | None = None,
    run: bool = False,
    device: str | None = None,
    seed: int = 0,
) -> ProfileReport:
    """Capture the training step and report its size, simulated peak and latency.

    ``batch``, ``loss_fn`` and ``training_step`` are the user's step (module docstring).
    ``device`` names the latency cost model: ``"cpu"``/``"cuda"`` (profiled on this
    machine) or a device profile such as ``"h200"``; by default the local device, or
    ``"h200"`` for a model on fake tensors. With ``run=True`` the step also runs for
    real, through the magis runtime and as plain eager PyTorch, and the report adds
    both measured peaks and the largest relative gradient difference.
    """
    UserStep(loss_fn, training_step)  # both given: an error before the capture
    model = user_model(model)
    fake = is_fake(model)
    if run and fake:
        raise ValueError("run=True needs real weights: this model is on fake or meta tensors")
    device = device or ("h200" if fake else _local_device(model))
    latency_model = cost_model(device)  # an unknown device fails here, before the capture
    captured = capture_timed(model, batch, loss_fn, training_step=training_step)
    graph = _with_device_workspaces(captured.graph, model, fake)  # as optimize's captured step
    order = [n.name for n in graph.nodes]
    start = time.perf_counter()
    memory = simulate_memory(graph, order)
    latency = estimate_latency(graph, order, latency_model)
    measured = (
        measure_against_eager(graph, order, model, batch, loss_fn, seed, training_step=training_step) if run else {}
    )
    return ProfileReport(
        model=type(model).__name__,
        nodes=len(graph),
        weight_bytes=graph.summary()["weight_bytes"],
        persistent_bytes=memory.persistent_bytes,
        simulated_peak_bytes=memory.peak,
        simulated_latency_s=latency.total_s,
        device=device,
        capture_seconds=captured.seconds,
        simulate_seconds=time.perf_counter() - start,
        **measured,
    )


def measure_against_eager(
    graph: Graph,
    order: Sequence[str],
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    seed: int = 0,
    *,
    training_step: TrainingStep | None = None,
    runtime: Runtime | StepRunner = "generated",
) -> dict[str, Any]:
    """Run the step twice from the same state and seed: eager PyTorch, then the magis runtime
    (``runtime``: generated code, the interpreter, or a plan's own step such as ``plan.compiled``).

    Returns ``measured_peak_bytes``, ``eager_peak_bytes`` (for a step with compiled segments on
    CPU both as the allocator counts them, kernels' scratch and Inductor's buffers included:
    :class:`~magis.backend.meter.CpuAllocatorMeter`), ``max_grad_error`` (the
    loss counts as one more gradient) and the parameters whose gradient only one of
    the two computed: ``missing_gradients`` (eager has one, magis not: that parameter
    would never train) and ``extra_gradients``. With any of those, ``max_grad_error``
    is infinite. The model's buffers, gradients and the generators are left as before. For an
    inference graph, eager's forward beside the graph's: both peaks and ``max_output_error``.
    """
    both = run_both(graph, order, model, batch, UserStep(loss_fn, training_step), seed, measure=True, runtime=runtime)
    if graph.signature.inference:
        outputs = compare_gradients(
            *({f"output {i}": t for i, t in enumerate(r.outputs)} for r in (both.reference, both.result))
        )
        return {
            "measured_peak_bytes": both.measured_peak_bytes,
            "eager_peak_bytes": both.eager_peak_bytes,
            "max_output_error": outputs.max_error if outputs.same_names else float("inf"),
        }
    comparison = compare_gradients(
        {**both.reference.gradients, "<loss>": both.reference.loss},
        {**both.result.gradients, "<loss>": both.result.loss},
    )
    return {
        "measured_peak_bytes": both.measured_peak_bytes,
        "eager_peak_bytes": both.eager_peak_bytes,
        "max_grad_error": comparison.max_error if comparison.same_names else float("inf"),
        "missing_gradients": list(comparison.missing),
        "extra_gradients": list(comparison.extra),
    }


def optimize(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    training_step: TrainingStep | None = None,
    memory_limit: int | str | float | None = None,
    latency_limit: float | None = None,
    time_budget: float = 60.0,
    device: str | None = None,
    seed: int = 0,
    max_states: int = DEFAULT_MAX_STATES,
    verify: bool = True,
    progress: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    max_grad_norm: float | None = None,
    compile: bool = False,
    inference: bool = False,
    cuda_graphs: bool = True,
    timed: bool = True,
) -> Plan:
    """Capture the training step and search for the plan MAGIS Algorithm 3 finds best.

    ``batch`` is an example batch as the DataLoader yields it and ``loss_fn`` or
    ``training_step`` the step (module docstring); the plan is called the same way,
    ``plan(*batch)`` (``plan(batch)`` for a mapping or one tensor), on batches of the
    same structure, shapes and dtypes, with the submodules in the modes and under the
    autocast state of this call (a model in eval mode is planned as in evaluation, with
    a warning).

    ``memory_limit`` (memory-limit mode: the lowest latency whose simulated peak fits):
    bytes as an int, a string such as ``"6GiB"``/``"512MiB"``/``"2GB"``, or a float in
    (0, 1], a fraction of the captured step's simulated peak. ``latency_limit``
    (latency-limit mode: the lowest peak within it): a float >= 1, a ratio to the
    captured step's simulated latency. Neither: latency-limit mode at 1.10. Both:
    memory-limit mode, and the plan must meet the latency limit too. On a CPU the plans
    nearest the search's choice are then timed whole and the choice made by their timed
    figures (:func:`_confirmed_by_timing`): an inference plan's limit is then a ratio to the
    model's own forward as timed, a training step's to the captured step as timed.
    ``timed=False`` keeps the search's choice by its estimates. Compiled (``compile=True``), each
    segment is timed against its ops where the step runs, at the first call (before the step,
    on random inputs of its shapes), and stays compiled only where faster; ``timed=False``
    compiles every segment.

    Before the search the captured step is checked against eager PyTorch on the example
    batch (:func:`~magis.backend.verify.verify_step`: the loss, every gradient and buffer
    update, from the same seed; the model is left as it was): a step that differs raises
    :class:`~magis.backend.verify.CaptureMismatch`. ``verify=False`` skips the check; a
    model on fake or meta tensors is not checked; ``plan.report()`` says which.

    ``device`` names the latency cost model as in :func:`profile`; on a device profiled
    here (``"cpu"``, ``"cuda"``) the captured step is timed and the operators of the
    graphs the search makes that were never timed are estimated from their kin
    (:class:`~magis.cost.latency.ProfiledCostModel`). The search stops at
    ``time_budget`` seconds or after ``max_states`` states (the bound that keeps it
    deterministic: same inputs, seed, limits and operator timings give the same plan, and
    with ``timed=False`` the same choice, which timing whole plans may change); it runs with
    torch's generator seeded with ``seed`` and leaves the caller's generator as it
    was; ``progress`` prints a line as the capture and the check against eager start and end,
    then shows a bar with the best peak and latency so far and the states explored
    (``progress=False``: nothing is printed). A limit no plan meets raises
    :class:`~magis.plan.InfeasibleLimit`, whose ``best`` is the best plan found.

    ``optimizer`` (the whole step, :mod:`magis.frontend.optimizer`): ``plan(*batch)`` also
    updates the parameters, as ``loss.backward(); optimizer.step()`` with ``.grad`` None before
    and after. SGD, Adam and AdamW are planned inside the step (their states counted, each
    update placed by the search, early where that frees memory); any other optimizer is
    stepped after the plan with the gradients kept (``plan.report()`` says which).
    ``max_grad_norm`` clips the gradients of the parameters ``optimizer`` steps first, as
    ``torch.nn.utils.clip_grad_norm_`` over them: every gradient is then held until the last
    is final (the report says how many bytes that holds).
    The limits are of the whole step: a fraction is of eager's step with its update.

    The plan runs as generated Python (:mod:`magis.backend.codegen`); ``compile=True`` runs its
    maximal segments of aten ops compiled by Inductor (:mod:`magis.backend.compiled`, compiled on
    the first call; ``plan.runtime`` is ``"compiled"``), and an analytic ``device`` profile then
    prices chains of pointwise ops as the fused kernels they become
    (:attr:`~magis.cost.latency.AnalyticCostModel.fused`), the captured step's latency included.
    On CUDA the step is captured once as a CUDA graph and replayed at each call
    (:mod:`magis.backend.cuda_graph`; ``plan.report().runtime["cuda_graph"]`` says whether, and
    what its memory pool holds); ``cuda_graphs=False`` runs it launch by launch. A model on CUDA
    has each distinct convolution run once before the search, its cuDNN workspace measured and
    counted in the simulated peak (:mod:`magis.cost.workspace`; this resets the device's peak
    memory statistics), and the plan runs batch norm with eager's cuDNN kernels
    (:mod:`magis.backend.kernels`).

    ``inference=True`` plans the forward alone (:func:`~magis.frontend.capture.capture_forward`:
    no gradients, the submodules in their modes, so call ``model.eval()`` first for evaluation):
    ``plan(*batch)`` returns the model's output, as ``with torch.no_grad(): model(*batch)``
    would. The same search plans it (operator order, fission, identity rewrites, swaps); with
    no backward nothing is saved for one, so only what the forward itself reads twice can be
    recomputed. It takes no ``loss_fn``, ``training_step``, ``optimizer`` or ``max_grad_norm``.
    """
    for name, value in (("compile", compile), ("inference", inference), ("cuda_graphs", cuda_graphs), ("timed", timed)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} is True or False, got {value!r}")
    model = user_model(model)
    step = UserStep(loss_fn, training_step)  # bad input fails before the capture
    spec = BatchSpec.of(batch)
    if inference:
        check_inference_options(loss_fn, training_step, optimizer, max_grad_norm)
    else:
        refuse_gradients_off()
    _check_optimizer(model, optimizer, max_grad_norm)
    if latency_limit is not None and (
        isinstance(latency_limit, bool) or not isinstance(latency_limit, (int, float)) or not latency_limit >= 1.0
    ):
        raise ValueError(f"latency_limit is a ratio to the captured step's latency, at least 1; got {latency_limit!r}")
    if not time_budget > 0:
        raise ValueError(f"time_budget must be a positive number of seconds, got {time_budget!r}")
    memory_bytes = None if memory_limit is None else _memory_limit(memory_limit)  # bad options fail before capture
    fake = is_fake(model)
    device = device or ("h200" if fake else _local_device(model))
    # the captured step is timed, the rest estimated
    latency_model = cost_model(device, estimate_unseen=True, progress=progress, fused=compile)
    warn_of_hooks(model)
    if not inference:
        warn_if_evaluating(model)
        refuse_gradient_hooks(model)  # before the check runs eager's step, which would fire them
        spec.refuse_gradients(batch)
    with forked_rng(model):
        torch.manual_seed(seed)
        captures = "the forward" if inference else "the step (forward, loss, backward)"
        with _stage(progress, f"capturing {captures}", "captured"):
            if inference:
                captured = capture_forward(model, batch)
                graph, grad_seed = captured.graph, None
            else:
                captured = capture_timed(model, batch, loss_fn, training_step=training_step)
                device_of_seed = torch.device("cpu") if fake else next(model.parameters()).device
                graph, grad_seed = with_grad_seed(captured.graph, device_of_seed)
        graph = _with_device_workspaces(graph, model, fake)
        with _stage(progress and verify and not fake, f"checking its {len(graph):,} nodes against eager", "checked"):
            verification = _verification(graph, model, batch, step, seed, verify)
        # as the capture and the check left it
        conditions = Conditions.of(model, gradients=not inference, step=(loss_fn, training_step))
        if optimizer is not None and unplanned_reason(optimizer) is None:
            graph = with_optimizer(graph, optimizer, model, max_grad_norm, on_cuda=device != "cpu")
        order = [n.name for n in graph.nodes]
        memory = simulate_memory(graph, order)
        latency = estimate_latency(graph, order, latency_model).total_s
        objective = _objective(memory_bytes, latency_limit, memory.peak, latency)
        floor = floor_bytes(graph, memory)
        if objective.memory_bytes is not None and objective.memory_bytes < floor:
            raise InfeasibleLimit(
                f"memory limit {_mib(objective.memory_bytes)} is below the floor of this step, "
                f"{_mib(floor)} (weights, buffers, inputs, optimizer states, gradients or outputs returned)"
            )
        left_out = () if fake else _choices_the_weights_break(graph, model)
        result = m_optimize(
            graph, objective, latency_model, time_budget, max_states, progress=progress, left_out=left_out
        )
    best = result.best
    plan = Plan(
        model=model,
        graph=best.graph,
        order=best.order,
        peak_bytes=best.peak_bytes,
        latency_s=best.latency_s,
        baseline_peak_bytes=memory.peak,
        baseline_latency_s=latency,
        device=device,
        objective=objective,
        search=replace(result, front=()),  # a plan file holds the result: not the search's front
        baseline=graph,
        cost_model=latency_model,
        batch=spec,
        conditions=conditions,
        grad_seed=grad_seed,
        verification=verification,
        planning_only=fake,
        optimizer=optimizer,
        max_grad_norm=max_grad_norm,
        runtime="compiled" if compile else "generated",
        cuda_graphs=cuda_graphs,
        timed=timed,
        output_spec=captured.output_spec,
        output_nones=captured.output_nones,
        step_output=captured.step_output,
        step_functions=(loss_fn, training_step),
    )
    if timed:
        plan = _confirmed_by_timing(plan, result, batch, time_budget)
    if not plan.objective.met_by(plan.search.best):  # the near miss goes with the error
        message = _infeasible(plan.objective, plan.peak_bytes, plan.latency_s, plan.baseline_latency_s, floor)
        raise InfeasibleLimit(message, best=plan)
    return plan


def _confirmed_by_timing(plan: Plan, result: SearchResult, batch: Any, time_budget: float) -> Plan:
    """On this CPU, the search's choice confirmed by timing the plans nearest it in turns with
    the step they are measured against (:mod:`magis.search.timed_choice`), in at most
    :data:`TIMED_SHARE` of the time budget (at least :data:`TIMED_MIN_S`): ``plan`` with the
    chosen state, its limit rescaled to that step as timed, and the timed latencies.

    An inference plan is measured as its user sees it, against the model's own forward: each
    plan called on ``batch`` as it will be called, per-call checks included, beside eager's
    ``model(*batch)`` under ``no_grad``. A training step (whose eager run would change the
    model), or a forward that updates buffers (batch norm in training mode), is measured as the
    runtime runs it on random inputs, against the captured step. A plan priced by a
    device profile, on CUDA, or compiled stays as the search chose it."""
    model, stats = plan.cost_model, plan.search.stats
    if not isinstance(model, ProfiledCostModel) or plan.runtime == "compiled":
        return plan
    baseline = (plan.baseline, [n.name for n in plan.baseline.nodes])
    sig = plan.graph.signature
    calls = sig.inference and not sig.buffer_updates  # calling them must leave the model as it was
    time_steps = _calls_timer(plan, batch, model) if calls else model.time_steps
    try:
        with forked_rng(plan.model):  # a step drawing from the model's own generator leaves it as it was
            chosen = timed_choice(
                result.front,
                result.best,
                result.initial,
                plan.objective,
                baseline,
                plan.baseline_latency_s,
                time_steps,
                max(TIMED_MIN_S, TIMED_SHARE * time_budget),
            )
    except CannotTime as err:
        stats.timed_choice = f"not timed: {err}"
        return plan
    stats.timed_plans, stats.timed_rounds, stats.timed_choice = chosen.plans, chosen.rounds, chosen.note
    best = chosen.best
    return replace(
        plan,
        graph=best.graph,
        order=best.order,
        peak_bytes=best.peak_bytes,
        latency_s=best.latency_s,
        baseline_latency_s=chosen.baseline_latency_s,
        objective=chosen.objective,
        search=replace(plan.search, best=best),
    )


def _calls_timer(plan: Plan, batch: Any, model: ProfiledCostModel) -> TimeSteps:
    """Times an inference plan's candidates as its user calls them: the first step given (the
    captured step) is the model's own forward, eager under ``no_grad``, the others ``plan`` made
    of them, called on ``batch``."""
    batch = as_batch(batch)
    args = batch if plan.batch.kind == "args" else (batch,)

    def time_steps(steps: Sequence[tuple[Graph, Sequence[str]]], max_seconds: float) -> StepsTimed:
        started = time.perf_counter()
        candidates = [replace(plan, graph=graph, order=tuple(order)) for graph, order in steps[1:]]
        calls: list[Callable[[], Any]] = [functools.partial(UserStep.output, plan.model, batch)]
        calls += [functools.partial(candidate, *args) for candidate in candidates]
        with torch.no_grad():
            try:
                for call in calls:  # warm-up
                    call()
            except Exception as err:  # a candidate that cannot run is left to its estimate
                raise CannotTime(f"a plan could not run ({err})") from err
            return time_in_turns(calls, model.device, model.in_step_runs, max_seconds - (time.perf_counter() - started))

    return time_steps


@contextlib.contextmanager
def _stage(progress: bool, doing: str, done: str) -> Iterator[None]:
    """With ``progress``, a line on stderr for a stage that shows no bar of its own (capturing a
    large model takes a minute): what it does as it starts, and its seconds once done."""
    if not progress:
        yield
        return
    print(f"magis: {doing}...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"magis: {done} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _with_device_workspaces(graph: Graph, model: torch.nn.Module, fake: bool) -> Graph:
    """``graph`` with its operators' workspaces where the model runs on CUDA: cuDNN's count in
    the step's peak there (:mod:`magis.cost.workspace`)."""
    device = None if fake else next(model.parameters()).device
    if device is None or device.type != "cuda":
        return graph
    return with_workspaces(graph, measure_workspaces(graph, device))


def _verification(
    graph: Graph, model: torch.nn.Module, batch: Any, step: UserStep, seed: int, verify: bool
) -> Verification:
    """The captured step checked against eager (:func:`~magis.backend.verify.verify_step`), or why not."""
    if is_fake(model):
        return Verification(False, "not checked: the model is on fake or meta tensors (nothing can run)")
    if not verify:
        return Verification(False, "not checked: optimize(..., verify=False)")
    memory = simulate_memory(graph, [n.name for n in graph.nodes])
    return verify_step(graph, memory.peak - memory.persistent_bytes, model, batch, step, seed)


def check_inference_options(loss_fn: Any, training_step: Any, optimizer: Any, max_grad_norm: Any) -> None:
    """An inference plan has no loss and no update: refuse what only a training step takes."""
    given = [
        name
        for name, value in (
            ("loss_fn", loss_fn),
            ("training_step", training_step),
            ("optimizer", optimizer),
            ("max_grad_norm", max_grad_norm),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"inference=True plans the model's forward alone, without loss or update: drop {', '.join(given)}"
        )


def _check_optimizer(model: torch.nn.Module, optimizer: Any, max_grad_norm: float | None) -> None:
    """An optimizer of ``model``'s parameters and a positive ``max_grad_norm`` that goes with one."""
    if max_grad_norm is not None:
        if optimizer is None:
            raise ValueError("max_grad_norm clips the gradients before the optimizer's update: pass optimizer= too")
        if isinstance(max_grad_norm, bool) or not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{type(optimizer).__name__}.step needs a closure that evaluates the loss again (a line search), "
            "and a plan runs one forward and backward per update: optimize without optimizer= and step it "
            "with the plan as its closure (def closure(): optimizer.zero_grad(); return plan(*batch))"
        )
    ours = {id(p) for p in model.parameters()}
    if any(id(p) not in ours for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's: pass the model it trains")


def floor_bytes(graph: Graph, memory: MemoryProfile) -> int:
    """What every plan holds at its end: weights, buffers, inputs, optimizer states and the
    gradients it returns (none of those an optimizer in the plan consumes), or an inference
    plan's outputs."""
    returned = [*graph.signature.gradients.values(), *graph.signature.results]
    storages = {key for node in returned for key in graph.storages[node] if key}
    return memory.persistent_bytes + sum(graph.storage_bytes[key] for key in storages)


def parse_bytes(text: str) -> int:
    """``"6GiB"``, ``"512 MiB"``, ``"2GB"``, ``"1000"`` -> bytes; anything else is a ValueError."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size: use a number of bytes with an optional unit "
            f"({', '.join(u for u in ['B', 'KB', 'MB', 'GB', 'TB', 'KiB', 'MiB', 'GiB', 'TiB'])})"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _objective(
    memory_bytes: Callable[[int], int] | None, latency_limit: float | None, peak: int, latency: float
) -> Objective:
    latency_s = None if latency_limit is None else latency_limit * latency
    if memory_bytes is None:
        return Objective("latency", latency_s=latency * DEFAULT_LATENCY_RATIO if latency_s is None else latency_s)
    return Objective("memory", memory_bytes=memory_bytes(peak), latency_s=latency_s)


def _memory_limit(limit: int | str | float) -> Callable[[int], int]:
    """Check a memory limit (see :func:`optimize`); return the bytes it means for a captured peak."""
    if isinstance(limit, bool) or not isinstance(limit, (int, float, str)):
        raise ValueError(f"memory_limit must be bytes, a size string or a fraction, not {limit!r}")
    if isinstance(limit, float):
        if not 0.0 < limit <= 1.0:
            raise ValueError(
                f"a float memory_limit is a fraction of the captured step's peak, in (0, 1]; got {limit} "
                "(give bytes as an int or a string such as '6GiB')"
            )
        return lambda peak: int(limit * peak)
    value = parse_bytes(limit) if isinstance(limit, str) else limit
    if value <= 0:
        raise ValueError(f"memory_limit must be a positive number of bytes, got {limit!r}")
    return lambda _peak: value


def _infeasible(objective: Objective, peak: int, latency: float, baseline_latency: float, floor: int) -> str:
    parts = []
    if objective.memory_bytes is not None and peak > objective.memory_bytes:
        parts.append(
            f"memory limit {_mib(objective.memory_bytes)} not met: the lowest peak found is {_mib(peak)} "
            f"(floor: {_mib(floor)}: weights, buffers, inputs, optimizer states, gradients or outputs returned)"
        )
    if objective.latency_s is not None and latency > objective.latency_s:
        parts.append(
            f"latency limit {objective.latency_s / baseline_latency:.3f}x not met: the best plan within the "
            f"memory limit takes {latency / baseline_latency:.3f}x the captured step's latency"
        )
    return "; ".join(parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB ({n} bytes)"


def _local_device(model: torch.nn.Module) -> str:
    param = next(model.parameters())
    return "cuda" if param.device.type == "cuda" else "cpu"


def _choices_the_weights_break(graph: Graph, model: torch.nn.Module) -> tuple[str, ...]:
    """The M-Rules whose assumptions ``model``'s weights break now: ``batch-norm-from-output``
    where a weight it would divide by is zero or small beside its bias
    (:func:`~magis.backend.runtime.broken_divisor`)."""
    rewrites = batch_norms_from_outputs(graph)
    if not rewrites:
        return ()
    signature = rewrites[0].graph.signature
    parameters = dict(model.named_parameters(remove_duplicate=False))
    tensors = {node: parameters[name].detach() for node, name in signature.parameters.items() if name in parameters}
    return ("batch-norm-from-output",) if broken_divisor(rewrites[0].graph, tensors) is not None else ()
