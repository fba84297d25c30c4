"""Fast orders that bound the optimum: a memory-greedy list schedule and a beam search.

Both walk the same state space as the exact DP (:mod:`magis.schedule.dp`) and run a
dominant step at once. The greedy order is the upper bound that adaptive soft
budgeting starts from (Serenity §3.2 uses Kahn's order; a memory-aware choice of
the next node gives a tighter bound); the beam search is the bounded-time fallback
for pieces the DP cannot finish.
"""

from __future__ import annotations

import heapq
import time

from magis.ir.graph import Graph
from magis.schedule.problem import OrderingProblem, State, segment_problem

CANDIDATES = 16  # ready units a heuristic step considers: the first listed, i.e. closest to the input order
_CHECK_EVERY = 64  # greedy steps between two looks at the clock


def rank(state: State) -> tuple[int, int]:
    """How heuristics compare partial schedules: lower peak, then fewer live bytes."""
    return state.peak, state.live


def greedy_order(problem: OrderingProblem, state: State | None = None, deadline: float = float("inf")) -> State:
    """List scheduling: run the ready unit that keeps (peak, live bytes) lowest, ties to the first listed.

    Starts from ``state`` (default: the beginning) and returns the complete state.
    Each step weighs at most ``CANDIDATES`` ready units, so a step costs the same on
    a very wide graph; past ``deadline`` the remaining units run in the listed order.
    """
    state = problem.start() if state is None else state
    while state.ready and time.perf_counter() < deadline:
        for _ in range(_CHECK_EVERY):
            if not state.ready:
                break
            state = min(problem.successors(state, limit=CANDIDATES), key=rank)
    for u in range(len(problem)):
        if not state.done >> u & 1:
            state = problem.advance(state, u)
    return state


def beam_order(problem: OrderingProblem, width: int, deadline: float = float("inf")) -> State:
    """Beam search: the DP restricted to the ``width`` best signatures (by peak, then live bytes) per level.

    Bounded time: past ``deadline`` the best partial state is finished in the listed order.
    """
    level = [problem.start()]
    for _ in range(len(problem)):
        if time.perf_counter() > deadline:
            return greedy_order(problem, min(level, key=rank), deadline)
        best: dict[int, State] = {}
        for state in level:
            for succ in problem.successors(state, limit=CANDIDATES):
                old = best.get(succ.done)
                if old is None or rank(succ) < rank(old):
                    best[succ.done] = succ
        level = heapq.nsmallest(width, best.values(), key=rank)
    return level[0]


def greedy_schedule(graph: Graph) -> list[str]:
    """A memory-greedy topological order of ``graph`` (see :func:`greedy_order`)."""
    problem = segment_problem(graph, [n.name for n in graph.nodes])
    return problem.nodes(greedy_order(problem).units())
