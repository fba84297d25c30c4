"""The search's choice confirmed by timing: the plans nearest the best, run for real in turns
with the captured step before one is returned (on a CPU).

The search ranks states by the simulator's latency (MAGIS §5), whose operators never timed
are estimated from their kin (:class:`~magis.cost.latency.ProfiledCostModel`). On a CPU those
estimates can be off by 10-20% where a plan runs operators of a form the captured step never
ran, and the captured step's own time moves from process to process (a batch-1 forward of a
few milliseconds: 2.5 ms in one, 4.4 in the next). A latency limit is a ratio to the captured
step, so what it needs is the two timed at the same moment. Before returning, the few states
of the search's peak/latency front nearest the best (:func:`contenders`) are timed whole, in
turns with the step they are compared to (the caller says how: the captured step as the
runtime runs it, :meth:`~magis.cost.latency.ProfiledCostModel.time_steps`, or for an inference
plan each state called as its user calls it beside the model's own forward, in
:func:`magis.api.optimize`), and the best of them by the objective with the timed figures
wins: a plan estimated just over the limit that runs within it replaces one estimated within
it, and one that runs over it gives way to the next. A latency limit then holds as timed, not
only as estimated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from magis.cost.op_timing import StepsTimed
from magis.ir.graph import Graph
from magis.search.objective import Objective
from magis.search.state import MState

#: states over the latency limit by at most this factor may be timed within it (the kin's
#: estimates of a CPU plan were 10-20% off where it ran operators of a new form)
RELAX = 1.25
#: states of the front timed on each side of the best
NEAR = 3

#: steps are timed only where warming each up and this many rounds fit the time given
ROUNDS_ESTIMATED = 4

#: times the steps given (the captured step first) in turns, for at most about the seconds given
TimeSteps = Callable[[Sequence[tuple[Graph, Sequence[str]]], float], StepsTimed]


@dataclass(frozen=True)
class TimedChoice:
    """The state chosen with the timed figures, the objective rescaled to the captured step as
    timed (a latency limit is a ratio to it), that step's timed latency, and what was done."""

    best: MState
    objective: Objective
    baseline_latency_s: float
    plans: int  # states timed
    rounds: int  # rounds of turns that counted
    note: str


def contenders(front: Sequence[MState], best: MState, initial: MState, objective: Objective) -> list[MState]:
    """The states worth timing, most worth it first: ``best``, its nearest neighbour on each
    side on the ``front`` (states no other beats in both peak and latency), ``initial`` (the
    scheduled captured step, which meets any latency limit as timed but for noise), then each
    side's farthest and next nearest, up to :data:`NEAR` on each side.

    In latency mode the neighbours are the states of lower peak estimated over the limit by at
    most :data:`RELAX` (nearest the limit first: the highest peaks below the best's; the
    farthest, the lowest peak within that reach, has the most to gain) and those of higher peak
    and lower latency, should the best run over the limit (the farthest is the fastest on the
    front, the likeliest to run within it). In memory mode they are the next fastest within the
    memory limit, since the fastest as estimated need not be the fastest as timed.
    """
    by_peak = sorted(front, key=lambda s: (s.peak_bytes, s.latency_s))
    if objective.mode == "latency":
        assert objective.latency_s is not None
        reach = RELAX * objective.latency_s
        lower = [s for s in reversed(by_peak) if s.peak_bytes < best.peak_bytes and s.latency_s <= reach]
        higher = [s for s in by_peak if s.peak_bytes > best.peak_bytes]
        sides = [_nearest_and_farthest(lower), _nearest_and_farthest(higher)]
    else:
        assert objective.memory_bytes is not None
        within = sorted((s for s in front if s.peak_bytes <= objective.memory_bytes), key=lambda s: s.latency_s)
        sides = [[s for s in within if s is not best][: 2 * NEAR]]
    nearest = [side[0] for side in sides if side]
    farther = [side[i] for i in range(1, 2 * NEAR) for side in sides if i < len(side)]
    chosen: list[MState] = []
    for state in (best, *nearest, initial, *farther):
        if all(state is not s for s in chosen):
            chosen.append(state)
    return chosen


def _nearest_and_farthest(side: Sequence[MState]) -> list[MState]:
    """Up to :data:`NEAR` of ``side`` (nearest the best first): its first, its last, then the
    next nearest."""
    if len(side) < 3:
        return list(side)
    return [side[0], side[-1], *side[1:-1]][:NEAR]


def timed_choice(
    front: Sequence[MState],
    best: MState,
    initial: MState,
    objective: Objective,
    baseline: tuple[Graph, Sequence[str]],
    baseline_latency_s: float,
    time_steps: TimeSteps,
    max_seconds: float,
) -> TimedChoice:
    """The best of the :func:`contenders` by ``objective`` once they and ``baseline`` (the
    captured step, estimated at ``baseline_latency_s``) are timed whole in turns by
    ``time_steps`` (module docstring). The objective's latency limit is rescaled by the
    captured step's timed over its estimated latency. Only as many contenders are timed as
    fit ``max_seconds`` (a warm-up and :data:`ROUNDS_ESTIMATED` rounds, as estimated); none
    where the best alone does not.

    Where none meets the latency limit as timed because the captured step itself (``initial``,
    as the runtime runs it) does not, beside a baseline that is not that step (a model's own
    forward, which has no per-call checks to make), the limit is taken as a ratio to the
    captured step as timed. Where the rounds were not quiet (another process held the cores)
    or no contender meets the limits as timed otherwise, the estimates decide as they did. The
    note says which.
    """
    states: list[MState] = []
    needed = ROUNDS_ESTIMATED * baseline_latency_s
    for state in contenders(front, best, initial, objective):
        needed += ROUNDS_ESTIMATED * state.latency_s
        if needed > max_seconds:
            break
        states.append(state)
    if not states:
        return TimedChoice(best, objective, baseline_latency_s, 0, 0, "not timed: the steps take too long")
    timed = time_steps([baseline, *((s.graph, s.order) for s in states)], max_seconds)
    unchanged = TimedChoice(best, objective, baseline_latency_s, len(states), timed.rounds, "")
    if not timed.quiet:
        return replace(unchanged, note="kept as estimated: other processes kept the cores busy while it was timed")
    timed_baseline, *seconds = timed.seconds
    limit = objective.latency_s
    if limit is not None:
        objective = replace(objective, latency_s=limit * timed_baseline / baseline_latency_s)
    candidates = [replace(s, latency_s=t) for s, t in zip(states, seconds)]
    chosen = min(candidates, key=lambda s: objective.rank(s.peak_bytes, s.latency_s))
    captured = next((s for s in candidates if s.graph is initial.graph and s.order == initial.order), None)
    if not objective.met_by(chosen) and captured is not None and limit is not None:
        # The captured step itself, as the runtime runs it, is over the limit of the step it is
        # compared to (an inference's per-call checks against the model's own forward, at
        # batch 1): the limit is taken as a ratio to the captured step as timed.
        over = captured.latency_s / timed_baseline
        objective = replace(objective, latency_s=limit * captured.latency_s / baseline_latency_s)
        chosen = min(candidates, key=lambda s: objective.rank(s.peak_bytes, s.latency_s))
        return TimedChoice(
            chosen,
            objective,
            captured.latency_s,
            len(states),
            timed.rounds,
            f"none ran within the limit as timed, the captured step itself at {over:.2f} of the step it is "
            "compared to: the limit was taken as a ratio to the captured step as timed",
        )
    if not objective.met_by(chosen):
        return replace(unchanged, note="kept as estimated: none of the plans timed met the limits as timed")
    if chosen.graph is best.graph and chosen.order == best.order:
        note = "the best as estimated, confirmed"
    elif objective.mode == "memory":
        note = "a plan estimated slower ran faster"
    elif chosen.peak_bytes < best.peak_bytes:
        note = "a plan of lower peak, estimated over the latency limit, ran within it"
    else:
        note = "the best as estimated ran over the latency limit; the next plan within it was taken"
    return TimedChoice(chosen, objective, timed_baseline, len(states), timed.rounds, note)
