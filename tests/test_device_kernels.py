"""What a step does on its device beyond its graph (issue #30): eager's batch-norm kernels and
the operators' workspaces.

On this CPU: the runtime's batch-norm stand-ins give the captured ops' results bit for bit,
and a node's workspace counts in the simulated peak at its step. On a GPU (skipped without
one): a plan of a convolutional network runs cuDNN's batch norm as eager does, trains as
eager does, and its measured peak (cuDNN's convolution workspaces included) is the
simulated one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import magis
from magis.backend.eager import compare_gradients, eager_step
from magis.backend.kernels import batch_norm_backward, batch_norm_forward, runtime_kernel
from magis.backend.meter import peak_meter
from magis.cost.memory import simulate_memory
from magis.cost.op_timing import host_arguments
from magis.cost.workspace import measure_workspaces, with_workspaces
from magis.frontend.capture import capture
from magis.ir.graph import Node, Ref

aten = torch.ops.aten
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class ConvNet(nn.Module):
    """Three convolutions with batch norm: cuDNN's workspaces and batch-norm kernels on CUDA."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for _ in range(3):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def classify(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(images), labels)


def test_the_batch_norm_stand_ins_give_the_captured_ops_results_off_cuda():
    assert runtime_kernel(aten._native_batch_norm_legit_functional.default) is batch_norm_forward
    assert runtime_kernel(aten.native_batch_norm_backward.default) is batch_norm_backward
    assert runtime_kernel(aten.mm.default) is aten.mm.default
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8, 5, 5), torch.rand(8), torch.randn(8)
    mean, var = torch.zeros(8), torch.ones(8)
    ours = batch_norm_forward(x, w, b, mean, var, True, 0.1, 1e-5)
    theirs = aten._native_batch_norm_legit_functional.default(x, w, b, mean, var, True, 0.1, 1e-5)
    assert all(torch.equal(a, c) for a, c in zip(ours, theirs))
    grad = torch.randn_like(x)
    args = (grad, x, w, ours[3], ours[4], ours[1], ours[2], True, 1e-5, [True, True, True])
    assert all(torch.equal(a, c) for a, c in zip(batch_norm_backward(*args), aten.native_batch_norm_backward(*args)))


def test_a_workspace_counts_in_the_peak_at_its_step():
    model = ConvNet(8)
    batch = (torch.randn(2, 3, 8, 8), torch.tensor([1, 2]))
    graph = capture(model, batch, training_step=classify)
    order = [n.name for n in graph.nodes]
    before = simulate_memory(graph, order)
    conv = next(n.name for n in graph.nodes if n.target is aten.convolution.default)
    after = simulate_memory(with_workspaces(graph, {conv: 2**30}), order)
    step = order.index(conv)
    assert after.timeline[step] == before.timeline[step] + 2**30
    assert after.peak == max(before.peak, before.timeline[step] + 2**30)
    with pytest.raises(ValueError, match="CUDA device"):
        measure_workspaces(graph, torch.device("cpu"))


def test_an_attention_backward_reads_its_random_seed_on_the_host():
    """On an H200, timing BERT's ``_scaled_dot_product_efficient_attention_backward`` on a seed
    and offset made on the device crashed the process (a device pointer read as a host one)."""
    target = aten._scaled_dot_product_efficient_attention_backward.default
    names = [a.name for a in target._schema.arguments]
    args = tuple(Ref(f"in_{i}") if i < 9 else value for i, value in enumerate([0] * 9 + [0.1, [True] * 4]))
    node = Node("sdpa_backward", target, args)
    assert host_arguments(node) == {f"in_{names.index('philox_seed')}", f"in_{names.index('philox_offset')}"}
    assert host_arguments(Node("mm", aten.mm.default, (Ref("a"), Ref("b")))) == set()


@cuda
def test_a_plan_on_cuda_runs_cudnn_batch_norm_and_trains_as_eager():
    torch.manual_seed(0)
    model = ConvNet().cuda()
    batch = (torch.randn(16, 3, 32, 32, device="cuda"), torch.randint(0, 10, (16,), device="cuda"))
    reference = eager_step(model, batch, training_step=classify)
    plan = dataclasses.replace(
        magis.optimize(model, batch, training_step=classify, memory_limit=0.8, time_budget=5, progress=False),
        cuda_graphs=False,
    )
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        loss = plan(*batch)
    names = {event.name for event in trace.events()}
    assert "aten::cudnn_batch_norm" in names and "aten::cudnn_batch_norm_backward" in names
    assert "aten::native_batch_norm_backward" not in names
    grads = {name: p.grad for name, p in model.named_parameters()}
    versus = compare_gradients({**reference.gradients, "<loss>": reference.loss}, {**grads, "<loss>": loss})
    assert versus.same_names and versus.max_error < 1e-3


@cuda
def test_a_cuda_plan_measures_the_peak_it_simulates_with_cudnn_workspaces():
    torch.manual_seed(0)
    model = ConvNet(64).cuda()
    batch = (torch.randn(64, 3, 64, 64, device="cuda"), torch.randint(0, 10, (64,), device="cuda"))
    plan = dataclasses.replace(
        magis.optimize(model, batch, training_step=classify, memory_limit=0.8, time_budget=5, progress=False),
        cuda_graphs=False,
    )
    assert any(node.workspace for node in plan.baseline.nodes)  # cuDNN asked for some
    plan(*batch)  # warm-up: cuDNN picks its algorithms
    model.zero_grad(set_to_none=True)
    with peak_meter(model, batch) as meter:
        plan(*batch)
    assert meter.peak_bytes <= 1.02 * plan.peak_bytes
    assert meter.peak_bytes <= 1.02 * plan.objective.memory_bytes
