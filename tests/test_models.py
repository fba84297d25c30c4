"""The workload registry (MAGIS §7.1, Table 2) and the random graph generators."""

from __future__ import annotations

import math

import pytest
import torch
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from magis.ir import Role
from magis.models import (
    PRESETS,
    WORKLOADS,
    get_workload,
    random_nasnet_graph,
    random_randwire_graph,
    random_training_graph,
)

NAMES = list(WORKLOADS)

# Published parameter counts (U-Net: Ronneberger et al. at width 64; U-Net++: Zhou et al., Table 1).
PAPER_PARAMETERS = {
    "resnet50": 25.6e6,
    "bert-base": 110e6,
    "vit-base": 86e6,
    "unet": 31.0e6,
    "unetpp": 9.04e6,
    "gpt-neo-1.3b": 1.3e9,
    "btlm-3b": 2.6e9,
}


pytestmark = pytest.mark.usefixtures("one_thread_module")


def test_registry_lists_the_seven_workloads_with_every_preset():
    assert NAMES == ["resnet50", "bert-base", "vit-base", "unet", "unetpp", "gpt-neo-1.3b", "btlm-3b"]
    for workload in WORKLOADS.values():
        assert tuple(workload.presets) == PRESETS
        assert all(sizes["batch"] > 0 for sizes in workload.presets.values())
    paper_batches = {name: w.presets["paper"]["batch"] for name, w in WORKLOADS.items()}
    assert paper_batches == {
        "resnet50": 64,
        "bert-base": 32,
        "vit-base": 64,
        "unet": 32,
        "unetpp": 16,
        "gpt-neo-1.3b": 32,
        "btlm-3b": 32,
    }


@pytest.mark.parametrize("name", NAMES)
def test_tiny_training_step_gives_a_finite_loss_and_every_gradient(name):
    built = get_workload(name).build("tiny")
    assert built.model.training and built.loss_fn is None
    loss = built.model(*built.example_inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in built.model.parameters())
    floats = [t for t in built.example_inputs if t.is_floating_point()]
    assert all(t.dtype == torch.float32 for t in floats)
    assert all(t.dtype == torch.int64 for t in built.example_inputs if not t.is_floating_point())


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_builds_the_same_weights_and_inputs(name):
    workload = get_workload(name)
    a, b, c = workload.build("tiny", seed=3), workload.build("tiny", seed=3), workload.build("tiny", seed=4)
    state_a, state_b, state_c = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs))
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)


@pytest.mark.parametrize("name", NAMES)
def test_batch_override(name):
    built = get_workload(name).build("tiny", batch=3)
    assert all(t.shape[0] == 3 for t in built.example_inputs)


@pytest.mark.parametrize("name", NAMES)
def test_paper_preset_builds_fake_with_the_published_parameter_count(name):
    workload = get_workload(name)
    with FakeTensorMode():
        built = workload.build("paper")
    params = list(built.model.parameters())
    assert all(isinstance(p, FakeTensor) for p in params)
    assert all(isinstance(t, FakeTensor) for t in built.example_inputs)
    assert math.isclose(sum(p.numel() for p in params), PAPER_PARAMETERS[name], rel_tol=0.05)
    assert built.example_inputs[0].shape[0] == workload.presets["paper"]["batch"]


@pytest.mark.parametrize("name", ["bert-base", "gpt-neo-1.3b"])
def test_tiny_traces_into_a_joint_graph(name):
    """The two workloads that needed a fix to pass aot_export_module (see workloads.py)."""

    class Step(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.model(*inputs),)

    built = get_workload(name).build("tiny")
    gm, _ = aot_export_module(Step(built.model), built.example_inputs, trace_joint=True, output_loss_index=0)
    assert len(gm.graph.nodes) > 100


def test_bad_names_presets_and_batches_are_rejected():
    with pytest.raises(ValueError, match=r"resnet50.*btlm-3b"):
        get_workload("resnet-50")
    with pytest.raises(ValueError, match="tiny, small, paper"):
        get_workload("unet").build("huge")
    for batch in (0, -2):
        with pytest.raises(ValueError, match="batch"):
            get_workload("unet").build("tiny", batch=batch)


def _check_valid(graph) -> None:
    assert graph.is_schedule([n.name for n in graph.nodes])
    inputs = [n for n in graph.nodes if n.is_input]
    assert len(inputs) == 2 and all(n.role is Role.INPUT for n in inputs)
    assert graph.outputs == (graph.nodes[-1].name,) and graph.nodes[-1].role is Role.LOSS
    assert all(len(n.outputs) == 1 and n.aliases == (None,) and n.fresh_bytes > 0 for n in graph.nodes)


@pytest.mark.parametrize("cells", [1, 4, 30, 277])
def test_nasnet_graphs_are_valid_dags_of_the_requested_size(cells):
    graph = random_nasnet_graph(cells, seed=cells)
    _check_valid(graph)
    assert sum(n.target == "concat" for n in graph.nodes) == cells
    assert len(graph) == 6 + cells * 18
    if cells >= 3:  # two reduction cells: the feature map shrinks, the channels grow
        stem, last = graph.nodes[2].meta.shape, graph.nodes[-4].meta.shape  # stem and last cell output
        assert last[2] < stem[2] and last[1] > stem[1]


@pytest.mark.parametrize("num_nodes", [12, 30, 500, 5000])
def test_randwire_graphs_are_valid_dags_of_the_requested_size(num_nodes):
    graph = random_randwire_graph(num_nodes, seed=num_nodes)
    _check_valid(graph)
    assert len(graph) == num_nodes
    assert any(len(n.inputs) > 2 for n in graph.nodes), "random wiring gives nodes several inputs"


@pytest.mark.parametrize("generate", [random_nasnet_graph, random_randwire_graph])
def test_random_graphs_are_deterministic_per_seed(generate):
    a, b, c = generate(40, seed=7), generate(40, seed=7), generate(40, seed=8)
    assert a.nodes == b.nodes and a.outputs == b.outputs
    assert a.structural_hash() != c.structural_hash()


def test_random_graph_arguments_are_checked():
    with pytest.raises(ValueError, match="num_cells"):
        random_nasnet_graph(0, seed=0)
    with pytest.raises(ValueError, match="num_nodes"):
        random_randwire_graph(8, seed=0)
    with pytest.raises(ValueError, match="even k"):
        random_randwire_graph(100, seed=0, k=3)


@pytest.mark.parametrize("layers", [1, 5, 40])
def test_training_graphs_save_every_forward_value_for_the_backward(layers):
    graph = random_training_graph(layers, seed=layers)
    assert len(graph) == 2 * layers + 2
    loss = next(n for n in graph.nodes if n.role is Role.LOSS)
    assert graph.outputs == (loss.name, graph.nodes[-1].name) and graph.nodes[-1].role is Role.GRADIENT
    forward = [n.name for n in graph.nodes[: layers + 1]]  # the input and the layers
    for value in forward[:-1]:  # read by a later layer and by a backward node
        assert {graph[c].target for c in graph.consumers[value]} >= {"layer_backward"}
    with pytest.raises(ValueError, match="layers"):
        random_training_graph(0, seed=0)
