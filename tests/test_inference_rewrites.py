"""Rewrites that cost no time and lower a forward's peak (Serenity's networks, issue #31): batch norm,
sums and multiply-adds run in place (magis.rules.in_place), concatenations moved past the
per-channel operators reading them (magis.rules.identity.sink_concat), sums of products fused
(magis.rules.multiply_add), every repeated operator computed once (magis.rules.remat.de_remat),
pointwise convolutions of one sample as matrix products (magis.rules.pointwise_matmul).
Each on a user's module against eager: exact where the kernels are eager's, within float64
rounding where a sum changes order; the measured peak is the simulated one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import magis
from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture, capture_forward
from magis.ir.graph import Graph, writes
from magis.models import ZOO
from magis.rules.canonical import canonical, canonical_rewrites
from magis.rules.concat_in_place import concat_in_place, concat_in_place_rewrites, find_concats_in_place
from magis.rules.identity import concat_sink_rewrites, find_concat_sinks, sink_concat
from magis.rules.in_place import EVAL_BATCH_NORM_INTO, in_place, in_place_candidates, in_place_rewrites
from magis.rules.multiply_add import find_multiply_adds, fuse_multiply_adds, multiply_add_rewrites
from magis.rules.pointwise_matmul import as_matmuls, find_pointwise_convolutions, pointwise_matmul_rewrites
from magis.rules.remat import de_remat
from magis.schedule import schedule

aten = torch.ops.aten

#: float64 rounding of a sum taken in another order, or rounded once where eager rounds twice
ROUNDING = 1e-13
SEARCH = {"time_budget": 600.0, "max_states": 40, "progress": False}

pytestmark = pytest.mark.usefixtures("one_thread_module")


def order(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes]


def eval_model(model: nn.Module) -> nn.Module:
    """``model`` in float64 and eval mode, its batch norms with running statistics that are not
    the identity's."""
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.uniform_(module.bias, -1, 1)
    return model.double().eval()


def measured(graph: Graph, schedule_order: list[str], model: nn.Module, x: torch.Tensor) -> tuple[int, float]:
    """The simulated peak of ``graph`` in ``schedule_order``, checked against the measured one, and
    the largest difference from eager's output."""
    result = measure_against_eager(graph, schedule_order, model, (x,), None)
    peak = simulate_memory(graph, schedule_order).peak
    assert result["measured_peak_bytes"] == peak
    return peak, result["max_output_error"]


def test_an_eval_batch_norm_writes_into_the_convolution_it_normalises():
    model = eval_model(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)))
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    rewritten = in_place(graph, in_place_candidates(graph))
    (norm,) = [n for n in rewritten.nodes if n.target is EVAL_BATCH_NORM_INTO]
    assert graph[writes(norm)[0]].target is aten.convolution.default
    before, error_before = measured(graph, order(graph), model, x)
    after, error = measured(rewritten, order(rewritten), model, x)
    assert error == error_before == 0.0
    # one 8-channel map less where the two lived beside each other; the 4-channel output beside
    # the rectified map is the peak now
    assert before - after == 2 * 8 * 16 * 16 * 8 - 2 * 4 * 16 * 16 * 8


class Residual(nn.Module):
    """``a`` feeds a ReLU and the sum: the sum writes into its other term, and no ReLU of ``a``
    may run in place even after the sum does (it reads ``a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.first(x)
        return torch.relu(a + self.second(torch.relu(a))).mean((2, 3))


def test_a_sum_writes_into_whichever_term_nothing_else_reads():
    model = eval_model(Residual())
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    rewritten = in_place(graph, in_place_candidates(graph))
    (total,) = [n for n in rewritten.nodes if n.target is aten.add_.Tensor]
    assert graph[writes(total)[0]].target is aten.convolution.default and writes(total)[0] != "convolution"
    # a second pass over the rewritten graph sees the in-place sum read ``a``
    assert not in_place_candidates(rewritten)
    assert measured(rewritten, order(rewritten), model, x)[1] == 0.0


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return (y + y.transpose(2, 3)).sum((2, 3))


def test_a_sum_never_writes_a_tensor_it_also_reads_through_a_view():
    model = eval_model(Transposed())
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    assert not [n for n in in_place_candidates(graph) if graph[n].target is aten.add.Tensor]


class ConcatSeparable(nn.Module):
    """A NAS cell's node: concatenate two states, depthwise 3x3, batch norm, ReLU, 1x1 convolution."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, width, 1), nn.Conv2d(3, width, 3, padding=1)
        self.depthwise = nn.Conv2d(2 * width, 2 * width, 3, padding=1, groups=2 * width, bias=False)
        self.norm = nn.BatchNorm2d(2 * width)
        self.pointwise = nn.Conv2d(2 * width, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([self.a(x), self.b(x)], dim=1)
        return self.pointwise(torch.relu(self.norm(self.depthwise(joined))))


def test_a_concatenation_moves_past_depthwise_batch_norm_and_relu_into_partial_convolutions():
    model = eval_model(ConcatSeparable())
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    (rewrite,) = concat_sink_rewrites(graph)
    assert not any(n.target is aten.cat.default for n in rewrite.graph.nodes)
    assert sum(n.target is aten.convolution.default for n in rewrite.graph.nodes) == 2 + 2 + 2  # a, b; per part
    before, _ = measured(graph, schedule(graph, 5).order, model, x)
    after, error = measured(rewrite.graph, schedule(rewrite.graph, 5).order, model, x)
    assert after < before and error <= ROUNDING


def test_a_concatenation_read_across_its_channels_stays():
    class Summed(ConcatSeparable):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(torch.cat([self.a(x), self.b(x)], dim=1)).sum(1)

    model = eval_model(Summed())
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    (concat,) = find_concat_sinks(graph)  # past the ReLU, not the sum over channels
    moved = sink_concat(graph, concat)
    (joined,) = [n for n in moved.nodes if n.target is aten.cat.default]
    assert {moved[r].target for r in moved.consumers[joined.name]} == {aten.sum.dim_IntList}
    assert measured(moved, order(moved), model, x)[1] == 0.0


class WeightedSum(nn.Module):
    """RandWire's aggregation: a sigmoid-weighted sum of three branches, then ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Conv2d(3, 6, k, padding=k // 2) for k in (1, 3, 5))
        self.edge_weights = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.sigmoid(self.edge_weights)
        total = sum(weights[i] * branch(x) for i, branch in enumerate(self.branches))
        return torch.relu(total).mean((2, 3))


def test_a_weighted_sum_accumulates_into_one_tensor():
    model = eval_model(WeightedSum())
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    found = find_multiply_adds(graph)
    assert len(found) == 2  # w0*b0 + w1*b1, then + w2*b2 (``sum`` starts from 0: a scalar add stays)
    fused = fuse_multiply_adds(graph, found)
    assert sum(n.target is aten.mul.Tensor for n in fused.nodes) == sum(
        n.target is aten.mul.Tensor for n in graph.nodes
    ) - len(found)
    (rewrite,) = in_place_rewrites(fused)
    assert sum(n.target is aten.addcmul_.default for n in rewrite.graph.nodes) == 2
    before, _ = measured(graph, schedule(graph, 5).order, model, x)
    after, error = measured(rewrite.graph, schedule(rewrite.graph, 5).order, model, x)
    assert after < before and error <= ROUNDING


class SharedReLU(nn.Module):
    """Three operations that each begin by rectifying the same state (a DARTS cell's)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.ops = nn.ModuleList(nn.Sequential(nn.ReLU(), nn.Conv2d(6, 6, k, padding=k // 2)) for k in (1, 3, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.stem(x)
        return sum(op(state) for op in self.ops).mean((2, 3))


def test_every_repeated_operator_is_computed_once_in_one_rewrite():
    model = eval_model(SharedReLU())
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    every = [r for r in de_remat(graph) if r.description.startswith("de-remat every")]
    assert len(every) == 1
    merged = every[0].graph
    assert sum(n.target is aten.relu.default for n in merged.nodes) == 1
    rewritten = in_place(merged, in_place_candidates(merged))  # the one ReLU is now the state's only reader
    assert any(n.target is aten.relu_.default for n in rewritten.nodes)
    before, _ = measured(graph, schedule(graph, 5).order, model, x)
    after, error = measured(rewritten, schedule(rewritten, 5).order, model, x)
    assert after < before and error == 0.0


class Bands(nn.Module):
    """Three maps stacked along the rows (a tiled convolution's bands), rectified, pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.bands = nn.ModuleList(nn.Conv2d(3, 8, k, padding=k // 2) for k in (1, 3, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.cat([band(x) for band in self.bands], dim=2)).mean((2, 3))


def test_a_concatenation_assembled_in_place_holds_one_part_beside_the_result():
    model = eval_model(Bands())
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    (concat,) = find_concats_in_place(graph)
    assembled = concat_in_place(graph, concat)
    assert sum(n.target is aten.copy_.default for n in assembled.nodes) == 3
    rewritten = in_place(assembled, in_place_candidates(assembled))  # the ReLU then writes the result
    assert any(n.target is aten.relu_.default for n in rewritten.nodes)
    band = 8 * 16 * 16 * 8
    before, _ = measured(graph, schedule(graph, 5).order, model, x)
    after, error = measured(rewritten, schedule(rewritten, 5).order, model, x)
    assert error == 0.0
    # before: three bands and their concatenation, then it and its ReLU; after: the result and one band
    assert before - after == 6 * band - 4 * band


class Pointwise(nn.Module):
    """1x1 convolutions with and without a bias, beside ones that are no matrix product of the
    map (3x3, strided, grouped)."""

    def __init__(self) -> None:
        super().__init__()
        self.spatial = nn.Conv2d(3, 8, 3, padding=1)
        self.mix = nn.Conv2d(8, 8, 1)
        self.project = nn.Conv2d(8, 4, 1, bias=False)
        self.strided = nn.Conv2d(4, 4, 1, stride=2)
        self.grouped = nn.Conv2d(4, 4, 1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(torch.relu(self.mix(self.spatial(x))))
        return self.grouped(self.strided(y))


def test_a_pointwise_convolution_of_one_sample_runs_as_a_matrix_product():
    model = eval_model(Pointwise())
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    found = find_pointwise_convolutions(graph)
    assert len(found) == 2  # mix and project; not the 3x3, strided or grouped ones
    rewritten = as_matmuls(graph, found)
    targets = [n.target for n in rewritten.nodes]
    assert targets.count(aten.convolution.default) == 3
    assert targets.count(aten.addmm.default) == 1 and targets.count(aten.mm.default) == 1
    _, error = measured(rewritten, order(rewritten), model, x)
    assert error <= ROUNDING
    # more than one sample, or a training step: no rewrite
    assert not find_pointwise_convolutions(capture_forward(model, (torch.cat([x, x]),)).graph)
    assert not find_pointwise_convolutions(capture(model, (x,), lambda out: out.sum()))


def test_partial_products_of_a_partitioned_convolution_accumulate_into_one_matrix():
    model = ConcatSeparable()
    model.pointwise = nn.Conv2d(8, 32, 1)  # outputs wider than the parts: the partial products set the peak
    model = eval_model(model)
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    (sunk,) = concat_sink_rewrites(graph)
    products = as_matmuls(sunk.graph, find_pointwise_convolutions(sunk.graph))
    found = find_multiply_adds(products)
    assert len(found) == 1  # the pointwise convolution's two parts: one sum
    (summed,) = in_place_rewrites(products)
    (accumulated,) = in_place_rewrites(fuse_multiply_adds(products, found))
    targets = [n.target for n in accumulated.graph.nodes]
    assert targets.count(aten.addmm_.default) == 1 and aten.mm.default not in targets
    assert aten.add.Tensor not in targets and aten.add_.Tensor not in targets
    before, _ = measured(summed.graph, schedule(summed.graph, 5).order, model, x)
    after, error = measured(accumulated.graph, schedule(accumulated.graph, 5).order, model, x)
    assert after < before and error <= ROUNDING


class ResidualMatmul(nn.Module):
    """A residual sum of a matrix product (no bias), beside one whose product another op reads."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.mm(torch.tanh(x), self.inner)
        shared = torch.mm(h, self.outer)
        return h + shared + shared.exp()


def test_a_sum_of_a_matrix_product_runs_as_one_addmm():
    model = ResidualMatmul().double().eval()
    x = torch.randn(4, 8, dtype=torch.float64)
    graph = capture_forward(model, (x,)).graph
    found = find_multiply_adds(graph)
    assert len(found) == 1  # not the product that exp also reads
    fused = fuse_multiply_adds(graph, found)
    assert [n.target for n in fused.nodes].count(aten.mm.default) == 1
    assert [n.target for n in fused.nodes].count(aten.addmm.default) == 1
    _, error = measured(fused, order(fused), model, x)
    assert error <= ROUNDING


@pytest.mark.parametrize("name", ["darts-imagenet", "swiftnet-hpd", "randwire-cifar10"])
@pytest.mark.parametrize(
    "rule",
    [
        concat_sink_rewrites,
        concat_in_place_rewrites,
        multiply_add_rewrites,
        pointwise_matmul_rewrites,
        de_remat,
        in_place_rewrites,
        canonical_rewrites,
    ],
)
def test_each_rewrite_of_a_tiny_serenity_network_runs_as_simulated(name, rule):
    built = ZOO[name].build("tiny", seed=0)
    model = built.model.double()
    (x,) = (t.double() for t in built.example_inputs)
    graph = capture_forward(model, (x,)).graph
    rewrites = rule(graph)
    for rewrite in rewrites[-1:]:  # de-remat: every duplicate at once
        _, error = measured(rewrite.graph, schedule(rewrite.graph, 5).order, model, x)
        assert error <= ROUNDING


def test_the_search_plans_a_serenity_network_with_them_and_runs_it_as_eager():
    built = ZOO["swiftnet-hpd"].build("tiny", seed=0)
    model, (x,) = built.model, built.example_inputs
    # an analytic cost model: the search does not hang on this machine's timings
    plan = magis.optimize(model, (x,), inference=True, latency_limit=1.5, device="a100", **SEARCH)
    assert plan.search.stats.rules.get("canonical")  # states reached through it were simulated
    graph = capture_forward(model, (x,)).graph
    rewritten = canonical(graph)
    assert plan.peak_bytes <= simulate_memory(rewritten, schedule(rewritten, 5).order).peak
    with torch.no_grad():
        torch.testing.assert_close(plan(x), model(x), rtol=1e-5, atol=1e-6)


def test_the_rewrites_at_once_keep_a_training_steps_gradients():
    """A language model's step: concatenations with empty 1-D parts (which ``cat`` skips) are
    left alone, the forward's sums go in place, the gradients stay eager's."""
    built = ZOO["gpt-neo-1.3b"].build("tiny", seed=0)
    model = built.model.double()
    graph = capture(model, built.example_inputs, built.loss_fn)
    rewritten = canonical(graph)
    assert any(writes(n) for n in rewritten.nodes)
    schedule_order = schedule(rewritten, 5).order
    result = measure_against_eager(rewritten, schedule_order, model, built.example_inputs, built.loss_fn)
    assert result["measured_peak_bytes"] == simulate_memory(rewritten, schedule_order).peak
    assert result["max_grad_error"] <= ROUNDING and not result["missing_gradients"]


def test_the_first_level_of_an_inference_search_holds_every_free_rewrite_at_once():
    """Before the main loop expands any state, canonical's rewrite of the captured forward is a
    state: with every other state's peak higher, it is the plan."""
    built = ZOO["swiftnet-hpd"].build("tiny", seed=0)
    model, (x,) = built.model, built.example_inputs
    graph = capture_forward(model, (x,)).graph
    rewritten = canonical(graph)
    free = simulate_memory(rewritten, schedule(rewritten, 5).order).peak
    plan = magis.optimize(model, (x,), inference=True, latency_limit=5.0, device="a100", max_states=3, progress=False)
    assert plan.search.stats.rules.get("canonical") == 1 and plan.search.stats.expanded == 0
    assert plan.peak_bytes <= free
    with torch.no_grad():
        torch.testing.assert_close(plan(x), model(x), rtol=1e-5, atol=1e-6)
