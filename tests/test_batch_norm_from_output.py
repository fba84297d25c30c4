"""MONeT §3's batch norm backward from its output (magis.rules.output_backward): a BN-ReLU unit
keeps only the batch norm's output for both backwards. Gradients as eager's within rounding on
every tiny workload where it applies, measured = simulated peak, the weights it divides by checked
at every step, and a plan whose weights break it made again by magis.planned."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_fission import in_float64
from torch import nn

import magis
from magis import DivisorError
from magis.api import measure_against_eager
from magis.backend.runtime import DIVISOR_RATIO
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.models import ZOO
from magis.rules.output_backward import BATCH_NORM, BATCH_NORM_BACKWARD, batch_norms_from_outputs

pytestmark = pytest.mark.usefixtures("one_thread_module")

#: the zoo's tiny workloads with batch norm before ReLU (ResNet-50, GoogLeNet) or ReLU6 (MobileNetV2)
APPLIES = ["resnet50", "googlenet", "mobilenet-v2"]
#: a repeatable search: priced by an analytic profile, not by timings on a machine that may be
#: busy (under load the measured costs once made the search pass the rewrite by); it takes the
#: rewrite on this net at this limit
ESTIMATED = {"latency_limit": 1.3, "max_states": 20, "timed": False, "device": "h100"}


def order(graph):
    return [n.name for n in graph.nodes]


@pytest.mark.parametrize("name", APPLIES)
def test_every_tiny_workload_where_it_applies_has_eagers_gradients(name):
    """float64: the reconstructed normalised input rounds differently (relative 1e-16 an element);
    a channel's weight gradient sums it over the batch with cancellation, hence 1e-9."""
    built = in_float64(ZOO[name].build("tiny", seed=0))
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    (rewrite,) = batch_norms_from_outputs(graph)
    rewritten = rewrite.graph
    outputs = {c for n in rewritten.nodes if n.target is BATCH_NORM for c in rewritten.successors[n.name]}
    from_output = [n for n in rewritten.nodes if n.target is BATCH_NORM_BACKWARD and n.args[1].name in outputs]
    assert from_output and len(rewritten.signature.divided_by) == len(from_output)
    assert rewrite.order == tuple(order(rewritten)) or rewritten.is_schedule(rewrite.order)
    after = simulate_memory(rewritten, list(rewrite.order))
    assert after.peak <= simulate_memory(graph, order(graph)).peak
    measured = measure_against_eager(rewritten, rewrite.order, built.model, built.example_inputs, built.loss_fn)
    assert measured["max_grad_error"] <= 1e-9 and not measured["missing_gradients"]
    assert measured["measured_peak_bytes"] == after.peak


@pytest.mark.parametrize(
    "after, rewritten",
    [(nn.SiLU, 2), (nn.GELU, 2), (nn.Hardswish, 2), (nn.Identity, 2), (nn.Tanh, 0)],
    ids=["silu", "gelu", "hardswish", "next-convolution", "tanh"],
)
def test_a_batch_norm_whose_output_a_backward_reads_already_frees_its_input(after, rewritten):
    """SiLU's, GELU's and hardswish's backward read their input, as do a convolution's and the
    squared loss's: the batch norm's output is saved already, and its input need not be. Tanh's
    reads its output: the batch norm's output would be saved for nothing. (Within 1e-9 in
    float64, as above.)"""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), after(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), after()
    ).double()
    x = torch.randn(4, 3, 10, 10, dtype=torch.float64)
    graph = capture(model, (x,), lambda out: out.square().mean())
    found = batch_norms_from_outputs(graph)
    assert len(found[0].graph.signature.divided_by if found else ()) == rewritten
    if found:
        (rewrite,) = found
        peak = simulate_memory(rewrite.graph, list(rewrite.order)).peak
        measured = measure_against_eager(rewrite.graph, rewrite.order, model, (x,), lambda out: out.square().mean())
        assert measured["max_grad_error"] <= 1e-9 and measured["measured_peak_bytes"] == peak


class ConvNet(nn.Module):
    """Conv-BN-ReLU twice (one batch norm without affine weights), a residual sum, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, affine=False)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        return self.head(y.mean((2, 3)))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(4, 3, 12, 12, dtype=torch.float64), torch.randint(0, 5, (4,))


def classify(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), labels)


def plan_of(model: nn.Module):
    return magis.optimize(model, batch(), training_step=classify, progress=False, **ESTIMATED)


def test_a_users_model_trains_through_it_as_eager_until_a_weight_breaks_it():
    torch.manual_seed(0)
    model = ConvNet().double()
    with torch.no_grad():  # signed weights and biases, as trained ones are
        model.bn1.weight.uniform_(-2, 2).clamp_(min=0.25).mul_(torch.randn(8).sign())
        model.bn1.bias.uniform_(-1, 1)
    reference = copy.deepcopy(model)
    plan = plan_of(model)
    assert plan.report().transformations["divides_by"] == ["bn1.weight"]  # bn2 has no weight
    adam, eager_adam = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(reference.parameters(), 1e-2)
    x, y = batch()
    for _ in range(3):
        loss = plan(x, y)
        eager = classify(reference, x, y)
        eager.backward()
        assert abs(loss.item() - eager.item()) < 1e-12
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12)
        adam.step(), eager_adam.step()
        adam.zero_grad(), eager_adam.zero_grad()
    grads_before = model.bn1.weight.grad
    with torch.no_grad():
        model.bn1.weight[3] = 0.0
    with pytest.raises(DivisorError, match=r"'bn1.weight'.*channel 3 has weight 0"):
        plan(x, y)
    assert model.bn1.weight.grad is grads_before  # refused before anything ran
    with torch.no_grad():
        model.bn1.weight[3] = 1e-3
        model.bn1.bias[3] = 1.5 * DIVISOR_RATIO * 1e-3  # small beside its bias: the division would magnify rounding
    with pytest.raises(DivisorError, match="channel 3"):
        plan(x, y)


def test_weights_that_break_it_at_planning_leave_it_out_and_a_zero_weight_learns_as_in_eager():
    """torchvision's zero_init_residual starts batch norm weights at 0: the plan must not divide by
    them, and their gradient (the only way they leave 0) must be eager's."""
    torch.manual_seed(0)
    model = ConvNet().double()
    nn.init.zeros_(model.bn1.weight)
    nn.init.constant_(model.bn1.bias, 0.5)  # the ReLU passes the gradient on
    reference = copy.deepcopy(model)
    plan = plan_of(model)
    assert not plan.graph.signature.divided_by
    x, y = batch()
    plan(x, y)
    classify(reference, x, y).backward()
    assert model.bn1.weight.grad.abs().min() > 0
    assert torch.allclose(model.bn1.weight.grad, reference.bn1.weight.grad, rtol=0, atol=1e-12)


def test_magis_planned_plans_again_when_the_weights_break_it(tmp_path):
    torch.manual_seed(0)
    model = ConvNet().double()
    reference = copy.deepcopy(model)
    step = magis.planned(model, training_step=classify, cache_dir=tmp_path, **ESTIMATED)
    x, y = batch()
    step(x, y)
    assert step.searches == 1 and step.plan_for(x, y).graph.signature.divided_by
    for module in (model, reference):
        with torch.no_grad():
            module.bn1.weight[0] = 0.0
        module.zero_grad()
    with pytest.warns(UserWarning, match="planning again.*'bn1.weight'"):
        loss = step(x, y)
    assert step.searches == 2 and not step.plan_for(x, y).graph.signature.divided_by
    eager = classify(reference, x, y)
    eager.backward()
    assert abs(loss.item() - eager.item()) < 1e-12
    assert torch.allclose(model.bn1.weight.grad, reference.bn1.weight.grad, rtol=0, atol=1e-12)
    with warnings.catch_warnings():  # the plan written over the broken one is read as it is
        warnings.simplefilter("error")
        again = magis.planned(model, training_step=classify, cache_dir=tmp_path, **ESTIMATED)
        again(x, y)
    assert again.loaded == 1 and again.searches == 0
