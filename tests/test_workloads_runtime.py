"""Every tiny workload, dropout live: the runtime equals eager and the simulator equals the meter."""

from __future__ import annotations

import pytest
import torch

from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.models import WORKLOADS


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_tiny_workload_runtime_matches_eager(name):
    built = WORKLOADS[name].build("tiny", seed=0)
    model = built.model
    assert model.training
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or name in (
        "resnet50",
        "unet",
        "unetpp",
    ), "transformer workloads must keep their dropout live"
    graph = capture(model, built.example_inputs, built.loss_fn)
    order = [n.name for n in graph.nodes]
    report = measure_against_eager(graph, order, model, built.example_inputs, built.loss_fn, seed=11)
    assert report["max_grad_error"] < 1e-4, report
    simulated = simulate_memory(graph, order).peak
    measured = report["measured_peak_bytes"]
    assert abs(measured - simulated) <= 0.02 * simulated, (measured, simulated)
