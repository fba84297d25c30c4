"""The greedy fronts of recompute-only and swap-only plans (:mod:`magis.search.rule_front`) and
``magis remat``: monotone fronts of valid plans, each run by the magis runtime as eager runs
(measured peak = simulated peak), and clear refusals (swapping on a CPU, running the paper preset)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from test_fission import assert_runs_like_eager
from test_optimize import GeluStack
from test_scheduling_rules import TanhGeluMLP, mlp_step, step_of

from magis.backend.transfer import Load, Store
from magis.cli import main
from magis.cost.latency import cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.models import Built
from magis.rules.remat import duplicates
from magis.schedule import schedule
from magis.search.rule_front import FrontPoint, pareto, recompute_front, swap_front

H200 = cost_model("h200")


def assert_monotone(points: tuple[FrontPoint, ...]) -> None:
    """Peaks strictly decreasing, latencies non-decreasing, each point's figures its plan's own."""
    assert all(a.peak_bytes > b.peak_bytes for a, b in itertools.pairwise(points))
    assert all(a.latency_s <= b.latency_s for a, b in itertools.pairwise(points))
    for point in points:
        point.graph.check_schedule(point.order)
        assert simulate_memory(point.graph, point.order).peak == point.peak_bytes
        assert estimate_latency(point.graph, point.order, H200).total_s == pytest.approx(point.latency_s)


def test_recompute_front_is_monotone_and_starts_at_the_scheduled_step():
    graph = mlp_step().graph
    front = recompute_front(graph, H200)
    assert front.stopped_by == "no progress"
    assert len(front.points) > 2
    assert_monotone(front.points)
    first = front.points[0]
    assert first.peak_bytes == simulate_memory(graph, schedule(graph).order).peak and not first.recomputed
    assert all(len(p.recomputed) > 0 and not p.swapped for p in front.points[1:])
    # the greedy never raises the peak on its way; a cheap-only greedy stops no lower
    assert all(a.peak_bytes >= b.peak_bytes for a, b in itertools.pairwise(front.visited))
    cheap = recompute_front(graph, H200, heavy=False)
    assert cheap.points[-1].peak_bytes >= front.points[-1].peak_bytes


class TanhTwice(TanhGeluMLP):
    """Each block computes the same ``tanh`` twice: eager runs both, and the captured step
    keeps both outputs for the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            x = torch.tanh(h) * torch.tanh(h)
        return x.square().mean()


def test_the_recompute_greedy_starts_from_the_step_with_its_duplicates_merged():
    """Common subexpression elimination before the first round: each block's second tanh is
    merged into its first; the first point is faster than the scheduled step, peaks no
    higher, names what it merged, and computes eager's gradients (measured peak =
    simulated)."""
    torch.manual_seed(0)
    step = step_of(Built(TanhTwice(blocks=3).double(), (torch.randn(64, 16, dtype=torch.float64),)))
    graph = step.graph
    order = schedule(graph).order
    pairs = duplicates(graph, order)
    assert len(pairs) == 3 and all(graph[drop].target is torch.ops.aten.tanh.default for drop, _ in pairs)
    first = recompute_front(graph, H200, max_rounds=0).points[0]
    assert {drop for drop, _ in pairs} <= set(first.merged) and not set(first.merged) & set(first.graph.index)
    assert first.latency_s < estimate_latency(graph, order, H200).total_s
    assert first.peak_bytes < simulate_memory(graph, order).peak  # one tanh output fewer saved per block
    assert not first.recomputed
    assert_runs_like_eager(step, first.graph, first.order)


def test_recompute_front_takes_a_layers_worth_of_tensors_in_one_round():
    """On a stack of identical blocks the same tensor is saved in every block: rounds take
    several of them together (fewer rounds than tensors recomputed), the front as monotone
    and reaching as low as one at a time would (the greedy with batches of one). The
    batches' prefixes are plans too, and fill the front between rounds."""
    graph = mlp_step(blocks=8).graph
    front = recompute_front(graph, H200)
    assert_monotone(front.points)
    assert len(front.visited) - 1 < len(front.points[-1].recomputed)
    for point in front.passed:
        point.graph.check_schedule(point.order)
        assert simulate_memory(point.graph, point.order).peak == point.peak_bytes
        assert estimate_latency(point.graph, point.order, H200).total_s == pytest.approx(point.latency_s)
    assert any(any(p is q for q in front.points) for p in front.passed)
    one_by_one = recompute_front(graph, H200, batching=False)
    assert all(len(p.recomputed) == i for i, p in enumerate(one_by_one.visited))
    assert front.points[-1].peak_bytes <= one_by_one.points[-1].peak_bytes


def test_recompute_front_stops_at_its_limits():
    graph = mlp_step().graph
    assert recompute_front(graph, H200, max_rounds=1).stopped_by == "round limit"
    start = recompute_front(graph, H200, max_rounds=0).points[0].latency_s
    limited = recompute_front(graph, H200, latency_limit_s=start * 1.0001)
    assert limited.stopped_by in ("latency limit", "no progress")
    assert sum(p.latency_s > start * 1.0001 for p in limited.visited) <= 1  # the point past the limit ends it
    full = recompute_front(graph, H200)
    assert len(full.visited) >= 3
    target = full.visited[len(full.visited) // 2].peak_bytes
    reached = recompute_front(graph, H200, peak_limit_bytes=target)
    assert reached.stopped_by == "peak limit"
    assert reached.visited[-1].peak_bytes <= target < reached.visited[-2].peak_bytes  # the first point within it


def test_a_saving_rate_floor_ends_the_greedy_where_its_rounds_free_memory_too_slowly():
    """For a caller that can swap instead (the M-Optimizer under a memory limit): the greedy
    stops at the first round whose best candidate frees fewer bytes at the peak per second
    it adds than the floor, and until then takes the very rounds it takes without one."""
    graph = mlp_step(blocks=8).graph
    full = recompute_front(graph, H200)
    figures = [(p.peak_bytes, p.latency_s) for p in full.visited]
    nothing = recompute_front(graph, H200, min_saving_rate=float("inf"))
    assert nothing.stopped_by == "saving rate" and len(nothing.visited) == 1
    rates = [(a[0] - b[0]) / max(b[1] - a[1], 1e-15) for a, b in itertools.pairwise(figures)]
    floor = min(rates[: len(rates) // 2]) / 2  # below every early round's rate, above some later one's
    assert any(rate < floor for rate in rates)
    floored = recompute_front(graph, H200, min_saving_rate=floor)
    assert floored.stopped_by == "saving rate"
    k = len(floored.visited)
    assert len(rates) // 2 < k < len(figures)
    assert [(p.peak_bytes, p.latency_s) for p in floored.visited] == figures[:k]


def test_every_round_of_the_greedy_lowers_the_peak_or_narrows_its_plateau():
    """A round can narrow the peak's plateau with a copy that the round's own merges (step 5)
    then fold into a copy computed before, ending where it started; the next round would
    propose it again, round after round, until the time budget. Such a round ends the greedy."""
    front = recompute_front(mlp_step(blocks=16).graph, H200, time_budget=300.0)
    assert front.stopped_by == "no progress"
    for before, after in itertools.pairwise(front.visited):
        assert after.peak_bytes < before.peak_bytes or (
            after.peak_bytes == before.peak_bytes and after.peak_steps < before.peak_steps
        )


def test_a_limit_inside_a_batch_finds_the_prefix_at_the_limit():
    """A round that takes eight layers at once jumps over the plans of 5, 6 and 7 of them
    (its power-of-two prefixes give 1, 2 and 4). A latency limit inside that jump gets the
    longest prefix within it, a peak limit the shortest: the plan one layer at a time
    would give there, better than any the unlimited greedy's front holds."""
    graph = mlp_step(blocks=16).graph
    free = recompute_front(graph, H200)
    jump = next(
        (a, b)
        for a, b in itertools.pairwise(free.visited)
        if len(b.recomputed) - len(a.recomputed) >= 8 and len(a.recomputed) > 0
    )
    known = pareto([*free.visited, *free.passed])
    latency_limit = jump[1].latency_s - 1e-9
    near = recompute_front(graph, H200, latency_limit_s=latency_limit)
    within = [p for p in near.points if p.latency_s <= latency_limit]
    best_known = min(p.peak_bytes for p in known if p.latency_s <= latency_limit)
    assert min(p.peak_bytes for p in within) < best_known
    assert_monotone(near.points)
    at_limit = min(within, key=lambda p: p.peak_bytes)
    assert len(at_limit.recomputed) == len(jump[1].recomputed) - 1  # each layer adds latency: all but one fit

    four = next(p for p in free.passed if len(p.recomputed) == len(jump[0].recomputed) + 4)
    peak_limit = four.peak_bytes - 1  # just below the batch's prefix of four layers
    reached = recompute_front(graph, H200, peak_limit_bytes=peak_limit)
    fitting = [p for p in reached.points if p.peak_bytes <= peak_limit]
    assert min(p.latency_s for p in fitting) < min(p.latency_s for p in known if p.peak_bytes <= peak_limit)
    assert min(len(p.recomputed) for p in fitting) == len(four.recomputed) + 1  # one more layer is enough


def test_swap_front_swaps_and_refuses_a_cpu():
    graph = mlp_step().graph
    front = swap_front(graph, H200)
    assert_monotone(front.points)
    assert front.points[-1].swapped and not front.points[-1].recomputed
    assert front.points[-1].peak_bytes < front.visited[0].peak_bytes  # hidden transfers: one point may beat all
    with pytest.raises(ValueError, match="swapping frees no memory on a CPU"):
        swap_front(graph, cost_model("cpu"))


def test_the_swap_greedy_takes_several_layers_tensors_in_one_round():
    """Step 6 for swapping: a deep stack saves the same tensors in every layer, and a round
    stores several of them in one rewrite (:func:`magis.rules.swap.swapped_together`); every
    point of the front is a valid plan whose figures are its own, and a batch's plan runs
    like eager with the peak the simulator gives it."""
    step = mlp_step(blocks=12)
    front = swap_front(step.graph, H200)
    assert_monotone(front.points)
    taken = [len(b.swapped) - len(a.swapped) for a, b in itertools.pairwise(front.visited)]
    assert max(taken) > 1, taken
    batch = next(b for a, b in itertools.pairwise(front.visited) if len(b.swapped) - len(a.swapped) > 1)
    assert sum(isinstance(n.target, Store) for n in batch.graph.nodes) == len(batch.swapped)
    assert_runs_like_eager(step, batch.graph, batch.order)


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("rule", ["remat", "swap"])
def test_remat_json_has_the_documented_keys_and_runs_like_eager(rule, capsys, tmp_path):
    """Every plan of the front, run by the magis runtime (a swap's host copies apart), peaks
    where the simulator says (within 2%) and computes eager's gradients; the front is drawn."""
    plot = tmp_path / "front.png"
    options = ["--plot", str(plot), *(["--swap"] if rule == "swap" else ["--latency-limit", "1.03"])]
    report = run_json(capsys, "remat", "vit-base", "--preset", "tiny", "--device", "h200", "--run", "--json", *options)
    for key in ("model", "preset", "device", "baseline_peak_bytes", "baseline_latency_s", "front"):
        assert key in report, key
    assert (report["model"], report["preset"], report["device"]) == ("vit-base", "tiny", "h200")
    assert report["front"][-1]["peak_bytes"] < report["baseline_peak_bytes"]
    for point in report["front"]:
        keys = ("peak_bytes", "latency_s", "recomputed", "swapped", "merged", "measured_peak_bytes", "max_grad_error")
        assert all(key in point for key in keys), point.keys()
        assert abs(point["measured_peak_bytes"] - point["peak_bytes"]) <= 0.02 * point["peak_bytes"]
        assert point["max_grad_error"] < 1e-4
    assert report["plot"] == str(plot) and plot.stat().st_size > 0
    changed = report["front"][-1]["swapped" if rule == "swap" else "recomputed"]
    unchanged = report["front"][-1]["recomputed" if rule == "swap" else "swapped"]
    assert changed and not unchanged


@pytest.mark.parametrize(
    ("argv", "cause"),
    [
        (["remat", "unet", "--device", "cpu", "--swap"], "swapping frees no memory on a CPU"),
        (["remat", "unet", "--preset", "paper", "--run"], "--run needs real weights"),
    ],
)
def test_remat_refuses_what_makes_no_sense(argv, cause, capsys):
    assert main(argv) == 2
    assert cause in capsys.readouterr().err


def test_the_swap_greedy_never_swaps_a_tensor_stored_already():
    """A tensor stored after the peak has its Store among its late readers; swapping it
    again would wrap the first swap (a Load read by a Store), which no schedule places.
    On this stack the greedy used to try it in its second round."""
    torch.manual_seed(0)
    graph = capture(GeluStack().double(), (torch.randn(256, 64, dtype=torch.float64),))
    front = swap_front(graph, cost_model("h200"), time_budget=30)
    assert front.stopped_by == "no progress"
    for point in front.visited:
        for node in point.graph.nodes:
            if isinstance(node.target, Load):
                assert not any(isinstance(point.graph[r].target, Store) for r in point.graph.successors[node.name])
