"""``checkmate`` and ``dtr``: the rematerialization baselines, planned on the captured step and run
for real as magis-runtime graphs holding the recomputed copies.

- ``checkmate`` — Checkmate's optimal rematerialization (MILP, HiGHS) of the captured step within
  the budget (:mod:`yardstick.planners.checkmate`); the row's ``details`` give the solver status,
  the gap left and the solve time.
- ``dtr`` — Dynamic Tensor Rematerialization's eviction policy simulated on the captured step
  within the budget (:mod:`yardstick.planners.dtr`).

The memory limit of ``checkmate@B`` and ``dtr@B`` (:func:`memory_limit`) is what no plan can free
(parameters, buffers, inputs, and the gradients and loss the step returns) plus ``B`` times the rest
of the captured step's simulated peak: as ``compile@B``, a budget for activations. Both plan with
the :data:`~yardstick.methods.method_registry.DEFAULT_DEVICE` cost model.
"""

from __future__ import annotations

from typing import Any

from magis.cost.latency import cost_model
from magis.cost.memory import simulate_memory
from magis.ir.graph import Graph
from yardstick.methods.method_registry import (
    DEFAULT_DEVICE,
    PEER,
    Method,
    MethodUnavailable,
    Simulated,
    register,
)
from yardstick.methods.steps import planned_steps
from yardstick.methods.subject import Subject
from yardstick.planners.checkmate import CheckmatePlan, checkmate_plan
from yardstick.planners.dtr import DTRPlan, dtr_plan
from yardstick.planners.recompute_problem import DoesNotFit, RematProblem, remat_problem, replay

#: HiGHS' time limit for one Checkmate program (per workload and budget)
CHECKMATE_TIME_LIMIT_S = 60.0

Planned = tuple[CheckmatePlan | DTRPlan, Graph, tuple[str, ...]]


def captured_problem(subject: Subject) -> RematProblem:
    """The captured step as the rematerialization baselines see it, priced on :data:`DEFAULT_DEVICE` (made once)."""

    def make() -> RematProblem:
        model = cost_model(DEFAULT_DEVICE)
        return remat_problem(subject.graph, lambda name: model.node_seconds(subject.graph, name))

    return subject.once("remat_problem", make)


def memory_limit(subject: Subject, budget: float) -> int:
    """What stays whatever the plan (parameters, inputs, the gradients and loss it returns) plus
    ``budget`` times the rest of the captured step's simulated peak: the activations' share."""
    problem = captured_problem(subject)
    floor = problem.static + sum(problem.kept)
    peak = simulate_memory(subject.graph, [n.name for n in subject.graph.nodes]).peak
    return int(floor + budget * (peak - floor))


def remat_plan(subject: Subject, planner: str, budget: float) -> Planned:
    """``planner``'s (``checkmate`` or ``dtr``) plan within :func:`memory_limit`, its graph and order
    (made once per budget). Raises :class:`MethodUnavailable` when no plan fits."""

    def make() -> Planned:
        problem, limit = captured_problem(subject), memory_limit(subject, budget)
        try:
            if planner == "checkmate":
                plan: CheckmatePlan | DTRPlan = checkmate_plan(problem, limit, CHECKMATE_TIME_LIMIT_S)
            else:
                plan = dtr_plan(problem, limit)
        except DoesNotFit as err:
            raise MethodUnavailable(f"{err} (budget {budget:g}: {limit} bytes)") from err
        return (plan, *replay(problem, plan.sequence))

    return subject.once(("remat_plan", planner, budget), make)


def _plan_facts(plan: CheckmatePlan | DTRPlan, subject: Subject) -> dict[str, Any]:
    """What the planner says of its plan: the solver's status, gap and time, or DTR's evictions."""
    if isinstance(plan, CheckmatePlan):
        coarse = "" if plan.stages == plan.units else f", grouped into {plan.stages} runs of consecutive units"
        return {
            "solver": plan.status,
            "gap": plan.gap,
            "solve_s": round(plan.seconds, 2),
            "solved": f"{plan.units} units of {len(subject.graph)} nodes (views folded into producers){coarse}",
        }
    return {
        "evictions": plan.evictions,
        "recomputations": plan.recomputations,
        "random_ops": "never evicted (no mask is drawn twice)",
    }


def _baseline(planner: str, description: str) -> Method:
    """The rematerialization baseline ``planner`` (``checkmate``, ``dtr``) as a budgeted method."""

    def planned(subject: Subject, budget: float) -> Simulated:
        _, graph, order = remat_plan(subject, planner, budget)
        return graph, order

    def details(subject: Subject, budget: float | None) -> dict[str, Any]:
        assert budget is not None
        plan, graph, _ = remat_plan(subject, planner, budget)
        return {
            "memory_limit_bytes": memory_limit(subject, budget),
            "recomputed_nodes": len(graph) - len(subject.graph),
        } | _plan_facts(plan, subject)

    return Method(planner, description, PEER, *planned_steps(planned), budgeted=True, details=details)


register(
    _baseline(
        "checkmate",
        "Checkmate's optimal rematerialization (MILP solved by HiGHS) of the captured step within the budget",
    )
)
register(
    _baseline(
        "dtr", "Dynamic Tensor Rematerialization's evictions (cost / (size x staleness)) simulated within the budget"
    )
)
