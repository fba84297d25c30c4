"""The spine: capture, IR invariants, simulator vs runtime, errors that name their cause."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import magis
from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import CaptureError
from magis.frontend.fx_graph import draws_random_numbers
from magis.ir import Graph, Role


def test_capture_marks_roles_aliases_and_randomness(convnet):
    model, inputs, loss_fn = convnet
    graph = magis.capture(model, inputs, loss_fn)
    roles = {n.role for n in graph.nodes}
    assert {Role.PARAMETER, Role.BUFFER, Role.INPUT, Role.ACTIVATION, Role.GRADIENT, Role.LOSS} <= roles
    assert set(graph.signature.gradients) == {name for name, _ in model.named_parameters()}
    assert set(graph.signature.buffer_updates) == {name for name, _ in model.named_buffers()}
    assert any(n.random for n in graph.nodes), "dropout must be marked random"
    views = [n for n in graph.nodes if n.op_name in ("aten.t.default", "aten.view.default", "getitem")]
    assert views and all(a is not None for n in views for a in n.aliases if n.outputs[0] is not None)
    for node in graph.nodes:
        if node.target is not None and hasattr(node.target, "_schema"):
            assert not node.target._schema.is_mutable, f"{node.name} mutates its input"


def test_random_ops_keep_their_relative_order(mlp):
    model, inputs, loss_fn = mlp
    graph = magis.capture(model, inputs, loss_fn)
    randoms = [n.name for n in graph.nodes if n.random]
    assert len(randoms) == 2
    assert graph.order_edges == ((randoms[0], randoms[1]),)


class Attention(nn.Module):
    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.dropout_p = dropout_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p).sum()


def test_fused_attention_is_random_only_with_dropout():
    """Fused attention ops are tagged as seeded; without dropout they draw nothing."""
    graph = magis.capture(Attention(0.0), (torch.randn(2, 5, 8),))
    attention = [n for n in graph.nodes if "attention" in n.op_name]
    assert attention and not any(n.random for n in graph.nodes)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 1, 2, 2)
    assert not draws_random_numbers(flash, (q, q, q), {})
    assert not draws_random_numbers(flash, (q, q, q, 0.0), {})
    assert draws_random_numbers(flash, (q, q, q), {"dropout_p": 0.1})
    assert draws_random_numbers(torch.ops.aten.native_dropout.default, (q, 0.0, True), {})
    assert not draws_random_numbers(torch.ops.aten.mm.default, (q, q), {})


@pytest.mark.parametrize("fixture", ["convnet", "mlp"])
def test_runtime_matches_eager_and_simulator(fixture, request):
    model, inputs, loss_fn = request.getfixturevalue(fixture)
    model.train()
    graph = magis.capture(model, inputs, loss_fn)
    order = [n.name for n in graph.nodes]
    report = measure_against_eager(graph, order, model, inputs, loss_fn, seed=3)
    assert report["max_grad_error"] < 1e-5
    simulated = simulate_memory(graph, order).peak
    assert abs(report["measured_peak_bytes"] - simulated) <= 0.02 * simulated


def test_silu_gradient_is_the_one_kernel_an_eager_backward_runs():
    """The joint trace writes SiLU's gradient in autograd's twice-differentiable form
    (sigmoid, empty_like, fill, sub, three muls, an add); a plain backward runs one
    ``silu_backward``, and so does the captured step (SwiGLU's MLP in BTLM, LLaMA)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 3), nn.SiLU()).double()
    inputs = (torch.randn(5, 6, dtype=torch.float64),)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    graph = magis.capture(model, inputs, loss_fn)
    ops = [n.op_name for n in graph.nodes]
    assert ops.count("aten.silu_backward.default") == 2
    assert "aten.sigmoid.default" not in ops and "aten.fill.Scalar" not in ops
    order = [n.name for n in graph.nodes]
    report = measure_against_eager(graph, order, model, inputs, loss_fn, seed=0)
    assert report["max_grad_error"] < 1e-12
    measured = report["measured_peak_bytes"]
    assert abs(measured - simulate_memory(graph, order).peak) <= 0.02 * measured


def test_runtime_reverse_valid_order_still_exact(mlp):
    """Any valid order gives the same gradients and the simulator follows it."""
    model, inputs, loss_fn = mlp
    graph = magis.capture(model, inputs, loss_fn)
    order = _latest_first_order(graph)
    assert graph.is_schedule(order) and order != [n.name for n in graph.nodes]
    report = measure_against_eager(graph, order, model, inputs, loss_fn, seed=5)
    assert report["max_grad_error"] < 1e-5
    simulated = simulate_memory(graph, order).peak
    assert abs(report["measured_peak_bytes"] - simulated) <= 0.02 * simulated


def _latest_first_order(graph):
    """A valid topological order other than the captured one (Kahn, newest ready node first)."""
    indeg = {n.name: len(graph.predecessors[n.name]) for n in graph.nodes}
    ready = [n for n, d in indeg.items() if d == 0]
    order = []
    while ready:
        v = ready.pop()
        order.append(v)
        for s in graph.successors[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return order


def test_structural_hash_ignores_names_and_order(convnet):
    model, inputs, loss_fn = convnet
    graph = magis.capture(model, inputs, loss_fn)
    assert graph.structural_hash() == magis.capture(model, inputs, loss_fn).structural_hash()
    reordered = Graph(tuple(graph[n] for n in _latest_first_order(graph)), graph.outputs, graph.signature)
    assert reordered.structural_hash() == graph.structural_hash()
    renamed = graph.replace(rename={})  # same graph rebuilt
    assert renamed.structural_hash() == graph.structural_hash()
    relu = next(n for n in graph.nodes if n.op_name == "aten.relu.default")
    sigmoid = dataclasses.replace(relu, target=torch.ops.aten.sigmoid.default)
    swapped = Graph(tuple(sigmoid if n.name == relu.name else n for n in graph.nodes), graph.outputs, graph.signature)
    assert swapped.structural_hash() != graph.structural_hash()


def test_paper_size_capture_on_fake_tensors_allocates_nothing():
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 8192))
        x = torch.randn(4096, 8192)
    graph = magis.capture(model, (x,), lambda out: out.mean())
    peak = simulate_memory(graph, [n.name for n in graph.nodes]).peak
    assert peak > 4 * 8192 * 8192 * 4  # weights + grads alone exceed 1 GiB: nothing was allocated


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # a branch on a tensor's value
            return y.mean()
        return -y.mean()


class NumpyEscape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.from_numpy(self.fc(x).detach().numpy()).sum() + self.fc(x).sum()


def test_data_dependent_control_flow_is_named_with_its_line():
    with pytest.raises(CaptureError, match="data-dependent") as raised:
        magis.capture(DataDependent(), (torch.randn(2, 4),))
    assert "test_capture.py:" in str(raised.value) and "if y.sum() > 0:" in str(raised.value)


def test_a_batch_norm_with_a_cumulative_average_is_refused_at_its_line():
    """``momentum=None`` makes the average factor ``1 / float(num_batches_tracked)``, a Python
    number read from a buffer: refused, naming torch.nn's line, not a constant baked in."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.Flatten(), nn.Linear(64, 2))
    with pytest.raises(CaptureError, match="data-dependent") as raised:
        magis.capture(model, (torch.randn(2, 3, 6, 6),), lambda out: out.sum())
    assert "batchnorm.py:" in str(raised.value) and "num_batches_tracked" in str(raised.value)


def _flip_by_python(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if random.random() < 0.5:  # an augmentation's coin flip: traced once, a constant of the graph
        x = x.flip(-1)
    return nn.functional.cross_entropy(model(x), y)


def _scale_by_numpy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x * float(np.random.uniform(0.9, 1.1))), y)


def _flip_by_torch(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = torch.where(torch.rand(()) < 0.5, x.flip(-1), x)
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize(
    ("step", "generator"),
    [(_flip_by_python, "Python's random module"), (_scale_by_numpy, "NumPy's global generator")],
)
def test_a_step_drawing_from_python_or_numpy_is_refused_and_torchs_draw_is_drawn_at_every_call(step, generator):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    x, y = torch.randn(32, 8, dtype=torch.float64), torch.randint(0, 3, (32,))
    with pytest.raises(CaptureError, match=f"draws from {generator}.* replay it at every call"):
        magis.optimize(model, (x, y), training_step=step, progress=False)
    plan = magis.optimize(model, (x, y), training_step=_flip_by_torch, max_states=4, progress=False)
    losses = set()
    for seed in range(8):  # both sides of the coin, each as eager draws it
        torch.manual_seed(seed)
        expected = float(_flip_by_torch(model, x, y))
        torch.manual_seed(seed)
        losses.add(loss := float(plan(x, y)))
        assert loss == pytest.approx(expected, rel=1e-12)
    assert len(losses) == 2


class _CountsItsCalls(nn.Module):
    """A forward that keeps Python state: a call counter that anneals a temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calls = nn.Linear(8, 3), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) / max(0.1, 1.0 - 0.1 * self.calls)


def test_a_forward_that_changes_python_state_is_refused_naming_it_and_the_model_left_as_it_was():
    model = _CountsItsCalls()
    with pytest.raises(CaptureError, match=r"changed the model \(_CountsItsCalls\)'s attribute 'calls' from 0 to"):
        magis.capture(model, (torch.randn(4, 8),), lambda out: out.sum())
    assert model.calls == 0


def _backward_inside(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()  # the user's whole step, backward included: the plan runs its own
    return loss


def _gradient_penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.requires_grad_()
    out = model(x).sum()
    (grad,) = torch.autograd.grad(out, x, create_graph=True)
    return out + grad.square().sum()


@pytest.mark.parametrize("step", [_backward_inside, _gradient_penalty])
def test_a_step_that_runs_a_backward_itself_is_refused_naming_it(step):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.raises(CaptureError, match=r"the step runs a backward itself \(loss.backward\(\), or torch.autograd"):
        magis.capture(model, (torch.randn(4, 8),), training_step=step)
    assert all(p.grad is None for p in model.parameters())


def test_uncapturable_op_is_named():
    with pytest.raises(CaptureError, match="capture"):
        magis.capture(NumpyEscape(), (torch.randn(2, 4),))


def test_non_scalar_output_without_loss_fn_is_named():
    with pytest.raises(CaptureError, match="loss_fn"):
        magis.capture(nn.Linear(4, 4), (torch.randn(2, 4),))


def test_profile_reports_every_key(convnet):
    model, inputs, loss_fn = convnet
    report = magis.profile(model, inputs, loss_fn, run=True, device="a100").to_dict()
    for key in (
        "model",
        "nodes",
        "weight_bytes",
        "simulated_peak_bytes",
        "simulated_latency_s",
        "capture_seconds",
        "measured_peak_bytes",
        "eager_peak_bytes",
        "max_grad_error",
        "missing_gradients",
        "extra_gradients",
    ):
        assert key in report
    assert report["missing_gradients"] == report["extra_gradients"] == []
    assert report["weight_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert report["max_grad_error"] < 1e-5


def test_profile_rejects_unknown_device(convnet):
    model, inputs, loss_fn = convnet
    with pytest.raises(ValueError, match="h200"):
        magis.profile(model, inputs, loss_fn, device="tpu-v9")


def test_graph_back_to_fx_code_runs_like_the_runtime(convnet):
    from magis.backend.interpreter import execute
    from magis.backend.program import lower
    from magis.backend.runtime import bind
    from magis.ir.fx import to_fx

    model, inputs, loss_fn = convnet
    graph = magis.capture(model, inputs, loss_fn)
    order = _latest_first_order(graph)
    gm = to_fx(graph, order)
    env = bind(graph, model, inputs)
    torch.manual_seed(7)
    with torch.no_grad():
        outs = gm(*(env[name] for name in graph.inputs))
    torch.manual_seed(7)
    expected = execute(lower(graph, order), dict(env))
    assert len(outs) == len(graph.outputs)
    for name, out in zip(graph.outputs, outs):
        torch.testing.assert_close(out, expected[name])


def test_max_relative_error_sees_real_errors_not_round_off():
    from magis.backend.eager import GradientMismatch, max_relative_error

    big = torch.randn(4, 4)
    tiny = torch.full((3,), 1e-12)
    assert max_relative_error({"a": big, "b": tiny}, {"a": big.clone(), "b": tiny.clone()}) == 0.0
    assert max_relative_error({"a": big, "b": tiny}, {"a": big, "b": tiny + 1e-13}) < 1e-6
    assert max_relative_error({"a": big}, {"a": big * 1.01}) == pytest.approx(0.01, rel=1e-3)
    assert max_relative_error({"a": big, "b": tiny}, {"a": big, "b": tiny + 1.0}) > 1.0
    with pytest.raises(GradientMismatch, match="no gradient for a"):
        max_relative_error({"a": big}, {})
    with pytest.raises(GradientMismatch, match="does not compute for b"):
        max_relative_error({"a": big}, {"a": big, "b": tiny})


def test_binding_finds_every_parameter_and_buffer_by_each_of_its_names_and_what_replaced_them():
    from magis.backend.runtime import ModuleTensors

    def module_tensors(model, names):
        return ModuleTensors(model, names).current()

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Sequential(nn.Linear(3, 5, bias=False))
            self.head[0].weight = self.embed.weight
            self.norm = nn.BatchNorm1d(3)
            self.register_buffer("scratch", torch.zeros(2), persistent=False)
            self.register_buffer("absent", None)

    model = Tied()
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    assert "head.0.weight" in params and "scratch" in buffers
    wanted = [(name, "_parameters") for name in params] + [(name, "_buffers") for name in buffers]
    assert module_tensors(model, wanted) == [*params.values(), *buffers.values()]
    missing = ["absent", "norm.weight.x", "tail.weight", "head.1.weight", "norm.running_mean"]
    assert module_tensors(model, [(name, "_parameters") for name in missing]) == [None] * len(missing)
    assert module_tensors(model, [("embed.weight", "_buffers"), ("absent", "_buffers")]) == [None, None]

    # found once, read at each call: a parameter, a submodule on the path, a missing one set since
    found = ModuleTensors(model, [("head.0.weight", "_parameters"), ("norm.running_mean", "_buffers"), *wanted[:1]])
    model.head[0].weight = nn.Parameter(torch.ones(5, 3))
    model.norm = nn.BatchNorm1d(3)
    assert found.current() == [model.head[0].weight, model.norm.running_mean, model.embed.weight]
    model.head = nn.Sequential(nn.Linear(3, 5, bias=False))
    model.head.add_module("1", nn.Linear(5, 5))
    later = ModuleTensors(model, [("head.0.weight", "_parameters"), ("head.1.weight", "_parameters")])
    del model.head[1]
    assert later.current() == [model.head[0].weight, None]
    model.head.add_module("1", nn.Linear(5, 2))
    assert later.current() == [model.head[0].weight, model.head[1].weight]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transformers_attention_is_captured_fused_on_cuda_like_eager():
    """BERT traced as under torch.compile gets an explicit mask broadcast along the keys,
    which CUDA's fused kernels refuse: the capture hands them a contiguous copy, so the
    step runs the memory-efficient kernel as eager does (same dropout, same gradients),
    and the meter counts the step alone, not eager's reference gradients held beside it."""
    from magis.models import WORKLOADS

    built = WORKLOADS["bert-base"].build("small")  # at tiny size cuBLAS' workspace outweighs the step
    model = built.model.cuda()
    batch = tuple(x.cuda() for x in built.example_inputs)
    graph = magis.capture(model, batch, built.loss_fn)
    ops = {n.op_name for n in graph.nodes}
    assert "aten._scaled_dot_product_efficient_attention.default" in ops
    assert "aten._safe_softmax.default" not in ops  # the math path's softmax
    order = [n.name for n in graph.nodes]
    measured = measure_against_eager(graph, order, model, batch, built.loss_fn)
    assert measured["max_grad_error"] <= 1e-3  # dropout live: the kernel's own masks, as eager's
    simulated = simulate_memory(graph, order).peak
    assert measured["measured_peak_bytes"] <= 1.1 * simulated  # cuBLAS' workspace, the allocator's rounding
    assert measured["measured_peak_bytes"] <= 1.1 * measured["eager_peak_bytes"]
