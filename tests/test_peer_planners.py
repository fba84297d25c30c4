"""The rematerialization baselines: Checkmate's MILP is optimal (against brute force), never
infeasible where the step itself fits, however coarsely grouped; DTR keeps its budget or says
it cannot; both plans replay as graphs within their budgets."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from math import inf

import pytest

from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.models import build_workload, random_randwire_graph, random_training_graph
from yardstick.methods import Subject
from yardstick.methods.checkmate_dtr_peers import captured_problem, memory_limit
from yardstick.planners.checkmate import Stages, checkmate_plan, stages
from yardstick.planners.dtr import dtr_plan
from yardstick.planners.recompute_problem import DoesNotFit, RematProblem, remat_problem, replay, sequence_peak


def _cost(name: str) -> float:
    """Deterministic small integer costs: optima compare exactly."""
    return 1.0 + sum(map(ord, name)) % 3


def brute_force(st: Stages, budget: int) -> float | None:
    """The least total cost of Checkmate's program, by enumeration: per stage, every set of
    earlier runs to recompute and every set of values to keep, memory walked step by step."""
    size = st.size  # a property that sums: read once
    best: dict[tuple[int, ...], float] = {(): 0.0}  # the values kept, sorted: a set as a key
    for t in range(len(st)):
        reachable: dict[tuple[int, ...], float] = {}
        for resident, cost in best.items():
            held = st.static + sum(st.kept[:t]) + sum(st.values[v].size for v in resident)
            for computed, have in _stage_runs(st, t, resident):
                total = cost + sum(st.cost[k] for k in computed)
                for keep in _subsets([v for v in sorted(have) if _useful(st, v, t)]):
                    if total < reachable.get(keep, inf) and _stage_fits(st, size, t, held, computed, keep, budget):
                        reachable[keep] = total
        best = reachable
    return min(best.values(), default=None)


def _stage_runs(st: Stages, t: int, resident: tuple[int, ...]) -> Iterator[tuple[list[int], set[int]]]:
    """Every set of runs stage ``t`` may compute holding ``resident`` (``t`` and earlier runs again,
    each reading what is held or computed before it), and what it holds once they ran."""
    for r in range(t + 1):
        for again in itertools.combinations([k for k in range(t) if k not in st.fixed], r):
            computed = sorted({*again, t})
            have = set(resident)
            if any(not set(st.reads[k]) <= have or have.update(st.made[k]) for k in computed):
                continue
            yield computed, have


def _useful(st: Stages, v: int, t: int) -> bool:
    """A later stage than ``t`` may read ``v``, or recompute a reader."""
    return any(j > t or j not in st.fixed for j in st.values[v].readers)


def _subsets(pool: list[int]) -> Iterator[tuple[int, ...]]:
    """Every subset of ``pool`` (sorted), smallest first, as a sorted tuple."""
    for m in range(len(pool) + 1):
        yield from itertools.combinations(pool, m)


def _stage_fits(
    st: Stages,
    size: tuple[int, ...],
    t: int,
    held: int,
    computed: list[int],
    keep: tuple[int, ...],
    budget: int,
) -> bool:
    """Whether stage ``t`` (runs of ``size`` bytes), holding ``held`` bytes as it starts, computing
    ``computed`` and keeping ``keep`` after, stays within ``budget`` at every run (memory walked
    step by step)."""
    live = held
    for k in computed:
        live += size[k] + (st.kept[t] if k == t else 0)
        if live + st.workspace[k] + (st.kept[k] if k < t else 0) > budget:
            return False
        for v in (*st.reads[k], *st.made[k]):
            if v not in keep and not any(j in computed and j > k for j in st.values[v].readers):
                live -= st.values[v].size
    return True


def budgets(problem: RematProblem, st: Stages) -> list[int]:
    """From the least any single step needs to the peak without recomputation."""
    low = max(
        st.static + sum(st.kept[: k + 1]) + st.size[k] + st.workspace[k] + sum(st.values[v].size for v in st.reads[k])
        for k in range(len(st))
    )
    high = problem.no_remat_peak
    return sorted({int(low + f * (high - low)) for f in (0.0, 0.35, 0.7, 1.0)})


GRAPHS = [
    *(random_training_graph(layers, seed) for layers, seed in [(3, 0), (3, 1), (4, 2), (4, 3), (4, 4), (4, 5)]),
    random_randwire_graph(11, seed=3, k=2),  # a larger graph's brute force takes minutes
]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: f"{len(g)}-nodes")
def test_checkmate_equals_brute_force(graph):
    problem = remat_problem(graph, _cost)
    st = stages(problem)
    assert [r for run in st.runs for r in run] == list(range(len(problem)))  # no coarsening at this size
    solved = 0
    for budget in budgets(problem, st):
        expected = brute_force(st, budget)
        if expected is None:
            with pytest.raises(DoesNotFit):
                checkmate_plan(problem, budget)
            continue
        plan = checkmate_plan(problem, budget)
        assert plan.status == "optimal"
        assert plan.cost == pytest.approx(expected)
        assert sum(problem.cost[u] for u in plan.sequence) == pytest.approx(expected)
        plan_graph, order = replay(problem, plan.sequence)
        assert simulate_memory(plan_graph, order).peak <= budget
        solved += 1
    assert solved


def test_checkmate_recomputes_to_fit_a_budget_no_order_meets():
    graph = random_training_graph(4, 4)
    problem = remat_problem(graph, _cost)
    budget = min(budgets(problem, stages(problem)))
    assert budget < problem.no_remat_peak
    plan = checkmate_plan(problem, budget)
    assert len(plan.sequence) > len(problem)  # something is computed twice
    assert plan.cost > sum(problem.cost)


@pytest.fixture(scope="module")
def resnet():
    """ResNet-50 at tiny size: batch norms make several storages per unit (the output, the saved
    statistics) and outputs of the step (running statistics); 132 units, so Checkmate groups them."""
    return Subject("resnet50", "tiny")


def test_sequence_peak_is_the_simulated_peak_of_the_replay(resnet):
    problem = captured_problem(resnet)
    graph = resnet.graph
    assert problem.no_remat_peak == simulate_memory(graph, [n.name for n in graph.nodes]).peak
    batch_norms = [u for u, names in enumerate(problem.units) if "batch_norm" in names[0] and u not in problem.once]
    sequence = list(range(len(problem)))
    for u in batch_norms[::4]:  # recompute before the last reader (batch norm backward): outputs copied too
        sequence.insert(sequence.index(max(problem.users[u])), u)
    assert len(sequence) > len(problem)
    assert sequence_peak(problem, sequence) == simulate_memory(*replay(problem, sequence)).peak


@pytest.mark.parametrize("max_stages", [4, 12, 30])
def test_checkmate_meets_the_steps_own_peak_however_grouped(resnet, max_stages):
    """``checkmate@1`` (Checkmate's issue #151: budgets the unmodified model met declared infeasible)."""
    problem = captured_problem(resnet)
    budget = memory_limit(resnet, 1.0)
    assert len(stages(problem, max_stages, budget)) < len(problem)
    plan = checkmate_plan(problem, budget, max_stages=max_stages)
    assert plan.stages < plan.units
    assert plan.cost == pytest.approx(sum(problem.cost))  # nothing to recompute
    assert simulate_memory(*replay(problem, plan.sequence)).peak <= budget


def test_checkmate_groups_finer_where_the_grouped_program_is_infeasible(resnet):
    problem = captured_problem(resnet)
    budget = memory_limit(resnet, 0.7)
    coarse = stages(problem, 4, budget)
    plan = checkmate_plan(problem, budget, max_stages=4)
    assert plan.stages > len(coarse)
    assert len(plan.sequence) > len(problem)
    assert simulate_memory(*replay(problem, plan.sequence)).peak <= budget


def test_checkmate_starts_from_a_plan_that_fits(resnet):
    """With no time to search, HiGHS still reports the eviction heuristic's plan. Over 60
    stages: HiGHS 1.16 solves the program over 30 to optimality within the millisecond."""
    problem = captured_problem(resnet)
    budget = memory_limit(resnet, 0.7)
    plan = checkmate_plan(problem, budget, time_limit_s=1e-3, max_stages=60)
    assert plan.status == "time limit"
    assert len(plan.sequence) > len(problem)
    assert simulate_memory(*replay(problem, plan.sequence)).peak <= budget


def test_checkmate_names_the_unit_no_budget_fits(resnet):
    problem = captured_problem(resnet)
    with pytest.raises(DoesNotFit, match=r"needs \d+ bytes with only its inputs"):
        checkmate_plan(problem, problem.static + sum(problem.kept))


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: f"{len(g)}-nodes")
def test_dtr_keeps_its_budget_or_says_it_cannot(graph):
    problem = remat_problem(graph, _cost)
    high = problem.no_remat_peak
    for budget in range(high // 3, high + 1, max(1, high // 12)):
        try:
            plan = dtr_plan(problem, budget)
        except DoesNotFit as err:
            assert "within" in str(err) or "alone" in str(err)
            continue
        assert plan.peak <= budget
        assert sequence_peak(problem, plan.sequence) <= budget
        plan_graph, order = replay(problem, plan.sequence)
        assert simulate_memory(plan_graph, order).peak <= budget


def test_dtr_gives_up_when_it_thrashes():
    """A plan that runs more than ``max_runs`` x the step's operators is refused, with the count."""
    for graph in GRAPHS:
        problem = remat_problem(graph, _cost)
        for percent in range(90, 20, -10):
            try:
                plan = dtr_plan(problem, problem.no_remat_peak * percent // 100)
            except DoesNotFit:
                break
            if plan.recomputations:
                budget, runs = problem.no_remat_peak * percent // 100, len(plan.sequence) / len(problem)
                assert dtr_plan(problem, budget, max_runs=runs).sequence == plan.sequence
                with pytest.raises(DoesNotFit, match=r"DTR thrashes within \d+ bytes: \d+ operations run"):
                    dtr_plan(problem, budget, max_runs=runs - 1 / len(problem))  # one operation short
                return
    pytest.fail("DTR recomputed nothing on any test graph")


def test_random_ops_are_never_recomputed():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    built = build_workload("bert-base", "tiny", None)  # dropout p=0.1 in every layer
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    problem = remat_problem(graph, lambda _name: 1.0)
    random_units = {u for u, names in enumerate(problem.units) if any(graph[n].random for n in names)}
    assert random_units and random_units <= problem.once
    recomputed = 0
    for percent in range(95, 40, -5):  # down to where DTR cannot fit
        try:
            plan = dtr_plan(problem, problem.no_remat_peak * percent // 100)
        except DoesNotFit:
            break
        recomputed += plan.recomputations
        assert all(plan.sequence.count(u) == 1 for u in random_units)
    assert recomputed > 0
    with pytest.raises(ValueError, match="twice"):
        replay(problem, [*range(len(problem)), min(random_units)])
