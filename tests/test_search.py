"""The best single fission under a memory limit (magis.search.single_fission) and the
``magis-fission`` method of the yardstick that runs it."""

from __future__ import annotations

import pytest
from test_fission import assert_runs_like_eager, captured, in_float64

from magis.backend.eager import max_relative_error
from magis.backend.meter import resident_tensors
from magis.cost.latency import estimate_latency
from magis.cost.memory import simulate_memory
from magis.models import WORKLOADS
from magis.schedule import schedule
from magis.search.single_fission import (
    best_single_fission,
    choose_within,
    fission_numbers,
    single_fission_options,
)
from yardstick.methods import LATENCY_LIMITS, METHODS, Subject, magis_methods, variants
from yardstick.methods.magis_methods import fission_options, fission_within
from yardstick.protocol import measure_peak


@pytest.fixture(scope="module")
def unet():
    c = captured(in_float64(WORKLOADS["unet"].build("tiny", seed=0)))
    order = tuple(schedule(c.graph).order)
    return c, order, single_fission_options(c.graph, order)


def test_options_are_the_step_and_its_single_fissions(unet):
    c, order, options = unet
    assert options[0].parts == 1 and options[0].graph is c.graph and options[0].order == order
    assert all(o.parts > 1 and o.candidate is not None for o in options[1:])
    spanning = max(options[1:], key=lambda o: len(o.candidate.nodes))
    assert spanning.parts in fission_numbers(spanning.candidate.length)
    for option in options:
        assert simulate_memory(option.graph, option.order).peak == option.peak_bytes
    assert_runs_like_eager(c, spanning.graph, spanning.order)


def test_choice_is_the_fewest_parts_that_fit(unet):
    _, _, options = unet
    for limit in sorted({o.peak_bytes for o in options}):
        chosen = choose_within(options, limit)
        assert chosen.peak_bytes <= limit
        fitting = [o for o in options if o.peak_bytes <= limit]
        assert chosen.parts == min(o.parts for o in fitting)
        assert chosen.peak_bytes == min(o.peak_bytes for o in fitting if o.parts == chosen.parts)
    lowest = min(o.peak_bytes for o in options)
    assert choose_within(options, lowest - 1).peak_bytes == lowest  # nothing fits: the lowest peak


def test_best_single_fission_is_the_choice_among_the_options(unet):
    c, order, options = unet
    limit = sorted(o.peak_bytes for o in options)[len(options) // 2]
    best = best_single_fission(c.graph, order, limit)
    expected = choose_within(options, limit)
    assert (best.parts, best.peak_bytes) == (expected.parts, expected.peak_bytes)


def test_fission_numbers():
    assert fission_numbers(32) == [2, 4, 8, 16, 32]
    assert fission_numbers(197) == [197]  # a prime length: its only fission number
    assert fission_numbers(12) == [2, 4]
    assert fission_numbers(1) == []


def test_magis_fission_method_runs_with_eagers_gradients_and_its_simulated_peak():
    subject = Subject("unet", "tiny")
    eager = METHODS["eager"].real(subject, None)
    _, reference = measure_peak(eager.step, resident_tensors(eager.built.model, eager.built.example_inputs))
    method = METHODS["magis-fission"]
    for budget in (1.0, 0.01):  # the scheduled step fits; nothing fits (the lowest peak)
        runnable = method.real(subject, budget)
        peak, result = measure_peak(runnable.step, resident_tensors(subject.built.model, subject.inputs))
        graph, order = method.simulate(subject, budget)
        assert abs(simulate_memory(graph, order).peak - peak) <= 0.02 * peak
        assert max_relative_error(reference.gradients, result.gradients) < 1e-4
    assert fission_within(subject, 1.0).parts == 1
    assert fission_within(subject, 0.01).peak_bytes == min(o.peak_bytes for o in fission_options(subject))


def test_magis_optimize_method_runs_with_eagers_gradients_and_its_simulated_peak(monkeypatch):
    monkeypatch.setattr(magis_methods, "OPTIMIZE_STATES", 12)  # the first level of the search: single fissions
    subject = Subject("gpt-neo-1.3b", "tiny")
    eager = METHODS["eager"].real(subject, None)
    _, reference = measure_peak(eager.step, resident_tensors(eager.built.model, eager.built.example_inputs))
    method = METHODS["magis-optimize"]
    runnable = method.real(subject, 0.8)
    peak, result = measure_peak(runnable.step, resident_tensors(subject.built.model, subject.inputs))
    graph, order = method.simulate(subject, 0.8)
    simulated = simulate_memory(graph, order).peak
    captured = simulate_memory(subject.graph, [n.name for n in subject.graph.nodes]).peak
    assert simulated <= 0.8 * captured
    assert abs(simulated - peak) <= 0.02 * peak
    assert max_relative_error(reference.gradients, result.gradients) < 1e-4
    details = method.details(subject, 0.8)  # the plan as the search saw it, beside the measured row
    assert details["simulated_peak_ratio"] == pytest.approx(simulated / captured)
    # the floor: at least the weights and their gradients, and no more than any plan (or its run) holds
    weights = sum(p.numel() * p.element_size() for p in subject.built.model.parameters())
    assert 2 * weights <= details["floor_ratio"] * captured <= min(simulated, peak)
    # priced by the search's own cost model: a fresh profiled model would re-time operators
    # (on a busy machine, other timings), so only the search's model can reproduce its ratio
    _, baseline_s = magis_methods.captured_simulated(subject)
    latency_s = estimate_latency(graph, order, magis_methods.search_model(subject)).total_s
    assert details["simulated_latency_ratio"] == pytest.approx(latency_s / baseline_s, rel=1e-3)


def test_magis_optimize_lat_method_keeps_its_latency_limit_and_eagers_gradients(monkeypatch):
    monkeypatch.setattr(magis_methods, "OPTIMIZE_STATES", 12)
    assert [v.name for v in variants(["magis-optimize-lat"])] == [
        "eager",
        *(f"magis-optimize-lat@{limit:g}" for limit in LATENCY_LIMITS),
    ]
    subject = Subject("gpt-neo-1.3b", "tiny")
    eager = METHODS["eager"].real(subject, None)
    _, reference = measure_peak(eager.step, resident_tensors(eager.built.model, eager.built.example_inputs))
    method = METHODS["magis-optimize-lat"]
    graph, order = method.simulate(subject, 1.1)
    _, baseline_s = magis_methods.captured_simulated(subject)  # priced by the search's model, as above
    assert estimate_latency(graph, order, magis_methods.search_model(subject)).total_s <= 1.1 * baseline_s
    captured = [n.name for n in subject.graph.nodes]
    assert simulate_memory(graph, order).peak <= simulate_memory(subject.graph, captured).peak
    runnable = method.real(subject, 1.1)
    _, result = measure_peak(runnable.step, resident_tensors(subject.built.model, subject.inputs))
    assert max_relative_error(reference.gradients, result.gradients) < 1e-4
