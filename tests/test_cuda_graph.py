"""CUDA graphs (issue #30, item 2): a plan's step captured once and replayed on CUDA.

On this CPU: what decides whether a step can be captured, and that a CPU plan says
nothing of graphs. On a GPU (skipped without one): replayed steps give the uncaptured
step's loss and gradients from the same seed, dropout and BatchNorm included, in a
real loop; a swap and a fissioned region survive the capture; a moved parameter is
captured again; the pool the graph holds is measured and reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from conftest import ConvRegressor, regression_step
from torch import nn

import magis
from magis.backend.codegen import generate
from magis.backend.cuda_graph import CudaGraphStep, uncapturable
from magis.backend.eager import compare_gradients
from magis.backend.program import lower
from magis.backend.runtime import bind, run_program
from magis.cost.device_profiles import DEVICE_PROFILES
from magis.cost.latency import AnalyticCostModel
from magis.frontend.capture import capture
from magis.rules.swap import swap

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.fixture(autouse=True)
def deterministic_kernels() -> Iterator[None]:
    """cuDNN's deterministic algorithms: replayed and uncaptured steps are then compared bit for bit."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        yield


def regressor(device: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    batch = (torch.randn(8, 3, 16, 16, device=device), torch.randn(8, device=device))
    return ConvRegressor().to(device), batch


def test_a_plan_on_the_cpu_runs_uncaptured_and_reports_no_graph():
    model, batch = regressor("cpu")
    plan = magis.optimize(model, batch, training_step=regression_step, time_budget=2, progress=False)
    plan(*batch)
    assert not plan.on_cuda
    assert "cuda_graph" not in plan.report().runtime
    with pytest.raises(ValueError, match="cuda_graphs is True or False"):
        magis.optimize(model, batch, training_step=regression_step, time_budget=2, progress=False, cuda_graphs="yes")


def test_what_a_graph_cannot_replay_is_named():
    model, batch = regressor("cpu")
    graph = capture(model, batch, training_step=regression_step)
    step = generate(lower(graph))
    # on the CPU every tensor is off the GPU: the first one is named
    reason = uncapturable(step, bind(graph, model, batch))
    assert reason is not None and "from cpu" in reason
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = magis.optimize(
        model, batch, training_step=regression_step, optimizer=optimizer, time_budget=2, progress=False
    )
    env = bind(plan.graph, model, batch, optimizer)
    assert "optimizer's update" in uncapturable(plan.generated, env)


def replayed_like_uncaptured(model: nn.Module, batch: tuple, graph, order, steps: int = 3) -> CudaGraphStep:
    """Run ``graph`` in ``order`` ``steps`` times replayed and uncaptured from the same seeds and
    buffers: the same loss, gradients and BatchNorm statistics each time."""
    program = lower(graph, order)
    replayed = CudaGraphStep(generate(program), graph.signature.user_inputs)
    plain = generate(program)
    for seed in range(steps):
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        torch.manual_seed(seed)
        expected = run_program(program, model, batch, runtime=plain)
        after_plain = {k: v.clone() for k, v in model.named_buffers()}
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        torch.manual_seed(seed)
        got = run_program(program, model, batch, runtime=replayed)
        assert replayed.fallback is None, replayed.fallback
        versus = compare_gradients(
            {**expected.gradients, "<loss>": expected.loss}, {**got.gradients, "<loss>": got.loss}
        )
        assert versus.same_names and versus.max_error == 0.0, versus.describe()
        for k, v in model.named_buffers():
            assert torch.equal(v, after_plain[k]), k
    assert replayed.captures == 1 and replayed.pool_bytes > 0
    return replayed


@cuda
def test_a_replayed_plan_trains_as_the_uncaptured_plan_in_a_real_loop():
    model, batch = regressor("cuda")
    twin, _ = regressor("cuda")
    plan = magis.optimize(model, batch, training_step=regression_step, time_budget=5, progress=False)
    plans = [plan, dataclasses.replace(plan, model=twin, cuda_graphs=False)]  # one plan, run both ways
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    for seed in range(4):
        losses = []
        for plan, optimizer in zip(plans, optimizers):
            torch.manual_seed(seed)
            losses.append(plan(*batch))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert torch.equal(*losses), seed
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)
    runtime = plans[0].report().runtime["cuda_graph"]
    assert runtime["captured"] and runtime["captures"] == 1 and runtime["pool_bytes"] > 0
    assert plans[1].report().runtime["cuda_graph"]["fallback"] == "off (cuda_graphs=False)"


@cuda
def test_a_swap_survives_the_capture():
    model, batch = regressor("cuda")
    graph = capture(model, batch, training_step=regression_step)
    candidate = max(swap(graph, model=AnalyticCostModel(DEVICE_PROFILES["h100"])), key=lambda c: c.saving)
    replayed_like_uncaptured(model, batch, candidate.graph, candidate.order)


@cuda
def test_a_moved_parameter_is_captured_again():
    model, batch = regressor("cuda")
    plan = magis.optimize(model, batch, training_step=regression_step, time_budget=2, progress=False)
    plan(*batch)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    model.zero_grad(set_to_none=True)
    plan(*batch)
    assert plan.report().runtime["cuda_graph"]["captures"] == 2
