"""Serenity's irregularly wired networks as inference workloads (Serenity §4.1; magis.models.irregular)."""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from magis.backend.runtime import run_step
from magis.frontend.capture import capture_forward
from magis.ir.graph import Role
from magis.models import PRESETS, ZOO, build_workload, get_workload
from magis.models.irregular import IRREGULAR_WORKLOADS, RandWire

NAMES = ["darts-imagenet", "swiftnet-hpd", "randwire-cifar10", "randwire-cifar100"]
PAPER_INPUTS = {"darts-imagenet": 224, "swiftnet-hpd": 128, "randwire-cifar10": 32, "randwire-cifar100": 32}
CLASSES = {"darts-imagenet": 1000, "swiftnet-hpd": 2, "randwire-cifar10": 10, "randwire-cifar100": 100}


pytestmark = pytest.mark.usefixtures("one_thread_module")


def test_the_zoo_holds_the_four_as_inference_workloads():
    assert [w.name for w in IRREGULAR_WORKLOADS] == NAMES
    assert all(ZOO[w.name] is w for w in IRREGULAR_WORKLOADS)
    for workload in IRREGULAR_WORKLOADS:
        assert workload.inference and tuple(workload.presets) == PRESETS
        paper = workload.presets["paper"]
        assert (paper["batch"], paper["image"], paper["classes"]) == (
            1,
            PAPER_INPUTS[workload.name],
            CLASSES[workload.name],
        )
        assert workload.presets["small"]["image"] == paper["image"]  # the same network, a larger batch
        assert workload.presets["small"]["batch"] > paper["batch"]


@pytest.mark.parametrize("name", NAMES)
def test_tiny_network_is_in_eval_mode_and_returns_finite_logits(name):
    built = get_workload(name).build("tiny")
    assert built.loss_fn is None
    assert not any(module.training for module in built.model.modules())
    (images,) = built.example_inputs
    with torch.no_grad():
        logits = built.model(images)
    assert logits.shape == (images.shape[0], get_workload(name).presets["tiny"]["classes"])
    assert torch.isfinite(logits).all()
    # Eval mode: batch norm uses its running statistics, so an image's logits do not depend on its batch.
    with torch.no_grad():
        torch.testing.assert_close(built.model(images[:1]), logits[:1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_builds_the_same_weights_and_logits(name):
    workload = get_workload(name)
    a, b, c = workload.build("tiny", seed=3), workload.build("tiny", seed=3), workload.build("tiny", seed=4)
    state_a, state_b, state_c = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert state_a.keys() == state_b.keys() == state_c.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)
    with torch.no_grad():
        assert torch.equal(a.model(*a.example_inputs), b.model(*b.example_inputs))
        assert not torch.equal(a.model(*a.example_inputs), c.model(*c.example_inputs))


@pytest.mark.parametrize("name", ["randwire-cifar10", "randwire-cifar100"])
@pytest.mark.parametrize("preset", ["tiny", "paper"])
def test_randwire_stages_are_the_watts_strogatz_graphs_of_their_seeds(name, preset):
    sizes = get_workload(name).presets[preset]
    network = build_workload(name, preset, None).model
    assert isinstance(network, RandWire)
    node_counts = [sizes["nodes"] // 2, sizes["nodes"], sizes["nodes"]]  # RandWire's small regime, Table 1
    for stage, nodes, seed in zip(network.stages, node_counts, sizes["graph_seeds"], strict=True):
        ws = nx.connected_watts_strogatz_graph(nodes, sizes["k"], sizes["p"], tries=100, seed=seed)
        assert len(stage.nodes) == ws.number_of_nodes() == nodes
        assert len(stage.edges) == ws.number_of_edges() == nodes * sizes["k"] // 2
        assert {frozenset(edge) for edge in stage.edges} == {frozenset(edge) for edge in ws.edges()}
        dag = nx.DiGraph(stage.edges)
        assert all(u < v for u, v in dag.edges) and nx.is_directed_acyclic_graph(dag)
        assert nx.is_weakly_connected(dag)
        # The nodes without a predecessor, and only they, read the stage input, with stride 2.
        sources = {n for n in range(nodes) if dag.in_degree(n) == 0}
        assert sources and {n for n, node in enumerate(stage.nodes) if node.transform[1].stride == (2, 2)} == sources
        assert set(stage.sinks) == {n for n in range(nodes) if dag.out_degree(n) == 0}
    # Each dataset gets its own networks: the two workloads' seeds draw different graphs.
    other = "randwire-cifar100" if name == "randwire-cifar10" else "randwire-cifar10"
    other_network = build_workload(other, preset, None).model
    assert [s.edges for s in network.stages] != [s.edges for s in other_network.stages]


def test_randwire_small_regime_has_the_published_parameter_count():
    """Xie et al. Table 2: RandWire-WS small regime, 5.6M parameters with ImageNet's 1000 classes
    (the CIFAR stem strides differently but has the same weights)."""
    sizes = get_workload("randwire-cifar10").presets["paper"]
    with torch.device("meta"):
        network = RandWire(1000, sizes["channels"], sizes["nodes"], sizes["k"], sizes["p"], sizes["graph_seeds"])
    assert math.isclose(sum(p.numel() for p in network.parameters()), 5.6e6, rel_tol=0.05)


@pytest.mark.parametrize("name", NAMES)
def test_paper_preset_builds_on_fake_tensors_and_runs_there(name):
    built = build_workload(name, "paper", None)
    assert not built.model.training
    assert all(isinstance(p, FakeTensor) for p in built.model.parameters())
    (images,) = built.example_inputs
    assert isinstance(images, FakeTensor) and images.shape == (1, 3, PAPER_INPUTS[name], PAPER_INPUTS[name])
    with torch.no_grad():
        logits = built.model(images)
    assert isinstance(logits, FakeTensor) and logits.shape == (1, CLASSES[name])


# randwire-cifar100 is randwire-cifar10 with other seeds and classes: one RandWire trace suffices.
@pytest.mark.parametrize("name", NAMES[:3])
def test_capture_forward_holds_the_network_and_runs_to_its_logits(name):
    built = get_workload(name).build("tiny")
    model, inputs = built.model, built.example_inputs
    graph = capture_forward(model, inputs).graph
    with torch.no_grad():
        eager = model(*inputs)
    # A forward alone: one aten convolution and one inference batch norm per module, no backward.
    targets = [node.target for node in graph.nodes if node.role is Role.ACTIVATION]
    modules = list(model.modules())
    assert targets.count(torch.ops.aten.convolution.default) == sum(isinstance(m, nn.Conv2d) for m in modules)
    batch_norms = targets.count(torch.ops.aten._native_batch_norm_legit_no_training.default)
    assert batch_norms == sum(isinstance(m, nn.BatchNorm2d) for m in modules)
    assert not any("backward" in str(target) for target in targets)
    # The graph, run on the model's weights, computes eager's logits.
    (logits,) = run_step(graph, model, inputs).outputs
    torch.testing.assert_close(logits, eager)


@pytest.mark.parametrize("name", ["darts-imagenet", "swiftnet-hpd"])
def test_capture_forward_takes_a_paper_preset_on_fake_tensors(name):
    """At paper size (RandWire's paper graphs take long to trace: tiny above)."""
    built = build_workload(name, "paper", None)
    graph = capture_forward(built.model, built.example_inputs).graph
    (logits,) = graph.signature.results
    assert graph[logits].outputs[0].shape == (1, CLASSES[name])
    convolutions = sum(isinstance(m, nn.Conv2d) for m in built.model.modules())
    assert sum(node.target is torch.ops.aten.convolution.default for node in graph.nodes) == convolutions
