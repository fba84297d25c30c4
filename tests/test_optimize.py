"""magis.optimize and the M-Optimizer (MAGIS Alg. 3): plans train like eager PyTorch, fit
their limits for real, are deterministic, and bad options get clear errors."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import ConvNet
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import magis
from magis.api import parse_bytes
from magis.backend.meter import LiveTensorMeter, resident_tensors
from magis.cost.latency import cost_model, estimate_latency
from magis.frontend.capture import capture, default_loss
from magis.ir.graph import Ref, Role
from magis.models import WORKLOADS, build_workload
from magis.rules.builder import NodeBuilder
from magis.rules.rewrite import Rewrite
from magis.search import first_level
from magis.search.graph_hash import wl_hash
from magis.search.m_optimizer import Objective, m_optimize
from magis.search.registry import RULES, register_graph_rule
from magis.search.rule_front import recompute_front
from magis.search.single_fission import best_single_fission, separable_step, single_fissions

STATES = 40  # enough for these small steps to reach their best fission


class MLP(nn.Module):
    """Activations larger than the weights: fission along the batch lowers the peak."""

    def __init__(self, d: int = 64, h: int = 128) -> None:
        super().__init__()
        self.a = nn.Linear(d, h)
        self.b = nn.Linear(h, h)
        self.c = nn.Linear(h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.tanh(self.a(x))))).square().mean()


class GeluStack(nn.Module):
    """Linear -> GELU -> LayerNorm blocks: recomputing a GELU from its saved input frees its output."""

    def __init__(self, d: int = 64, blocks: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.norm(nn.functional.gelu(layer(x)))
        return x.square().mean()


def mlp(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MLP().to(dtype), torch.randn(256, 64, dtype=dtype)


def plan_for(model: nn.Module, *inputs, loss_fn=None, **options) -> magis.Plan:
    options = {"device": "h200", "max_states": STATES, "progress": False, **options}
    return magis.optimize(model, inputs, loss_fn, **options)


def train(step, model: nn.Module, batches, seed: int = 3) -> list[float]:
    """Three SGD steps; ``step(model, batch)`` returns the loss and leaves gradients in ``.grad``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(seed)
    losses = []
    for batch in batches:
        losses.append(float(step(model, batch)))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def eager(loss_fn=None):
    def step(model, batch):
        out = model(*batch)
        loss = out if loss_fn is None else loss_fn(out)
        loss.backward()
        return loss.detach()

    return step


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("limits", [{"memory_limit": 0.6}, {}])
def test_training_with_a_plan_equals_eager(limits):
    model, x = mlp()
    twin = copy.deepcopy(model)
    plan = plan_for(model, x, **limits)
    if limits:
        assert plan.peak_bytes <= 0.6 * plan.baseline_peak_bytes and plan.report().transformations["fission"]
    batches = [(x + k,) for k in range(3)]
    expected = train(eager(), twin, batches)
    got = train(lambda _model, batch: plan(*batch), model, batches)
    assert got == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)


def test_batch_norm_and_dropout_train_like_eager():
    torch.manual_seed(0)
    model = ConvNet().double()
    twin = copy.deepcopy(model)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    x = torch.randn(4, 3, 12, 12, dtype=torch.float64)
    plan = plan_for(model, x, loss_fn=loss_fn)
    batches = [(x * (k + 1),) for k in range(3)]
    expected = train(eager(loss_fn), twin, batches)
    got = train(lambda _model, batch: plan(*batch), model, batches)
    assert got == pytest.approx(expected, rel=1e-12)
    assert_same_state(model, twin)  # parameters and the batch norm's running statistics
    assert int(model.bn.num_batches_tracked) == 3


def test_gradients_accumulate_like_backward():
    model, x = mlp()
    plan = plan_for(model, x)
    loss = plan(x)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, once[n], rtol=1e-12)
    assert torch.allclose(loss, model(x).detach())
    plan(x)  # on top of eager's gradients: twice the gradient
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, 2 * once[n], rtol=1e-12)


def test_memory_limit_is_met_for_real_and_simulated_within_two_percent():
    model, x = mlp(torch.float32)
    limit = int(0.6 * plan_for(model, x).baseline_peak_bytes)
    plan = plan_for(model, x, memory_limit=limit)
    assert plan.peak_bytes <= limit
    constants = [n.target.value for n in plan.graph.nodes if n.role is Role.CONSTANT]
    with LiveTensorMeter(resident_tensors(model, [x, *constants])) as meter:
        plan(x)
    assert meter.peak_bytes <= limit * 1.02
    assert abs(meter.peak_bytes - plan.peak_bytes) <= 0.02 * plan.peak_bytes


#: resnet50's batch norm cannot be split along the batch, and within the test's states
#: remat and swap alone reach 0.72 of its peak, not 0.6 (the M-Optimizer issue's open gap)
BATCH_NORM_GAP = pytest.mark.xfail(reason="the search does not reach 0.6 without fission", strict=True)


@pytest.mark.parametrize("name", [pytest.param(n, marks=BATCH_NORM_GAP) if n == "resnet50" else n for n in WORKLOADS])
def test_each_tiny_workload_trains_ten_adamw_steps_like_eager_within_a_limit_of_0_6(name):
    """MAGIS' seven workloads, tiny, at eight times the tiny batch (at the tiny batch the
    weights alone take over 0.6 of most steps), float64, dropout live: a plan for 0.6 of
    the captured peak trains like eager PyTorch, step after step, within its limit."""
    workload = WORKLOADS[name]
    built = build_workload(name, "tiny", 8 * workload.presets["tiny"]["batch"], seed=0)
    model = built.model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in built.example_inputs)
    reference = copy.deepcopy(model)
    plan = plan_for(model, *inputs, loss_fn=built.loss_fn, memory_limit=0.6)
    assert plan.peak_bytes <= 0.6 * plan.baseline_peak_bytes

    def planned(model: nn.Module, batch: tuple) -> torch.Tensor:
        return plan(*batch)

    def adamw(step, model: nn.Module) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(5)
        losses = []
        for _ in range(10):
            losses.append(float(step(model, inputs)))
            optimizer.step()
            optimizer.zero_grad()
        return losses

    expected = adamw(eager(built.loss_fn or default_loss), reference)
    assert adamw(planned, model) == pytest.approx(expected, rel=1e-6)  # some heads compute the loss in float32
    assert_same_state(model, reference)

    constants = [n.target.value for n in plan.graph.nodes if n.role is Role.CONSTANT]
    with LiveTensorMeter(resident_tensors(model, [*inputs, *constants])) as meter:
        plan(*inputs)
    assert meter.peak_bytes <= 0.6 * plan.baseline_peak_bytes * 1.02
    assert abs(meter.peak_bytes - plan.peak_bytes) <= 0.02 * plan.peak_bytes


def test_latency_limit_mode_lowers_the_peak_within_the_latency():
    model, x = mlp()
    loose = plan_for(model, x, latency_limit=20.0)
    assert loose.report().mode == "latency"
    assert loose.latency_s <= 20.0 * loose.baseline_latency_s
    assert loose.peak_bytes < 0.7 * loose.baseline_peak_bytes
    default = plan_for(model, x)  # neither limit: latency-limit mode at 1.10
    assert default.objective.latency_s == pytest.approx(1.10 * default.baseline_latency_s)
    assert default.latency_s <= 1.10 * default.baseline_latency_s
    assert default.peak_bytes <= default.baseline_peak_bytes
    assert loose.peak_bytes < default.peak_bytes


def test_same_inputs_and_seed_give_the_same_plan():
    model, x = mlp()
    a = plan_for(model, x, memory_limit=0.6)
    b = plan_for(model, x, memory_limit=0.6)
    assert (a.peak_bytes, a.latency_s) == (b.peak_bytes, b.latency_s)
    assert wl_hash(a.graph) == wl_hash(b.graph) and a.order == b.order
    assert a.report().transformations == b.report().transformations


def test_bad_options_and_impossible_limits_raise_clear_errors():
    model, x = mlp()
    for options, words in [
        ({"memory_limit": -5}, "positive"),
        ({"memory_limit": 1.5}, "fraction"),
        ({"memory_limit": "5 parsecs"}, "memory size"),
        ({"latency_limit": 0.5}, "at least 1"),
        ({"time_budget": 0}, "time_budget"),
        ({"device": "abacus"}, "unknown device"),
    ]:
        with pytest.raises(ValueError, match=words):
            plan_for(model, x, **options)
    with pytest.raises(magis.InfeasibleLimit, match="floor"):
        plan_for(model, x, memory_limit="1KiB")
    with pytest.raises(magis.InfeasibleLimit, match="latency limit"):
        plan_for(model, x, memory_limit=0.6, latency_limit=1.0)
    assert issubclass(magis.InfeasibleLimit, ValueError)
    assert parse_bytes("6GiB") == 6 * 2**30 and parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("1000") == 1000
    plan = plan_for(model, x)
    with pytest.raises(ValueError, match="shape"):
        plan(torch.randn(8, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype"):
        plan(x.float())
    with pytest.raises(ValueError, match="inputs"):
        plan(x, x)


def test_a_model_on_fake_tensors_is_planned_but_not_run(tmp_path):
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, x = MLP(), torch.randn(256, 64)
    plan = magis.optimize(model, (x,), memory_limit=0.6, max_states=STATES, progress=False)
    assert plan.device == "h200" and plan.peak_bytes <= 0.6 * plan.baseline_peak_bytes
    with pytest.raises(RuntimeError, match="real weights"):
        plan(x)


def test_report_is_json_and_plot_is_a_png(tmp_path):
    model, x = mlp()
    plan = plan_for(model, x, memory_limit=0.6)
    report = json.loads(json.dumps(plan.report().to_dict()))
    for key in ("peak_bytes", "latency_s", "baseline_peak_bytes", "baseline_latency_s", "device"):
        assert report[key] == getattr(plan, key)
    assert report["search"]["states"] <= STATES and report["search"]["stopped_by"]
    assert report["transformations"]["fission"][0]["parts"] >= 2
    path = plan.plot(tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_is_at_least_as_good_as_the_best_single_fission():
    model, x = mlp()
    graph = capture(model, (x,))
    model_cost = cost_model("h200")
    peak = plan_for(model, x).baseline_peak_bytes
    for fraction in (0.7, 0.5, 0.1):  # 0.1: nothing fits, the lowest peak wins
        limit = int(fraction * peak)
        result = m_optimize(graph, Objective("memory", limit), model_cost, max_states=STATES, progress=False)
        single = best_single_fission(graph, result.initial.order, limit)
        single_latency = estimate_latency(single.graph, single.order, model_cost).total_s
        best = result.best
        if single.peak_bytes <= limit:
            assert best.peak_bytes <= limit and best.latency_s <= single_latency
        else:
            assert best.peak_bytes <= single.peak_bytes


def test_a_registered_graph_rule_takes_part_in_the_search():
    def probe(graph):
        """A copy of the input nobody reads: a different graph, computing the same."""
        build = NodeBuilder(graph, graph.signature.user_inputs[0])
        build.add("probe", torch.ops.aten.clone.default, (Ref(graph.signature.user_inputs[0]),))
        return [Rewrite(graph.replace(add=build.nodes), "copy the input")]

    register_graph_rule("test-probe", probe)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_graph_rule("test-probe", probe)
        model, x = mlp()
        graph = capture(model, (x,))
        objective = Objective("latency", latency_s=1.0)
        result = m_optimize(graph, objective, cost_model("h200"), max_states=STATES, rule_names=["test-probe"])
        assert result.stats.rules["test-probe"] >= 1
        with pytest.raises(ValueError, match="unknown M-Rule"):
            m_optimize(graph, objective, cost_model("h200"), rule_names=["no-such-rule"])
    finally:
        RULES.pop("test-probe")


def test_better_than_and_the_relaxed_acceptance_per_mode():
    def s(peak, latency):
        return SimpleNamespace(peak_bytes=peak, latency_s=latency)

    memory = Objective("memory", memory_bytes=100)
    assert memory.better_than(s(100, 2.0), s(50, 3.0))  # both fit: lower latency wins
    assert not memory.better_than(s(50, 3.0), s(100, 2.0))
    assert memory.better_than(s(100, 9.0), s(101, 1.0))  # fitting beats not fitting
    assert memory.better_than(s(150, 9.0), s(160, 1.0))  # neither fits: lower peak wins
    best = s(90, 1.0)
    assert memory.acceptable(s(99, 1.09), best) and not memory.acceptable(s(99, 1.11), best)
    assert not memory.acceptable(s(101, 0.5), best)  # the best fits: so must a state worth keeping
    assert memory.acceptable(s(160, 9.0), s(150, 1.0)) and not memory.acceptable(s(170, 1.0), s(150, 1.0))
    latency = Objective("latency", latency_s=2.0)
    assert latency.better_than(s(10, 2.0), s(20, 1.0)) and latency.better_than(s(99, 2.0), s(1, 2.1))
    assert latency.acceptable(s(109, 1.0), s(100, 1.9)) and not latency.acceptable(s(111, 1.0), s(100, 1.9))
    both = Objective("memory", memory_bytes=100, latency_s=1.5)
    assert both.met_by(s(100, 1.5)) and not both.met_by(s(100, 1.6)) and not both.met_by(s(101, 1.0))
    with pytest.raises(ValueError, match="memory limit"):
        Objective("memory")


def test_the_queue_takes_of_two_equal_peaks_the_one_lower_away_from_it_first():
    def s(timeline, latency):
        return SimpleNamespace(peak_bytes=max(timeline), latency_s=latency, memory=SimpleNamespace(timeline=timeline))

    coarse, fine = s((90, 100, 80), 1.0), s((60, 100, 50), 1.2)  # a stem in four bands, in eight
    latency = Objective("latency", latency_s=2.0)
    assert latency.queue_rank(fine) < latency.queue_rank(coarse)
    assert latency.better_than(coarse, fine)  # yet as a plan, the faster of two equal peaks is better
    over = s((60, 100, 50), 2.5)  # beyond the latency limit: ranked by latency, as before
    assert latency.queue_rank(over) == latency.rank(100, 2.5)
    memory = Objective("memory", memory_bytes=50)  # neither fits: lower peak, then the profile
    assert memory.queue_rank(fine) < memory.queue_rank(coarse)
    fits = Objective("memory", memory_bytes=100)  # both fit: lower latency first, as before
    assert fits.queue_rank(coarse) < fits.queue_rank(fine)


def test_first_level_fissions_each_root_at_every_fission_number():
    """With no rule to apply, the search keeps its first level: each root of the F-Tree
    at every fission number is a state, so the lowest peak is the root's best split."""
    model, x = mlp()
    graph = capture(model, (x,))
    result = m_optimize(graph, Objective("memory", 1), cost_model("h200"), rule_names=[], progress=False)
    step = separable_step(graph, result.initial.order)
    roots = [c for c in step.tree.candidates if c.parent is None]
    splits = [o for c in roots for o in single_fissions(step.graph, step.order, step.dgraph, c)]
    assert len({o.parts for o in splits}) >= 3  # more than the smallest n alone
    assert result.best.peak_bytes <= min(o.peak_bytes for o in splits)
    assert result.best.regions()[0]["parts"] == min(splits, key=lambda o: o.peak_bytes).parts


def test_recompute_dive_reaches_the_greedy_front_within_the_latency_limit():
    """The first level's recompute greedy: within a latency limit the search's plan peaks no
    higher than the recompute-only front's best point within it, and says what it recomputed."""
    torch.manual_seed(0)
    graph = capture(GeluStack().double(), (torch.randn(256, 64, dtype=torch.float64),))
    h200 = cost_model("h200")
    initial = m_optimize(graph, Objective("latency", latency_s=1e9), h200, rule_names=[], progress=False).initial
    limit = 1.3 * initial.latency_s
    front = recompute_front(graph, h200, initial.order, latency_limit_s=limit)
    within = [p for p in front.points if p.latency_s <= limit]
    assert min(p.peak_bytes for p in within) < initial.peak_bytes  # recomputing helps this step
    result = m_optimize(graph, Objective("latency", latency_s=limit), h200, rule_names=["remat"], progress=False)
    assert result.best.latency_s <= limit
    assert result.best.peak_bytes <= min(p.peak_bytes for p in within)
    assert result.stats.rules.get("remat", 0) >= 1


def test_swap_dive_walks_on_from_the_recompute_front_on_a_device_with_memory():
    """On a device with memory of its own (h200) the first level's swap greedy walks on from
    the recompute front: swaps whose transfers hide behind compute lower the plan's peak
    at a latency limit below what recomputation alone reaches, and the plan says so."""
    torch.manual_seed(0)
    graph = capture(GeluStack().double(), (torch.randn(256, 64, dtype=torch.float64),))
    h200 = cost_model("h200")
    initial = m_optimize(graph, Objective("latency", latency_s=1e9), h200, rule_names=[], progress=False).initial
    limit = Objective("latency", latency_s=1.05 * initial.latency_s)
    remat_only = m_optimize(graph, limit, h200, rule_names=["remat"], time_budget=10, progress=False).best
    result = m_optimize(graph, limit, h200, rule_names=["remat", "swap"], time_budget=10, progress=False)
    assert result.best.latency_s <= limit.latency_s
    assert result.best.peak_bytes < remat_only.peak_bytes
    assert any(step.rule == "swap" and step.description.endswith("(greedy)") for step in result.best.steps)


class BatchNormStack(nn.Module):
    """Conv -> BatchNorm -> ReLU blocks: batch norm couples the samples (no fission along the
    batch), and recomputation cannot reach the convolutions' outputs its backward reads."""

    def __init__(self, channels: int = 16, blocks: int = 4) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = torch.relu(norm(conv(x)))
        return x.square().mean()


def test_memory_mode_keeps_the_first_swap_plan_within_the_limit_before_the_next_start(monkeypatch):
    """Under a memory limit recomputation alone cannot meet, the dive's recompute greedy stops
    where its rounds free memory more slowly than the host link (h200) moves it, and the
    first swap start's plan within the limit is a state, the search's first feasible plan,
    before the next start's greedy runs (on ResNet-50 at paper size: 8 s, not 27 s)."""
    torch.manual_seed(0)
    graph = capture(BatchNormStack().double(), (torch.randn(8, 16, 32, 32, dtype=torch.float64),))
    h200 = cost_model("h200")
    initial = m_optimize(graph, Objective("latency", latency_s=1e9), h200, rule_names=[], progress=False).initial
    reach = recompute_front(graph, h200, initial.order).points[-1].peak_bytes
    limit = Objective("memory", memory_bytes=int(0.9 * reach))
    levels, feasible_at_call = [], []
    run, swap_front = first_level.FirstLevel.run, first_level.swap_front

    def run_kept(self, graph, initial):
        levels.append(self)
        return run(self, graph, initial)

    def swap_front_watched(*args, **kwargs):
        feasible_at_call.append(levels[-1].ledger.stats.first_feasible_s is not None)
        return swap_front(*args, **kwargs)

    monkeypatch.setattr(first_level.FirstLevel, "run", run_kept)
    monkeypatch.setattr(first_level, "swap_front", swap_front_watched)
    result = m_optimize(graph, limit, h200, rule_names=["remat", "swap"], time_budget=20, progress=False)
    assert result.best.peak_bytes <= limit.memory_bytes
    assert any(step.rule == "swap" for step in result.best.steps)
    assert len(feasible_at_call) > 1 and not feasible_at_call[0] and all(feasible_at_call[1:])


@pytest.mark.parametrize("overhead", [1.10, 1.20])
def test_latency_mode_swaps_from_the_lowest_recompute_point_within_the_limit(monkeypatch, overhead):
    """Under a latency limit the swap greedy starts from points of the recompute front within
    the limit, its lowest one among them: a swap hidden behind the recomputations costs
    nothing there, where the front's last point (past the limit) leaves no swap any room (on
    ResNet-50 at paper size, h200: 0.481 of eager's peak before, 0.386 after)."""
    torch.manual_seed(0)
    graph = capture(BatchNormStack().double(), (torch.randn(8, 16, 32, 32, dtype=torch.float64),))
    h200 = cost_model("h200")
    initial = m_optimize(graph, Objective("latency", latency_s=1e9), h200, rule_names=[], progress=False).initial
    limit = Objective("latency", latency_s=overhead * initial.latency_s)
    fronts, starts = [], []
    watched_front, watched_dive = first_level.recompute_front, first_level.FirstLevel._swap_dive

    def front_kept(*args, **kwargs):
        fronts.append(watched_front(*args, **kwargs))
        return fronts[-1]

    def dive_kept(self, separable, points, deadline):
        starts.extend(points)
        return watched_dive(self, separable, points, deadline)

    monkeypatch.setattr(first_level, "recompute_front", front_kept)
    monkeypatch.setattr(first_level.FirstLevel, "_swap_dive", dive_kept)
    m_optimize(graph, limit, h200, rule_names=["remat", "swap"], time_budget=10, progress=False)
    within = [p for p in fronts[0].points[1:] if p.latency_s <= limit.latency_s]
    assert any(p.latency_s > limit.latency_s for p in fronts[0].points)  # the front crossed the limit
    assert starts and all(p.latency_s <= limit.latency_s for p in starts)
    assert min(p.peak_bytes for p in starts) == min(p.peak_bytes for p in within)


class GatedRunningSum(nn.Module):
    """A trunk whose running sums mix the tokens (no fission along them spans it) under a wide
    classification head: the head's logits make the peak until the head alone is fissioned,
    and then the trunk's gates (``tanh`` and ``sigmoid`` outputs saved for the backward) do,
    as the LSTM cells' do in Echo's NMT at paper size."""

    def __init__(self, width: int = 1024, depth: int = 4, classes: int = 8192) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            x = (h.tanh() * h.sigmoid()).cumsum(0)
        return nn.functional.cross_entropy(self.head(x), labels)


def test_a_fission_that_moves_the_peak_is_refined_by_recomputation(monkeypatch):
    """The first level's recompute greedy also walks from the root fission that moves the peak
    (``FirstLevel._refine``): the separable step's greedy recomputes for the logits, which the
    fission cuts, and what then waits at the peak is the trunk's gates. The main loop is left
    out, as on a step of thousands of nodes it never expands a state within its budget (Echo's
    NMT at paper size, h200, 60 s: 0.325 of eager's peak without the refinement, 0.313 with)."""
    with torch.device("meta"):
        graph = capture(GatedRunningSum(), (torch.randn(8192, 1024), torch.randint(0, 8192, (8192,))))
    h200 = cost_model("h200")
    initial = m_optimize(graph, Objective("latency", latency_s=1e9), h200, rule_names=[], progress=False).initial
    limit = Objective("latency", latency_s=1.10 * initial.latency_s)
    monkeypatch.setattr("magis.search.m_optimizer._Search.loop", lambda self: None)
    found = []
    for moved_peak in (first_level.MOVED_PEAK, 0.0):  # 0: no fission counts as moving the peak
        monkeypatch.setattr(first_level, "MOVED_PEAK", moved_peak)
        found.append(m_optimize(graph, limit, h200, rule_names=["remat"], time_budget=20, progress=False).best)
    refined, alone = found
    assert [step.rule for step in alone.steps] == ["separable", "enable"]  # the fission alone
    rules = [step.rule for step in refined.steps]
    assert rules[:2] == ["separable", "enable"] and "remat" in rules and set(rules[2:]) <= {"remat", "de-remat"}
    assert refined.peak_bytes < 0.9 * alone.peak_bytes and refined.latency_s <= limit.latency_s
    regions = refined.regions()  # the region fissioned into the refined state's base is reported
    assert refined.frozen and regions == alone.regions() and regions[0]["parts"] >= 2


def test_the_first_level_packs_the_masks_of_the_recompute_greedys_points_and_fissions_them(monkeypatch):
    """Each point of the first level's recompute greedy is also a state with its saved masks
    packed into bits (Echo §IV-B), and so are the points of its front the estimate ranks best
    once packed; those states' roots are fissioned as the points' are: on a
    step of thousands of nodes the main loop never expands a state within its budget (BERT at
    paper size, h200, 60 s), and it is the packed, recomputed, fissioned plan that holds least
    (0.265 of eager's peak at 1.097x where the compiled step is priced, against 0.310). Tiny
    BERT, the main loop left out: such states are made, in that order of steps."""
    built = WORKLOADS["bert-base"].build("tiny", seed=0)
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    fused = cost_model("h200", fused=True)
    initial = m_optimize(graph, Objective("latency", latency_s=1e9), fused, rule_names=[], progress=False).initial
    limit = Objective("latency", latency_s=1.10 * initial.latency_s)
    monkeypatch.setattr("magis.search.m_optimizer._Search.loop", lambda self: None)
    fissioned, dive_fissions = [], first_level.FirstLevel._dive_fissions

    def watched(self, state, separable, roots):
        before = self.ledger.stats.states
        dive_fissions(self, state, separable, roots)
        fissioned.append(([step.rule for step in state.steps], self.ledger.stats.states - before))

    more, packed_points = [], first_level.FirstLevel._packed_points

    def kept(self, *args):
        made = packed_points(self, *args)
        more.extend(made)
        return made

    monkeypatch.setattr(first_level.FirstLevel, "_dive_fissions", watched)
    monkeypatch.setattr(first_level.FirstLevel, "_packed_points", kept)
    m_optimize(graph, limit, fused, rule_names=["remat", "compact"], time_budget=30, progress=False)
    packed = [(rules, made) for rules, made in fissioned if rules[-1] == "compact"]
    assert packed and all("remat" in rules for rules, _ in packed)
    assert any(made > 0 for _, made in packed)
    # and points of the front the spread left out, ranked best once packed: made states, packed
    assert more and all([step.rule for step in state.steps][-1] == "compact" for state in more)
