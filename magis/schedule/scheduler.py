"""The public entry point: a memory-optimal (or, past the DP's reach, memory-minimised) order.

:func:`schedule` combines Serenity's pieces (MLSys'20 §3) with MAGIS's partition
(ASPLOS'24 §6.1). The graph is reduced (:mod:`magis.schedule.problem`), divided into
weakly connected components and, at narrow waists (nw <= 1), into pieces. Each
piece starts from the best of its captured, greedy and beam-search orders (the
upper bound); a piece larger than a window is first reordered window by window
(each window exactly, windows cut at the narrowest waists, every other pass shifted
across the previous cuts); then adaptive soft budgeting runs the DP on the whole
piece, which finds the optimum or proves the incumbent optimal. Components run one
after another, in the order the exchange argument gives (highest peak minus
residual bytes first). The result is never worse than the captured order.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from magis.cost.memory import peak_memory
from magis.ir.graph import Graph
from magis.schedule.dp import soft_budget_order
from magis.schedule.greedy import beam_order, greedy_order, rank
from magis.schedule.partition import components, split_at_waists, split_to_windows, unit_waists
from magis.schedule.problem import OrderingProblem, segment_problem

BEAM_WIDTH = 8  # beam search width for the incumbent of a piece
WINDOW_UNITS = 24  # window size when reordering a larger piece window by window
STEP_LIMIT_S = 1.0  # longest single DP attempt of the soft-budget search
WHOLE_PIECE_S = 3.0  # soft budgeting on a whole piece larger than a window, after the windows

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ScheduleResult:
    """An order of every node of the graph, its simulated peak and how it was found."""

    order: tuple[str, ...]
    peak: int
    seconds: float
    method: str  # "optimized" or "captured" (when nothing beat the input order)
    stats: dict[str, Any] = field(default_factory=dict)


def schedule(graph: Graph, time_limit_s: float = 20.0, progress: Progress | None = None) -> ScheduleResult:
    """Order ``graph`` for the lowest peak memory within about ``time_limit_s`` seconds.

    The time is shared among the pieces in proportion to their size; linear-time
    bookkeeping (building the problems, simulating the result) comes on top.
    ``progress`` receives a line per large piece. ``stats`` reports the captured
    order's peak, the units, components and pieces of the reduced problem, how many
    pieces were proven optimal (``proven``) and how many were not (``unproven``).
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    say = progress or (lambda _message: None)
    captured = [n.name for n in graph.nodes]
    whole = segment_problem(graph, captured)
    order, pieces, comps = _layout(whole)
    say(f"{len(graph)} nodes, {len(whole)} units, {len(comps)} components, {len(pieces)} pieces")
    pos = {name: i for i, name in enumerate(order)}
    stats: dict[str, Any] = {"units": len(whole), "components": len(comps), "pieces": len(pieces)}
    stats["largest_piece_nodes"] = max((hi - lo for lo, hi in pieces), default=0)
    stats["proven"] = improve_pieces(graph, order, pieces, pos, deadline, say)
    stats["unproven"] = len(pieces) - stats["proven"]
    order = _order_components(graph, order, comps, pos)
    peak = peak_memory(graph, order)
    stats["captured_peak"] = captured_peak = peak_memory(graph, captured)
    method = "optimized"
    if captured_peak < peak:
        order, peak, method = captured, captured_peak, "captured"
    return ScheduleResult(tuple(order), peak, time.perf_counter() - start, method, stats)


def _layout(whole: OrderingProblem) -> tuple[list[str], list[tuple[int, int]], list[tuple[int, int]]]:
    """The node order (inert nodes, then component after component) and the node ranges of pieces and components.

    Within a component the units keep the input order; a unit free to run on either
    side of a cut with nw = 1 stays on the side the input order put it.
    """
    waist = unit_waists(whole)
    order = list(whole.inert)
    pieces: list[tuple[int, int]] = []
    comps: list[tuple[int, int]] = []
    for comp in components(whole):
        others = len(whole) - len(comp)  # units of other components are incomparable with every unit of this one
        local = {u: waist[u] - others for u in comp}
        comp_lo = len(order)
        for piece in split_at_waists(comp, local):
            lo = len(order)
            order.extend(name for u in piece for name in whole.units[u])
            pieces.append((lo, len(order)))
        comps.append((comp_lo, len(order)))
    return order, pieces, comps


def improve_pieces(
    graph: Graph,
    order: list[str],
    pieces: Sequence[tuple[int, int]],
    pos: dict[str, int],
    deadline: float,
    progress: Progress | None = None,
) -> int:
    """:func:`improve_segment` on every piece (a node range of ``order``); the number proven optimal.

    Smallest pieces first, each with a share of the time left in proportion to its
    size, so that what a small piece does not use goes to the larger ones.
    """
    proven = 0
    todo = sorted(pieces, key=lambda r: r[1] - r[0])
    remaining = sum(hi - lo for lo, hi in todo)
    for i, (lo, hi) in enumerate(todo):
        share = (deadline - time.perf_counter()) * (hi - lo) / max(remaining, 1)
        remaining -= hi - lo
        proven += improve_segment(graph, order, lo, hi, pos, time.perf_counter() + share)
        if progress and hi - lo > WINDOW_UNITS:
            progress(f"piece {i + 1}/{len(todo)}: {hi - lo} nodes done")
    return proven


def improve_segment(graph: Graph, order: list[str], lo: int, hi: int, pos: dict[str, int], deadline: float) -> bool:
    """Reorder ``order[lo:hi]`` in place for a lower peak; True when the order is proven optimal.

    The incumbent is the best of the current, greedy and beam-search orders; a piece
    larger than a window is first improved window by window; then soft budgeting on
    the whole piece (at most ``WHOLE_PIECE_S`` after windows) either finds the optimum
    or proves the incumbent optimal, or gives up and keeps the incumbent.
    """
    problem = segment_problem(graph, order, lo, hi, pos)
    current = problem.run(problem.unit_order(order[lo:hi]))
    quarter = time.perf_counter() + (deadline - time.perf_counter()) / 4
    best = min(current, greedy_order(problem, None, quarter), beam_order(problem, BEAM_WIDTH, quarter), key=rank)
    place(order, lo, problem.nodes(best.units()), pos)
    if len(problem) > WINDOW_UNITS:
        _refine_windows(graph, order, lo, hi, problem, pos, deadline)
        best = problem.run(problem.unit_order(order[lo:hi]))
        deadline = min(deadline, time.perf_counter() + WHOLE_PIECE_S)
    found = soft_budget_order(problem, best, deadline, STEP_LIMIT_S)
    if found.state is not best:
        place(order, lo, problem.nodes(found.state.units()), pos)
    return found.optimal


def _refine_windows(
    graph: Graph, order: list[str], lo: int, hi: int, problem: OrderingProblem, pos: dict[str, int], deadline: float
) -> None:
    """Reorder a piece window by window, each window exactly, until a pass gains nothing or time is up.

    Windows are cut at the narrowest waists; every other pass is shifted by half a
    window so that units can move across the previous pass's cuts.
    """
    waist = unit_waists(problem)
    for sweep in itertools.count():
        units = problem.unit_order(order[lo:hi])
        start, improved = lo + len(problem.inert), False
        for window in split_to_windows(units, waist, WINDOW_UNITS, WINDOW_UNITS // 2 if sweep % 2 else 0):
            if time.perf_counter() > deadline:
                return
            end = start + sum(len(problem.units[u]) for u in window)
            improved |= _solve_window(graph, order, start, end, pos, deadline)
            start = end
        if sweep and not improved:
            return


def _solve_window(graph: Graph, order: list[str], lo: int, hi: int, pos: dict[str, int], deadline: float) -> bool:
    """Order ``order[lo:hi]`` by soft budgeting; True when its peak went down."""
    problem = segment_problem(graph, order, lo, hi, pos)
    current = problem.run(problem.unit_order(order[lo:hi]))
    found = soft_budget_order(problem, current, deadline, STEP_LIMIT_S)
    if found.state is current:
        return False
    place(order, lo, problem.nodes(found.state.units()), pos)
    return True


def place(order: list[str], lo: int, nodes: Sequence[str], pos: dict[str, int]) -> None:
    """Write ``nodes`` into ``order`` from ``lo`` on, keeping ``pos`` (positions) in step."""
    order[lo : lo + len(nodes)] = nodes
    for i, name in enumerate(nodes, start=lo):
        pos[name] = i


def _order_components(graph: Graph, order: list[str], comps: list[tuple[int, int]], pos: dict[str, int]) -> list[str]:
    """Run components one after another, highest (peak - bytes left live) first.

    Exchange argument: A before B peaks at max(p_A, r_A + p_B), B before A at
    max(p_B, r_B + p_A); A first is no worse when p_A - r_A >= p_B - r_B.
    """
    head = order[: comps[0][0]] if comps else order
    keyed = []
    for lo, hi in comps:
        problem = segment_problem(graph, order, lo, hi, pos)
        end = problem.run(problem.unit_order(order[lo:hi]))
        keyed.append((end.live - end.peak, lo, hi))
    return head + [name for _, lo, hi in sorted(keyed) for name in order[lo:hi]]
