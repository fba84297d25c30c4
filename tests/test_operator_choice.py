"""MONeT §3's operator choices: in-place activations (magis.rules.in_place) and activation
backwards from their outputs (magis.rules.output_backward): exact on every tiny workload where
they apply, never where a reader needs what they change, and lower peaks measured as simulated."""

from __future__ import annotations

import pytest
import torch
from conftest import ConvRegressor, regression_step
from test_fission import in_float64
from torch import nn

import magis
from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture, capture_forward
from magis.ir.graph import Graph, writes
from magis.models import ZOO
from magis.rules.in_place import IN_PLACE, in_place, in_place_candidates, in_place_rewrites
from magis.rules.output_backward import backward_from_outputs
from magis.rules.swap import Store, de_swap
from magis.search.registry import rules

#: tiny training workloads with activations that nothing but themselves read (ReLU after batch norm);
#: not MobileNetV2, whose ReLU6 (hardtanh) backward reads its input, nor the transformers (GELU's does)
APPLIES = ["resnet50", "unet", "unetpp", "vgg16", "googlenet"]


def order(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes]


def activations_in_place(graph: Graph) -> list:
    """The activations among the operators of ``graph`` that may run in place (their targets)."""
    return [graph[n].target for n in in_place_candidates(graph) if graph[n].target in IN_PLACE]


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.mark.parametrize("name", [n for n in APPLIES if n in ZOO])
def test_every_tiny_workload_where_it_applies_trains_exactly_as_eager(name):
    built = in_float64(ZOO[name].build("tiny", seed=0))
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    names = in_place_candidates(graph)
    assert names, f"{name} has activations that nothing else reads"
    rewritten = in_place(graph, names)
    assert all(writes(rewritten[n]) for n in names)
    activations = [n for n in names if graph[n].target in IN_PLACE]
    assert activations and all(rewritten[n].target is IN_PLACE[graph[n].target] for n in activations)
    before, after = simulate_memory(graph, order(graph)), simulate_memory(rewritten, order(rewritten))
    assert after.peak <= before.peak
    measured = measure_against_eager(rewritten, order(rewritten), built.model, built.example_inputs, built.loss_fn)
    assert measured["max_grad_error"] <= 1e-12 and not measured["missing_gradients"]
    assert measured["measured_peak_bytes"] == after.peak


def test_an_activation_whose_backward_reads_its_input_stays_functional():
    """SiLU's and GELU's backward read their input: in a training step they are not candidates,
    in the forward alone they are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    training = capture(model, (x,), lambda out: out.square().mean())
    assert not activations_in_place(training)
    forward = capture_forward(model.eval(), (x,)).graph
    chosen = in_place_candidates(forward)
    assert set(activations_in_place(forward)) == {torch.ops.aten.silu.default, torch.ops.aten.gelu.default}
    measured = measure_against_eager(in_place(forward, chosen), order(forward), model, (x,), None)
    assert measured["max_output_error"] == 0.0


def peaks_at_relu() -> tuple[nn.Module, torch.Tensor]:
    """A forward that peaks at its ReLU: the upsampled map and its ReLU (in place: one of them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 1), nn.Upsample(scale_factor=4), nn.ReLU(), nn.AvgPool2d(8)).double()
    return model.eval(), torch.randn(2, 3, 8, 8, dtype=torch.float64)


def test_in_place_frees_the_transient_where_it_peaks():
    model, x = peaks_at_relu()
    graph = capture_forward(model, (x,)).graph
    (rewrite,) = in_place_rewrites(graph)
    upsampled, convolved = 2 * 16 * 32 * 32 * 8, 2 * 16 * 8 * 8 * 8
    saved = simulate_memory(graph, order(graph)).peak - simulate_memory(rewrite.graph, order(graph)).peak
    # the new peak is at the upsampling: its input, output and index vectors (32 int64 a side)
    assert saved == upsampled - convolved - 2 * 32 * 8
    measured = measure_against_eager(rewrite.graph, order(graph), model, (x,), None)
    assert measured["max_output_error"] == 0.0
    assert measured["eager_peak_bytes"] - measured["measured_peak_bytes"] == saved


def test_the_search_takes_it_under_a_limit_only_in_place_meets():
    model, x = peaks_at_relu()
    assert "in-place" in {r.name for r in rules()}
    plan = magis.optimize(model, (x,), inference=True, memory_limit=0.6, time_budget=120, max_states=60, progress=False)
    assert any(step.rule in ("in-place", "canonical") for step in plan.search.best.steps)
    with torch.no_grad():
        assert torch.equal(plan(x), model(x))


def test_relu6_backward_from_its_output_drops_the_saved_copies_exactly():
    """MobileNetV2's in-place ReLU6 makes the captured step clone every batch-norm output for the
    backward; read from the ReLU6's output instead, the clones go, bit for bit, and then the
    ReLU6s themselves can run in place."""
    built = in_float64(ZOO["mobilenet-v2"].build("tiny", seed=0))
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    (rewrite,) = backward_from_outputs(graph)
    backwards = [n for n in rewrite.graph.nodes if n.target is torch.ops.aten.hardtanh_backward.default]
    assert backwards and all(rewrite.graph[n.args[1].name].target is torch.ops.aten.hardtanh.default for n in backwards)
    clones = sum(n.target is torch.ops.aten.clone.default for n in graph.nodes)
    assert clones - sum(n.target is torch.ops.aten.clone.default for n in rewrite.graph.nodes) == len(backwards)
    before = simulate_memory(graph, order(graph)).peak
    after = simulate_memory(rewrite.graph, order(rewrite.graph)).peak
    assert after < before
    measured = measure_against_eager(rewrite.graph, order(rewrite.graph), built.model, built.example_inputs, None)
    assert measured["max_grad_error"] == 0.0 and measured["measured_peak_bytes"] == after
    assert not activations_in_place(graph) and len(activations_in_place(rewrite.graph)) == len(backwards)


def test_leaky_relu_backward_from_its_output_is_exact_and_a_negative_slope_is_left_alone():
    torch.manual_seed(0)
    x = torch.randn(8, 16, dtype=torch.float64)
    for slope, applies in ((0.1, True), (-0.5, False)):
        model = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(slope), nn.Linear(32, 4)).double()
        graph = capture(model, (x,), lambda out: out.square().mean())
        found = backward_from_outputs(graph)
        assert bool(found) == applies
        if applies:
            measured = measure_against_eager(
                found[0].graph, order(found[0].graph), model, (x,), lambda out: out.square().mean()
            )
            assert measured["max_grad_error"] == 0.0


def test_a_swapped_tensor_written_over_in_place_is_never_de_swapped():
    """De-swapping would make the Loads' readers read the stored tensor's memory after an
    in-place ReLU wrote over it: the search used to stop there (GraphError: not a topological
    order). Bounded by states, not time: the same search however loaded the machine."""
    torch.manual_seed(0)
    model, batch = ConvRegressor(), (torch.randn(8, 3, 16, 16), torch.randn(8))
    with torch.no_grad():  # a zero weight keeps the batch norm's backward reading its input (as capture made it)
        model.bn.weight[0] = 0.0
    step = regression_step  # under a tight limit the search swaps the batch norm's output, the ReLU overwrites it
    try:
        plan = magis.optimize(
            model,
            batch,
            training_step=step,
            device="h100",
            memory_limit=0.7,
            time_budget=600,
            max_states=80,
            progress=False,
        )
    except magis.InfeasibleLimit as err:  # the lowest peak found: still a plan that runs
        plan = err.best
    assert plan is not None and {"in-place", "swap"} <= {s.rule for s in plan.search.best.steps}
    graph, position = plan.graph, {name: i for i, name in enumerate(plan.order)}
    overwritten = {
        store.name
        for store in graph.nodes
        if isinstance(store.target, Store)
        and any(
            position[w] > position[store.name]
            for key in graph.storages[store.inputs[0]]
            for w in graph.writers.get(key, ())
        )
    }
    undone = {rewrite.description.split()[1].rstrip(":") for rewrite in de_swap(graph, plan.order)}
    assert not undone & {graph[s].inputs[0] for s in overwritten}
    measured = measure_against_eager(plan.graph, plan.order, model, batch, None, training_step=step)
    assert measured["max_grad_error"] < 1e-5
