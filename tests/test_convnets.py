"""MONeT's convolutional workloads (ICLR'22 §5): VGG-16, MobileNetV2 and GoogLeNet are the published
networks at paper size, train at tiny size, and magis plans each one exactly as eager PyTorch runs it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import magis
from magis.models import CONVNET_WORKLOADS, ZOO, build_workload

NAMES = [w.name for w in CONVNET_WORKLOADS]

#: Parameters at 1000 classes, in millions to the published precision (torchvision's model
#: table, which MONeT traced: VGG-16 138.36M, MobileNetV2 3.50M, GoogLeNet without aux 6.62M)
PUBLISHED_MILLIONS = {"vgg16": 138.36, "mobilenet-v2": 3.50, "googlenet": 6.62}

#: Where the M-Optimizer does not reach 0.8 of the peak within the test's 2 s: batch norm couples
#: the samples (no fission along the batch), and on these two graphs (over 1,000 nodes) the
#: first level of the search spends the budget on F-Tree roots and its recompute and swap
#: greedies make no state (the search's open gap; 20 s find nothing either)
SEARCH_GAP = {
    "mobilenet-v2": "the search finds no plan below the captured peak within 2 s (batch norm: no fission)",
    "googlenet": "the search finds no plan below the captured peak within 2 s (batch norm: no fission)",
}


pytestmark = pytest.mark.usefixtures("one_thread_module")


def test_the_zoo_holds_the_three():
    assert NAMES == ["vgg16", "mobilenet-v2", "googlenet"]
    assert all(ZOO[name] is workload for name, workload in zip(NAMES, CONVNET_WORKLOADS))


@pytest.mark.parametrize("name", NAMES)
def test_paper_size_has_the_published_parameters_and_classifies_224_pixel_images(name):
    """Built on fake tensors at MONeT's batch: the parameter count, rounded as published, and
    one forward pass from (batch, 3, 224, 224) images to (batch, 1000) logits."""
    built = build_workload(name, "paper", None)
    network = built.model.network
    parameters = sum(p.numel() for p in network.parameters())
    assert round(parameters / 1e6, 2) == PUBLISHED_MILLIONS[name]
    images, labels = built.example_inputs
    assert images.shape[1:] == (3, 224, 224) and labels.shape == images.shape[:1]
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert network(images).shape == (images.shape[0], 1000)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_step_is_finite_and_reaches_every_parameter(name):
    built = build_workload(name, "tiny", None)
    loss = built.model(*built.example_inputs)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    parameters = list(built.model.named_parameters())
    for parameter_name, parameter in parameters:
        assert parameter.grad is not None, parameter_name
        assert torch.isfinite(parameter.grad).all(), parameter_name
    # the gradient reaches the first convolution, farthest from the loss (some batch-norm biases
    # get exactly zero: on 1x1 feature maps every path back from them ends in a batch norm,
    # whose input gradient sums to zero over the batch)
    assert parameters[0][0].endswith("0.weight") and parameters[0][1].grad.abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_a_plan_for_0_8_of_the_peak_gives_eagers_loss_gradients_and_batch_statistics(name):
    """Tiny at eight times the tiny batch (at the tiny batch the weights and their gradients alone
    take over 0.8 of the step), float64, dropout live: the plan's loss, every gradient and every
    batch-norm buffer (running mean, variance, count) equal eager's from the same seed, to 1e-9
    relative; and the plan is within 0.8 of the captured step's peak (xfail where :data:`SEARCH_GAP`
    says why not: that plan, the best found, is still checked against eager first)."""
    built = build_workload(name, "tiny", 8 * ZOO[name].presets["tiny"]["batch"])
    model = built.model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in built.example_inputs)
    reference = copy.deepcopy(model)  # before planning: batch norm's statistics move with each step
    try:
        plan = magis.optimize(model, inputs, memory_limit=0.8, time_budget=2, device="h200", progress=False)
    except magis.InfeasibleLimit as err:
        plan = err.best

    torch.manual_seed(7)  # the same dropout masks in both steps
    expected = reference(*inputs)
    expected.backward()
    torch.manual_seed(7)
    got = plan(*inputs)

    assert got.item() == pytest.approx(expected.item(), rel=1e-9)
    for (key, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12, msg=key)
    for (key, a), (_, b) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=key)
    if plan.peak_bytes > 0.8 * plan.baseline_peak_bytes and name in SEARCH_GAP:
        pytest.xfail(SEARCH_GAP[name])
    assert plan.peak_bytes <= 0.8 * plan.baseline_peak_bytes
