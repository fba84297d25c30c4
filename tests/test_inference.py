"""Inference plans (``magis.optimize(..., inference=True)``): the forward alone, planned by the same
search, returns eager's output exactly, within its simulated peak; what only a training step takes
is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import magis
from magis.analysis.dgraph import build_dgraph
from magis.analysis.ftrans import FTrans
from magis.analysis.ftree import build_ftree
from magis.api import measure_against_eager
from magis.cli import main
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture_forward
from magis.frontend.step import CaptureError
from magis.ir.graph import Role
from magis.rules.fission import FissionRegion, fission
from magis.rules.identity import bias_out_rewrites

#: bounded by states, not time (about a second here): the same search on any machine, however loaded
SEARCH = {"time_budget": 600.0, "max_states": 40, "progress": False}
#: float64 rounding of a sum taken in another order (Serenity's channel-wise partitioning)
REORDERED_SUM = 1e-14


class Branchy(nn.Module):
    """A user's network that is not ours: convolutions, batch norm, a residual and a concatenation
    feeding a convolution (Serenity's identity rewrite), dropout, and a structured output."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.left = nn.Conv2d(width, width, 3, padding=1)
        self.right = nn.Conv2d(width, width, 1)
        self.merge = nn.Conv2d(2 * width, width, 1)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(width, 5)

    def forward(self, images: torch.Tensor) -> dict:
        x = torch.relu(self.norm(self.stem(images)))
        y = self.merge(torch.cat([torch.relu(self.left(x)), torch.relu(self.right(x))], dim=1)) + x
        features = self.drop(y)
        return {"logits": self.head(features.mean((2, 3))), "features": (features,)}


def build(train: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Branchy().double().train(train)
    return model, torch.randn(4, 3, 24, 24, dtype=torch.float64)


def eager_output(model: nn.Module, images: torch.Tensor, seed: int) -> tuple[dict, dict]:
    """``model(images)`` under ``no_grad`` from ``seed``, and the model's state after it."""
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model(images)
    return output, {k: v.clone() for k, v in model.state_dict().items()}


def test_capture_forward_holds_no_backward_and_returns_the_output_tensors():
    model, images = build()
    captured = capture_forward(model, (images,))
    graph = captured.graph
    assert graph.signature.inference and not graph.signature.gradients and not graph.signature.loss
    assert {n.role for n in graph.nodes} <= {Role.PARAMETER, Role.BUFFER, Role.INPUT, Role.CONSTANT, Role.ACTIVATION}
    assert graph.outputs == graph.signature.results and len(graph.signature.results) == 2
    leaves = torch.utils._pytree.tree_leaves(model(images))
    assert torch.utils._pytree.tree_structure(model(images)) == captured.output_spec
    assert [graph[r].outputs[0].shape for r in graph.signature.results] == [tuple(t.shape) for t in leaves]


@pytest.mark.parametrize(
    ("device", "rule", "error"),
    [
        # a fission of the batch: every value is computed as eager computes it, so bitwise eager's
        ("a100", "enable", 0.0),
        # the concatenation feeding `merge` partitioned (Serenity Eq. 3-6): `merge` becomes a sum of
        # two partial convolutions, eager's up to that sum's float64 rounding (swaps run as copies)
        ("h100", "concat-conv", REORDERED_SUM),
    ],
)
def test_eval_plan_returns_eager_output_within_its_simulated_peak(tmp_path, device, rule, error):
    model, images = build()
    # an analytic cost model: the plan does not hang on this machine's timings
    plan = magis.optimize(model, (images,), inference=True, memory_limit=0.75, device=device, **SEARCH)
    assert plan.peak_bytes <= plan.objective.memory_bytes < plan.baseline_peak_bytes
    assert plan.report().verified
    steps = [step.rule for step in plan.search.best.steps]
    assert rule in steps
    if "concat-conv" in steps:  # a sum in two parts: eager's up to its rounding, whatever else the plan holds
        error = REORDERED_SUM
    reference, _ = eager_output(model, images, seed=0)
    output = plan(images)
    assert output.keys() == reference.keys()
    torch.testing.assert_close(output["logits"], reference["logits"], rtol=0, atol=error)
    torch.testing.assert_close(output["features"][0], reference["features"][0], rtol=0, atol=error)
    measured = measure_against_eager(plan.graph, plan.order, model, (images,), None)
    assert measured["max_output_error"] <= error
    assert measured["measured_peak_bytes"] == plan.peak_bytes  # the simulator is exact on CPU
    assert measured["eager_peak_bytes"] > plan.peak_bytes

    plan.save(tmp_path / "forward.plan")
    again = magis.load_plan(tmp_path / "forward.plan", model)
    assert torch.equal(again(images)["logits"], output["logits"])


def test_train_mode_forward_draws_eagers_dropout_and_updates_batch_norm_as_eager():
    model, images = build(train=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = magis.optimize(model, (images,), inference=True, latency_limit=1.1, device="h100", **SEARCH)
    assert plan.search.best.steps and "concat-conv" not in [step.rule for step in plan.search.best.steps]
    model.load_state_dict(before)
    reference, eager_state = eager_output(model, images, seed=3)
    model.load_state_dict(before)
    torch.manual_seed(3)
    output = plan(images)
    assert torch.equal(output["features"][0], reference["features"][0])  # the same dropout mask
    for name, value in model.state_dict().items():  # running statistics as eager leaves them
        assert torch.equal(value, eager_state[name]), name
    model.eval()
    with pytest.raises(ValueError, match="mode"):  # planned in train mode: eval mode is refused
        plan(images)


@pytest.mark.parametrize(
    "option", [{"loss_fn": lambda out: out["logits"].sum()}, {"optimizer": "sgd"}, {"max_grad_norm": 1.0}]
)
def test_inference_refuses_what_only_a_training_step_takes(option):
    model, images = build()
    if option.get("optimizer") == "sgd":
        option = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(ValueError, match=rf"inference=True .*drop {next(iter(option))}"):
        magis.optimize(model, (images,), inference=True, **option, **SEARCH)


def test_an_output_that_is_not_tensors_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4))
    model.forward = lambda x: (nn.Sequential.forward(model, x), "label")  # type: ignore[method-assign]
    with pytest.raises(CaptureError, match="output holds a str, which is not a tensor"):
        capture_forward(model, (torch.randn(2, 4),))


class _WithNone(nn.Module):
    """A forward whose output holds ``None`` beside its tensors, as a model returns an auxiliary
    loss only in training (``(logits, None)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple:
        return None, {"logits": self.head(x), "aux": None}, self.head(x).relu()


def test_an_output_holding_none_comes_back_as_eager_returns_it(tmp_path):
    torch.manual_seed(0)
    model, x = _WithNone().eval(), torch.randn(2, 4)
    plan = magis.optimize(model, (x,), inference=True, **SEARCH)
    with torch.no_grad():
        expected = model(x)
    got = plan(x)
    assert got[0] is None and got[1]["aux"] is None
    torch.testing.assert_close(got, expected)
    loaded = magis.load_plan(plan.save(tmp_path / "none.plan"), model)
    torch.testing.assert_close(loaded(x), expected)
    with pytest.raises(CaptureError, match="output holds no tensor"):
        capture_forward(nn.Identity().eval(), ((None,),))


def test_cli_plans_a_users_forward_and_runs_it(tmp_path, capsys):
    module = tmp_path / "users_net.py"
    module.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),\n"
        "                        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()\n"
        "    return net, (torch.randn(4, 3, 32, 32),)\n"
    )
    argv = ["optimize", f"{module}:make", "--inference", "--memory-limit", "0.7", "--time-budget", "5", "--run"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == "inference" and report["peak_ratio"] <= 0.7
    # a plan that splits a convolution sums its parts in another order: float32's rounding (docs/usage.md)
    assert report["max_output_error"] <= 1e-6 and report["measured_peak_bytes"] == report["peak_bytes"]
    assert main(["schedule", f"{module}:make", "--inference", "--json"]) == 0
    scheduled = json.loads(capsys.readouterr().out)
    assert scheduled["step"] == "inference" and scheduled["optimized_peak_bytes"] <= scheduled["captured_peak_bytes"]


class Stem(nn.Module):
    """An image network's stem at batch 1, as an edge device runs it: no batch to split, so a fission
    can only split the first convolution's output channels, which the next convolution sums over."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=bias),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=bias),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean((2, 3)))


@pytest.mark.parametrize("bias", [False, True])
def test_a_batch_of_one_is_split_along_the_channels_its_weights_bring(bias):
    """Algorithm 1 enters a dimension that no user input has (the stem's 16 channels) at the
    operators that compute it, not at the weights that bring it: entered at its weights, each
    weight dominated only its own reader and the channels were never a candidate. Where the
    convolutions keep PyTorch's default bias, ``bias-out`` first adds the second one's bias
    after it, so that it sums over the channels a part computes."""
    torch.manual_seed(0)
    model = Stem(bias).double().eval()
    images = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    graph = capture_forward(model, (images,)).graph
    if bias:
        (rewrite,) = bias_out_rewrites(graph, [n.name for n in graph.nodes])  # the second convolution's
        graph = rewrite.graph
    dgraph = build_dgraph(graph)
    captured = simulate_memory(graph, [n.name for n in graph.nodes])
    first = next(n.name for n in graph.nodes if n.target is torch.ops.aten.convolution.default)
    (channels,) = [c for c in build_ftree(graph, captured, dgraph=dgraph).candidates if first in c.nodes]
    assert channels.length == 16
    split = fission(graph, FTrans(channels.axes, 4), dgraph)
    order = tuple(n.name for n in split.nodes)
    measured = measure_against_eager(split, order, model, (images,), None)
    assert measured["max_output_error"] <= REORDERED_SUM
    assert measured["measured_peak_bytes"] == simulate_memory(split, order).peak < captured.peak


class InvertedResidual(nn.Module):
    """MobileNetV2's block at batch 1: a 1x1 convolution widens 8 channels to 48, a depthwise 3x3
    filters each of them, a 1x1 convolution narrows them back. The 48 wide channels hold the peak."""

    def __init__(self, channels: int = 8, wide: int = 48) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(channels, wide, 1, bias=False),
            nn.BatchNorm2d(wide),
            nn.ReLU6(),
            nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False),
            nn.BatchNorm2d(wide),
            nn.ReLU6(),
            nn.Conv2d(wide, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


def test_a_depthwise_convolution_splits_with_the_channels_it_filters():
    """The wide channels split through the depthwise convolution (one filter per channel,
    ``groups`` divided with them), so one part of the block at a time holds the wide tensors:
    without the depthwise convolution's rule the split stopped before it, and the block's
    peak, the depthwise convolution's input beside its output, stayed whole."""
    torch.manual_seed(0)
    model = InvertedResidual().double().eval()
    x = torch.randn(1, 8, 32, 32, dtype=torch.float64)
    plan = magis.optimize(model, (x,), inference=True, memory_limit=0.6, device="a100", **SEARCH)
    assert plan.peak_bytes <= plan.objective.memory_bytes
    regions = [n.target for n in plan.graph.nodes if isinstance(n.target, FissionRegion)]
    split = [
        (region.parts, node.args[-1])  # the depthwise convolution's groups, one part's
        for region in regions
        for node in region.graph.nodes
        if node.target is torch.ops.aten.convolution.default and node.args[-1] > 1
    ]
    assert split and all(parts * groups == 48 for parts, groups in split)
    with torch.no_grad():
        reference = model(x)
    torch.testing.assert_close(plan(x), reference, rtol=0, atol=REORDERED_SUM)
    measured = measure_against_eager(plan.graph, plan.order, model, (x,), None)
    assert measured["measured_peak_bytes"] == plan.peak_bytes
