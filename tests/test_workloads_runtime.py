"""Every tiny workload, dropout live: the runtime equals eager and the simulator equals the meter."""

from __future__ import annotations

import pytest

from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.models import WORKLOADS

#: workloads whose reference configuration trains with dropout (ViT's, GPT-Neo's and BTLM's
#: probabilities are 0: ViT's fused attention then draws nothing and is not random)
WITH_DROPOUT = ("bert-base",)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_tiny_workload_runtime_matches_eager(name):
    built = WORKLOADS[name].build("tiny", seed=0)
    model = built.model
    assert model.training
    graph = capture(model, built.example_inputs, built.loss_fn)
    if name in WITH_DROPOUT:
        assert any(n.random for n in graph.nodes), "the workload's dropout must stay live"
    order = [n.name for n in graph.nodes]
    report = measure_against_eager(graph, order, model, built.example_inputs, built.loss_fn, seed=11)
    assert report["max_grad_error"] < 1e-4, report
    simulated = simulate_memory(graph, order).peak
    measured = report["measured_peak_bytes"]
    assert abs(measured - simulated) <= 0.02 * simulated, (measured, simulated)
