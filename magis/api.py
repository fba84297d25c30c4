"""The public face of magis: capture a training step, profile it, (later) optimize it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from magis.backend.eager import buffers_snapshot, compare_gradients, eager_step, restore_buffers
from magis.backend.meter import peak_meter
from magis.backend.runtime import run_step
from magis.cost.latency import cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.frontend.capture import LossFn, capture_timed
from magis.ir.graph import Graph, Role


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


def _local_device(model: torch.nn.Module) -> str:
    param = next(model.parameters())
    return "cuda" if param.device.type == "cuda" else "cpu"
