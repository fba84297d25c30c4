"""Memory-optimal ordering by dynamic programming (Serenity, MLSys'20, §3.1-3.2).

The signature of a partial schedule is the set of units it ran (an int bitset): the
live bytes and what is ready next depend on that set only, so of all partial
schedules with one signature only the one with the lowest peak can start an optimal
schedule. The search runs level by level (|signature| = 0, 1, ...) keeping one best
state per signature (Serenity Alg. 1). A budget prunes every state whose peak
exceeds it; adaptive soft budgeting (Serenity Alg. 2) searches for a budget that is
tight enough for the search to finish in time and loose enough to keep the optimum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from magis.ir.graph import Graph
from magis.schedule.problem import OrderingProblem, State, memory_facts, segment_problem


class ScheduleTimeout(TimeoutError):
    """The exact search did not finish within its time limit."""


class _Infeasible(Exception):
    """No schedule has a peak within the budget."""


_CHECK_EVERY = 512  # states between two looks at the clock


def dp_order(problem: OrderingProblem, budget: float = float("inf"), deadline: float = float("inf")) -> State:
    """Serenity Alg. 1: the complete state of minimum peak, pruning peaks above ``budget``.

    Raises :class:`ScheduleTimeout` at ``deadline`` (a ``time.perf_counter`` value) and
    :class:`_Infeasible` when every schedule's peak exceeds ``budget``.
    """
    start = problem.start()
    level = {0: start}
    count = 0
    for _ in range(len(problem)):
        nxt: dict[int, State] = {}
        for state in level.values():
            count += 1
            if count % _CHECK_EVERY == 0 and time.perf_counter() > deadline:
                raise ScheduleTimeout(f"the DP did not finish within its time limit ({len(problem)} units)")
            for succ in problem.successors(state, budget):
                old = nxt.get(succ.done)
                if old is None or succ.peak < old.peak:
                    nxt[succ.done] = succ
        if not nxt:
            raise _Infeasible
        level = nxt
    return next(iter(level.values()))


@dataclass(frozen=True)
class BudgetSearch:
    """What adaptive soft budgeting found: the best state, whether it is proven optimal, its attempts."""

    state: State
    optimal: bool
    attempts: tuple[tuple[int, str], ...]  # (budget, "solved" | "infeasible" | "timeout")


def soft_budget_order(problem: OrderingProblem, incumbent: State, deadline: float, step_limit: float) -> BudgetSearch:
    """Serenity Alg. 2, adaptive soft budgeting: binary search on the DP's pruning budget.

    ``incumbent`` is a complete state already found (e.g. the greedy order's): its
    peak bounds the search (the hard budget), and the search looks for strictly
    better. Each attempt runs :func:`dp_order` for at most ``step_limit`` seconds: a
    timeout means the budget prunes too little (lower it), an infeasible budget
    prunes the optimum away (raise it). The first attempt that finishes returns the
    optimum, since every budget at or above the optimum keeps it; infeasible just
    below the incumbent's peak proves the incumbent optimal.
    """
    lo, hi = problem.lower_bound, incumbent.peak - 1
    budget = hi
    attempts: list[tuple[int, str]] = []
    while lo <= hi and time.perf_counter() < deadline:
        try:
            state = dp_order(problem, budget, min(deadline, time.perf_counter() + step_limit))
        except ScheduleTimeout:
            attempts.append((budget, "timeout"))
            hi = budget - 1
        except _Infeasible:
            attempts.append((budget, "infeasible"))
            lo = budget + 1
        else:
            attempts.append((budget, "solved"))
            return BudgetSearch(state, True, tuple(attempts))
        budget = (lo + hi) // 2
    proven = lo >= incumbent.peak
    return BudgetSearch(incumbent, proven or len(problem) < 2, tuple(attempts))


def dp_schedule(graph: Graph, time_limit_s: float | None = None, budget: int | None = None) -> list[str]:
    """The memory-optimal order of ``graph`` by Serenity's DP over the whole graph, no partitioning.

    Exact: the peak (as :func:`magis.cost.memory.peak_memory` counts it) is the
    minimum over all topological orders. Exponential in the graph's width, so meant
    for small graphs and pieces; raises :class:`ScheduleTimeout` after ``time_limit_s``
    and ``ValueError`` when no order peaks within ``budget`` bytes.
    """
    problem = segment_problem(graph, [n.name for n in graph.nodes])
    deadline = float("inf") if time_limit_s is None else time.perf_counter() + time_limit_s
    local_budget = float("inf") if budget is None else budget - memory_facts(graph).persistent_bytes
    try:
        state = dp_order(problem, local_budget, deadline)
    except _Infeasible:
        raise ValueError(f"no order of this graph peaks within the budget of {budget} bytes") from None
    return problem.nodes(state.units())
