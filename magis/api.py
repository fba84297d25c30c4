"""The public face of magis: capture a training step, profile it, optimize it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from magis.backend.eager import buffers_snapshot, compare_gradients, eager_step, restore_buffers
from magis.backend.meter import peak_meter
from magis.backend.runtime import run_step
from magis.cost.latency import cost_model, estimate_latency
from magis.cost.memory import MemoryProfile, simulate_memory
from magis.frontend.capture import LossFn, capture, capture_timed
from magis.ir.graph import Graph, Role
from magis.plan import InfeasibleLimit, Plan
from magis.search.m_optimizer import DEFAULT_MAX_STATES, Objective, m_optimize

#: latency limit (ratio to the captured step) when neither limit is given
DEFAULT_LATENCY_RATIO = 1.10
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def is_fake(model: torch.nn.Module) -> bool:
    """True when the model's weights are fake or meta tensors (nothing can run)."""
    return any(isinstance(p, FakeTensor) or p.device.type == "meta" for p in model.parameters())


def profile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: LossFn | None = None,
    run: bool = False,
    device: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Capture the training step and report its size, simulated peak and latency.

    ``device`` names the latency cost model: ``"cpu"``/``"cuda"`` (profiled on this
    machine) or a device profile such as ``"h200"``; by default the local device, or
    ``"h200"`` for a model on fake tensors. With ``run=True`` the step also runs for
    real, through the magis runtime and as plain eager PyTorch, and the report adds
    both measured peaks and the largest relative gradient difference.
    """
    fake = is_fake(model)
    if run and fake:
        raise ValueError("run=True needs real weights: this model is on fake or meta tensors")
    device = device or ("h200" if fake else _local_device(model))
    latency_model = cost_model(device)  # an unknown device fails here, before the capture
    captured = capture_timed(model, example_inputs, loss_fn)
    graph = captured.graph
    order = [n.name for n in graph.nodes]
    start = time.perf_counter()
    memory = simulate_memory(graph, order)
    latency = estimate_latency(graph, order, latency_model)
    report: dict[str, Any] = {
        "model": type(model).__name__,
        "nodes": len(graph),
        "weight_bytes": graph.summary()["weight_bytes"],
        "persistent_bytes": memory.persistent_bytes,
        "simulated_peak_bytes": memory.peak,
        "simulated_latency_s": latency.total_s,
        "device": device,
        "capture_seconds": captured.seconds,
        "simulate_seconds": time.perf_counter() - start,
    }
    if run:
        report.update(measure_against_eager(graph, order, model, example_inputs, loss_fn, seed))
    return report


def measure_against_eager(
    graph: Graph,
    order: Sequence[str],
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: LossFn | None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the step twice from the same state and seed: eager PyTorch, then the magis runtime.

    Returns ``measured_peak_bytes``, ``eager_peak_bytes``, ``max_grad_error`` (the
    loss counts as one more gradient) and the parameters whose gradient only one of
    the two computed: ``missing_gradients`` (eager has one, magis not: that parameter
    would never train) and ``extra_gradients``. With any of those, ``max_grad_error``
    is infinite. The model's buffers are left as before.
    """
    snapshot = buffers_snapshot(model)
    with peak_meter(model, example_inputs) as meter:
        torch.manual_seed(seed)
        reference = eager_step(model, example_inputs, loss_fn)
    eager_peak = meter.peak_bytes
    restore_buffers(model, snapshot)
    constants = [n.target.value for n in graph.nodes if n.role is Role.CONSTANT]
    with peak_meter(model, [*example_inputs, *constants]) as meter:
        torch.manual_seed(seed)
        result = run_step(graph, model, example_inputs, order)
    restore_buffers(model, snapshot)
    comparison = compare_gradients(
        {**reference.gradients, "<loss>": reference.loss}, {**result.gradients, "<loss>": result.loss}
    )
    return {
        "measured_peak_bytes": meter.peak_bytes,
        "eager_peak_bytes": eager_peak,
        "max_grad_error": comparison.max_error if comparison.same_names else float("inf"),
        "missing_gradients": list(comparison.missing),
        "extra_gradients": list(comparison.extra),
    }


def optimize(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: LossFn | None = None,
    *,
    memory_limit: int | str | float | None = None,
    latency_limit: float | None = None,
    time_budget: float = 60.0,
    device: str | None = None,
    seed: int = 0,
    max_states: int = DEFAULT_MAX_STATES,
    progress: bool = True,
) -> Plan:
    """Capture the training step and search for the plan MAGIS Algorithm 3 finds best.

    ``memory_limit`` (memory-limit mode: the lowest latency whose simulated peak fits):
    bytes as an int, a string such as ``"6GiB"``/``"512MiB"``/``"2GB"``, or a float in
    (0, 1], a fraction of the captured step's simulated peak. ``latency_limit``
    (latency-limit mode: the lowest peak within it): a float >= 1, a ratio to the
    captured step's simulated latency. Neither: latency-limit mode at 1.10. Both:
    memory-limit mode, and the plan must meet the latency limit too.

    ``device`` names the latency cost model as in :func:`profile`; on a device profiled
    here (``"cpu"``, ``"cuda"``) the captured step is timed and the operators of the
    graphs the search makes that were never timed are estimated from their kin
    (:class:`~magis.cost.latency.ProfiledCostModel`). The search stops at
    ``time_budget`` seconds or after ``max_states`` states (the bound that keeps it
    deterministic: same inputs, seed and limits give the same plan); it runs with
    torch's generator seeded with ``seed`` and leaves the caller's generator as it
    was; ``progress`` shows a bar with the best peak and latency so far and the states
    explored. A limit no plan meets raises :class:`~magis.plan.InfeasibleLimit`.
    """
    if latency_limit is not None and (isinstance(latency_limit, bool) or not latency_limit >= 1.0):
        raise ValueError(f"latency_limit is a ratio to the captured step's latency, at least 1; got {latency_limit!r}")
    if not time_budget > 0:
        raise ValueError(f"time_budget must be a positive number of seconds, got {time_budget!r}")
    memory_bytes = None if memory_limit is None else _memory_limit(memory_limit)  # bad options fail before capture
    fake = is_fake(model)
    device = device or ("h200" if fake else _local_device(model))
    latency_model = cost_model(device, estimate_unseen=True)  # the captured step is timed, the rest estimated
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        graph = capture(model, example_inputs, loss_fn)
        captured = [n.name for n in graph.nodes]
        memory = simulate_memory(graph, captured)
        latency = estimate_latency(graph, captured, latency_model).total_s
        objective = _objective(memory_bytes, latency_limit, memory.peak, latency)
        floor = floor_bytes(graph, memory)
        if objective.memory_bytes is not None and objective.memory_bytes < floor:
            raise InfeasibleLimit(
                f"memory limit {_mib(objective.memory_bytes)} is below the floor of this step, "
                f"{_mib(floor)} (weights + gradients + inputs)"
            )
        result = m_optimize(graph, objective, latency_model, time_budget, max_states, progress=progress)
    best = result.best
    if not objective.met_by(best):
        raise InfeasibleLimit(_infeasible(objective, best.peak_bytes, best.latency_s, latency, floor))
    return Plan(
        model=model,
        graph=best.graph,
        order=best.order,
        peak_bytes=best.peak_bytes,
        latency_s=best.latency_s,
        baseline_peak_bytes=memory.peak,
        baseline_latency_s=latency,
        device=device,
        objective=objective,
        search=result,
        baseline=graph,
        cost_model=latency_model,
        planning_only=fake,
    )


def floor_bytes(graph: Graph, memory: MemoryProfile) -> int:
    """What every plan holds at its end: weights, buffers, inputs and the gradients."""
    storages = {key for node in graph.signature.gradients.values() for key in graph.storages[node] if key}
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
            f"(floor: {_mib(floor)}, weights + gradients + inputs)"
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
