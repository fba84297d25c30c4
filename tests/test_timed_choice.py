"""The search's choice confirmed by timing (magis.search.timed_choice): the plans nearest the
best, timed in turns with the captured step, decide by their timed figures; on a CPU
``magis.optimize`` returns a plan whose latency limit holds as timed."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from test_fission import captured, in_float64

import magis
from magis.cost.latency import cost_model, estimate_latency
from magis.cost.op_timing import StepsTimed, time_in_turns
from magis.ir.graph import Graph
from magis.models import WORKLOADS
from magis.search.m_optimizer import Objective, m_optimize
from magis.search.state import MState
from magis.search.timed_choice import RELAX, ROUNDS_ESTIMATED, contenders, timed_choice


@pytest.fixture(scope="module")
def searched():
    """U-Net's (tiny) search front, and a latency limit that cuts through it: the best within
    it has states of lower peak just over it, and of higher peak under it."""
    graph = captured(in_float64(WORKLOADS["unet"].build("tiny", seed=0))).graph
    model = cost_model("h200")
    order = [n.name for n in graph.nodes]
    baseline_s = estimate_latency(graph, order, model).total_s
    loose = Objective("latency", latency_s=1.05 * baseline_s)
    result = m_optimize(graph, loose, model, time_budget=60, max_states=150, progress=False)
    front = sorted(result.front, key=lambda s: s.peak_bytes)
    assert len(front) >= 3, "the test needs a front with states on both sides of the best"
    objective = Objective("latency", latency_s=front[1].latency_s)
    best = min(front, key=lambda s: objective.rank(s.peak_bytes, s.latency_s))
    assert best is front[1]
    return front, best, result.initial, objective, (graph, order), baseline_s


def _timer(
    states: Sequence[MState], seconds: Callable[[MState | None], float], quiet: bool = True
) -> tuple[Callable[[Sequence[tuple[Graph, Sequence[str]]], float], StepsTimed], list[list[MState | None]]]:
    """A stand-in for the cost model's ``time_steps``: each step, one of ``states`` or the
    captured step (``None``), takes ``seconds(state)``; the calls made are recorded."""
    by_step = {(id(s.graph), tuple(s.order)): s for s in states}
    calls: list[list[MState | None]] = []

    def time_steps(steps: Sequence[tuple[Graph, Sequence[str]]], max_seconds: float) -> StepsTimed:
        called = [None, *(by_step[(id(graph), tuple(order))] for graph, order in steps[1:])]
        calls.append(called)
        return StepsTimed(tuple(seconds(s) for s in called), rounds=10, quiet=quiet)

    return time_steps, calls


def _choose(searched, seconds: Callable[[MState | None], float], quiet: bool = True, max_seconds: float = 1e9):
    front, best, initial, objective, baseline, baseline_s = searched
    time_steps, calls = _timer((*front, initial), seconds, quiet)
    chosen = timed_choice(front, best, initial, objective, baseline, baseline_s, time_steps, max_seconds)
    return chosen, calls


def _as_estimated(baseline_s: float) -> Callable[[MState | None], float]:
    return lambda s: baseline_s if s is None else s.latency_s


def test_the_contenders_are_the_best_its_neighbours_and_the_captured_step(searched):
    front, best, initial, objective, _, _ = searched
    states = contenders(front, best, initial, objective)
    assert states[0] is best and initial in states
    assert states[1] is front[0]  # the lower peak just over the limit comes first
    assert front[2] in states
    assert len({id(s) for s in states}) == len(states)
    reach = RELAX * objective.latency_s
    within_reach = [s for s in front if s.peak_bytes < best.peak_bytes and s.latency_s <= reach]
    fastest, lowest = min(front, key=lambda s: s.latency_s), min(within_reach, key=lambda s: s.peak_bytes)
    assert fastest in states and lowest in states  # each side's far end: the most to gain, the likeliest to run within


@dataclass(eq=False)
class _Point:
    """What :func:`contenders` reads of a state."""

    peak_bytes: int
    latency_s: float


def test_each_side_is_its_nearest_its_farthest_then_the_next_nearest():
    objective = Objective("latency", latency_s=1.0)
    best = _Point(100, 1.0)
    lower = [_Point(100 - k, 1.0 + 0.05 * k) for k in range(1, 7)]  # the last, 1.30, beyond RELAX's reach
    higher = [_Point(100 + k, 1.0 - 0.01 * k) for k in range(1, 8)]
    initial = _Point(200, 0.9)
    states = contenders([*lower, best, *higher], best, initial, objective)
    assert states[:4] == [best, lower[0], higher[0], initial]
    assert states[4:] == [lower[4], higher[-1], lower[1], higher[1]]  # far ends, then the next nearest


def test_times_as_estimated_confirm_the_best(searched):
    _, best, _, objective, _, baseline_s = searched
    chosen, calls = _choose(searched, _as_estimated(baseline_s))
    assert chosen.best.graph is best.graph and chosen.best.order == best.order
    assert chosen.objective == objective and chosen.baseline_latency_s == baseline_s
    assert chosen.note == "the best as estimated, confirmed"
    assert len(calls) == 1 and calls[0][0] is None and calls[0][1] is best


def test_a_best_that_runs_over_the_limit_gives_way_to_the_next_within_it(searched):
    _, best, _, objective, _, baseline_s = searched
    estimated = _as_estimated(baseline_s)
    chosen, calls = _choose(searched, lambda s: 2 * objective.latency_s if s is best else estimated(s))
    assert chosen.best.peak_bytes > best.peak_bytes
    assert chosen.best.latency_s <= objective.latency_s
    within = [s for s in calls[0][1:] if s is not best and s.latency_s <= objective.latency_s]
    assert chosen.best.peak_bytes == min(s.peak_bytes for s in within)
    assert "ran over the latency limit" in chosen.note


def test_a_lower_peak_estimated_over_the_limit_that_runs_within_it_is_taken(searched):
    front, best, _, objective, _, baseline_s = searched
    lower = front[0]
    assert lower.latency_s > objective.latency_s  # estimated over the limit
    estimated = _as_estimated(baseline_s)
    chosen, _ = _choose(searched, lambda s: 0.99 * objective.latency_s if s is lower else estimated(s))
    assert chosen.best.graph is lower.graph and chosen.best.peak_bytes < best.peak_bytes
    assert chosen.best.latency_s == pytest.approx(0.99 * objective.latency_s)
    assert "lower peak" in chosen.note


def test_the_limit_is_a_ratio_to_the_captured_step_timed_at_the_same_moment(searched):
    """A machine three times slower in this process slows the captured step too: nothing changes
    but the figures."""
    _, best, _, objective, _, baseline_s = searched
    estimated = _as_estimated(baseline_s)
    chosen, _ = _choose(searched, lambda s: 3 * estimated(s))
    assert chosen.best.graph is best.graph
    assert chosen.objective.latency_s == pytest.approx(3 * objective.latency_s)
    assert chosen.baseline_latency_s == pytest.approx(3 * baseline_s)


def test_a_busy_machine_leaves_the_choice_to_the_estimates(searched):
    front, best, _, objective, _, baseline_s = searched
    chosen, _ = _choose(searched, lambda s: 0.5 * baseline_s if s is front[0] else baseline_s, quiet=False)
    assert chosen.best is best and chosen.objective == objective and chosen.baseline_latency_s == baseline_s
    assert "busy" in chosen.note


def test_a_captured_step_over_the_limit_as_timed_makes_the_limit_a_ratio_to_it(searched):
    """Against a baseline faster than the captured step itself (a model's own forward, beside a
    plan's per-call checks), nothing is within the limit: the limit becomes a ratio to the
    captured step as timed, and the lowest peak within it wins."""
    _, _, initial, objective, _, baseline_s = searched
    estimated = _as_estimated(baseline_s)
    chosen, calls = _choose(searched, lambda s: 0.5 * baseline_s if s is None else 2 * estimated(s))
    timed = calls[0][1:]
    assert initial in timed
    ratio = objective.latency_s / baseline_s
    within = [s for s in timed if 2 * s.latency_s <= ratio * 2 * initial.latency_s]
    assert chosen.best.peak_bytes == min(s.peak_bytes for s in within)
    assert chosen.baseline_latency_s == pytest.approx(2 * initial.latency_s)
    assert chosen.objective.latency_s == pytest.approx(ratio * 2 * initial.latency_s)
    assert "ratio to the captured step" in chosen.note


def test_nothing_within_the_limit_as_timed_leaves_the_choice_to_the_estimates(searched):
    """Where the captured step was not among the plans timed (the time given fit three), the
    estimates decide."""
    front, best, initial, objective, _, baseline_s = searched
    first_three = contenders(front, best, initial, objective)[:3]
    assert initial not in first_three
    three = ROUNDS_ESTIMATED * (baseline_s + sum(s.latency_s for s in first_three))
    chosen, calls = _choose(searched, lambda s: baseline_s if s is None else 10 * baseline_s, max_seconds=three * 1.001)
    assert calls[0][1:] == first_three
    assert chosen.best is best and chosen.objective == objective
    assert "none of the plans timed" in chosen.note


def test_only_the_contenders_that_fit_the_time_given_are_timed(searched):
    front, best, initial, objective, _, baseline_s = searched
    everyone = contenders(front, best, initial, objective)
    two = ROUNDS_ESTIMATED * (baseline_s + best.latency_s + everyone[1].latency_s)
    _, calls = _choose(searched, _as_estimated(baseline_s), max_seconds=two * 1.001)
    assert calls[0][1:] == everyone[:2]
    chosen, calls = _choose(searched, _as_estimated(baseline_s), max_seconds=ROUNDS_ESTIMATED * baseline_s)
    assert not calls and chosen.best is best and chosen.note.startswith("not timed")


def test_in_memory_mode_the_fastest_as_timed_within_the_memory_limit_wins(searched):
    front, _, initial, _, baseline, baseline_s = searched
    objective = Objective("memory", memory_bytes=front[2].peak_bytes)
    within = sorted((s for s in front if s.peak_bytes <= objective.memory_bytes), key=lambda s: s.latency_s)
    fastest, slower = within[0], within[1]
    estimated = _as_estimated(baseline_s)
    time_steps, _ = _timer((*front, initial), lambda s: 0.5 * slower.latency_s if s is slower else estimated(s))
    chosen = timed_choice(front, fastest, initial, objective, baseline, baseline_s, time_steps, 1e9)
    assert chosen.best.graph is slower.graph and chosen.note == "a plan estimated slower ran faster"


def test_a_cpu_plan_is_timed_in_turns_with_the_captured_step(convnet, one_thread):
    """The way a user calls it: on this CPU the plan returned was timed beside the captured step,
    and a limit met as timed is met by the figures the plan reports."""
    model, batch, loss_fn = convnet
    plan = magis.optimize(model, batch, loss_fn, latency_limit=1.1, time_budget=10, progress=False)
    timed = plan.report().search["timed"]
    assert timed["plans"] >= 1 and timed["rounds"] >= 3
    assert timed["choice"] and not timed["choice"].startswith("not timed")
    if not timed["choice"].startswith("kept as estimated"):
        assert plan.report().latency_ratio <= 1.1
    torch.manual_seed(0)
    plan(*batch)  # runs


def test_timed_false_keeps_the_searchs_choice_which_repeats(convnet, one_thread):
    """``timed=False``: nothing is timed whole, and a search bounded by ``max_states`` on the
    same operator timings chooses the same plan again (timing whole plans may not)."""
    model, batch, loss_fn = convnet
    options = dict(latency_limit=1.1, max_states=20, timed=False, progress=False)
    plans = [magis.optimize(model, batch, loss_fn, **options) for _ in range(2)]
    assert all(p.report().search["timed"] == {"plans": 0, "rounds": 0, "choice": ""} for p in plans)
    assert plans[0].order == plans[1].order and plans[0].peak_bytes == plans[1].peak_bytes
    with pytest.raises(ValueError, match="timed is True or False"):
        magis.optimize(model, batch, loss_fn, timed="no", progress=False)


def test_an_inference_plan_is_timed_as_its_user_calls_it_beside_the_eager_forward(convnet, one_thread):
    model, batch, _ = convnet
    model.eval()
    plan = magis.optimize(model, batch, inference=True, latency_limit=1.2, time_budget=10, progress=False)
    timed = plan.report().search["timed"]
    assert timed["plans"] >= 1 and timed["rounds"] >= 3
    assert timed["choice"] and not timed["choice"].startswith("not timed")
    with torch.no_grad():
        expected = model(*batch)
    torch.testing.assert_close(plan(*batch), expected)


def test_calls_timed_in_turns_keep_their_order_whichever_runs_first():
    """Each round starts one call further on; the times come back in the calls' order."""
    ran: list[int] = []

    def call(i: int, seconds: float) -> Callable[[], None]:
        return lambda: (ran.append(i), time.sleep(seconds))

    timed = time_in_turns([call(0, 0.004), call(1, 0.001), call(2, 0.002)], torch.device("cpu"), 4, 10.0)
    assert timed.seconds[1] < timed.seconds[2] < timed.seconds[0]
    assert {ran[k * 3] for k in range(3)} == {0, 1, 2}  # each call ran first in some round
    assert not timed.quiet  # sleeping is not running: no round counts as quiet
    assert len(timed.samples) == timed.rounds and all(len(r) == 3 for r in timed.samples)
    assert timed.seconds == tuple(statistics.median(r[i] for r in timed.samples) for i in range(3))
    ratio, error = timed.ratio(0, 1)  # paired: each round's 4 ms call over the same round's 1 ms call
    assert ratio == pytest.approx(statistics.fmean(r[0] / r[1] for r in timed.samples)) and ratio > 1.5
    assert 0 <= error < math.inf


def test_a_ratio_of_paired_rounds_has_the_standard_error_of_its_rounds():
    rounds = ((1.0, 2.0), (1.2, 2.0), (0.8, 2.0))
    timed = StepsTimed((1.0, 2.0), 3, True, rounds)
    ratio, error = timed.ratio(0, 1)
    assert ratio == pytest.approx(0.5)
    assert error == pytest.approx(statistics.stdev([0.5, 0.6, 0.4]) / math.sqrt(3))
    assert timed.ratio(1, 0)[0] == pytest.approx(statistics.fmean([2.0, 2 / 1.2, 2 / 0.8]))
    assert StepsTimed((1.0, 2.0), 1, True, rounds[:1]).ratio(0, 1) == (0.5, math.inf)  # one round: no spread


def test_timing_leaves_the_model_as_it_was(one_thread):
    """Planning times steps many times; a batch norm in training mode (whose forward updates its
    statistics) and a model's own generator are left as they were, as after eager's one call."""

    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.norm = torch.nn.BatchNorm2d(8)
            self.generator = torch.Generator().manual_seed(7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv(x + 0.1 * torch.randn(x.shape, generator=self.generator))).relu()

    torch.manual_seed(0)
    model = Noisy()
    before = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    plan = magis.optimize(model, (x,), inference=True, latency_limit=1.2, time_budget=5, progress=False)
    timed = plan.report().search["timed"]
    assert timed["plans"] >= 1 and timed["rounds"] >= 3  # a search whose front is one state times that one
    assert torch.equal(model.generator.get_state(), before.generator.get_state())
    for name, buffer in before.state_dict().items():
        assert torch.equal(model.state_dict()[name], buffer), name
    with torch.no_grad():
        expected = before(x)
    torch.testing.assert_close(plan(x), expected)
    torch.testing.assert_close(model.norm.running_mean, before.norm.running_mean)
