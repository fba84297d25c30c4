"""The peak/latency front that recomputation alone, or swapping alone, reaches by a greedy
(MAGIS §5.2's scheduling-based rules; Echo §IV's footprint estimate).

The M-Optimizer (:mod:`magis.search.m_optimizer`) combines every rule; this module asks
what one kind of rule does on its own, the way the peers do (checkpointing,
torch.compile's min-cut partitioner, offloading). Starting from the captured step in
its memory-optimal order, :func:`recompute_front` first merges the step's duplicate
operators where that saves time and raises no step above the peak (common subexpression
elimination: :func:`magis.rules.remat.de_remat`'s merges, which AOTAutograd makes for
torch.compile; a captured step repeats, say, a ``scalar_tensor`` in every layer's
backward), then (as :func:`swap_front` does) repeats one round:

1. the schedule's memory timeline is simulated once, and the rule's proposals are
   read off it without building a graph (:func:`magis.rules.remat.remat_proposals`,
   :func:`magis.rules.swap.swap_proposals`), ranked by Echo's estimate per second of
   added work: bytes saved at the peak over the seconds the recomputed copies take (a
   swap's transfer is meant to hide behind compute: swaps rank by bytes alone);
2. the best-ranked :data:`TOP` are rewritten and simulated in full (peak and latency),
   the next :data:`TOP` only when none of them makes progress, and so on;
3. the one that lowers the peak most per second it adds is taken; where the peak is a
   plateau of several steps, one that lowers some of them (fewer steps at the peak, the
   same height) is progress too, ranked after any drop;
4. the new graph is rescheduled incrementally around what the rewrite touched (MAGIS
   Alg. 2, as the M-Optimizer does), the rule's own placement kept where it is better;
5. recomputed copies that compute what an earlier copy computes (two saved intermediates
   of one activation recompute its chain's head twice) are merged into it
   (:func:`magis.rules.remat.shared_copies`): all at once where that saves time and
   raises no step above the peak, else each half of them in turn, and so on;
6. the same kind of tensor is saved in every layer of a model (every cell and time step
   of a recurrent one), so the round's best candidate is also tried together with the
   next best-ranked proposals independent of it
   (:func:`magis.rules.remat.rematerialized_together`, :func:`magis.rules.swap.swapped_together`:
   one rewrite, one simulation). The batch is taken where it lowers the peak further at
   no less than half the bytes per second of the best alone; its size (one in the first round, so
   that the front starts with the cheapest single recomputation) doubles after a batch
   is taken (up to :data:`MAX_BATCH`) and halves after one is not, so that a round on
   a model of many layers takes many of them at once. A batch jumps over the points its
   first candidates alone would give; its prefixes of 1, 2, 4, … candidates are
   simulated too (in the rule's own order) and join the front as points passed on the
   way, so that a limit between two rounds still finds a plan close to it. Where the
   batch crosses the greedy's latency (peak) limit, the longest (shortest) prefix on
   the limit's good side is found by bisection and joins them.

Every round's state is a point; the greedy stops when no proposal makes progress (or a
round's merges undo its rewrite), at the time budget, the round limit, or once a point
is slower than a latency limit.
The front is the points no other point beats on both peak and latency
(:func:`pareto`): peaks strictly decreasing, latencies non-decreasing. Only the few
candidates ranked best are ever simulated, which is what keeps a round at paper size
(thousands of nodes, hundreds of proposals) to about a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from magis.cost.latency import CostModel, RewriteFamilyCostModel, estimate_latency, has_device_memory
from magis.cost.memory import MemoryProfile, simulate_memory
from magis.ir.graph import Graph
from magis.rules.remat import (
    MAX_OPS,
    duplicates,
    independent,
    merged_duplicates,
    recompute_seconds,
    remat_proposals,
    rematerialized,
    rematerialized_together,
    shared_copies,
)
from magis.rules.rewrite import Rewrite, Timeline
from magis.rules.swap import independent_swaps, swap_proposals, swapped, swapped_together
from magis.schedule import incremental_schedule, schedule
from magis.search.collector import collector_paused

#: candidates rewritten and simulated at a time, best-ranked first
TOP = 4
#: seconds for one incremental schedule (as the M-Optimizer's)
INCREMENTAL_S = 1.0
#: seconds the greedy runs by default
DEFAULT_TIME_BUDGET_S = 120.0
#: most proposals one round applies together (step 6)
MAX_BATCH = 64
#: a batch is taken only where it drops at least this share of the bytes per second added
#: that the round's best candidate alone drops (its extra copies must pay too)
BATCH_EFFICIENCY = 0.5
#: a candidate that adds no latency divides its saving by this instead
_NO_SECONDS = 1e-12


@dataclass(frozen=True)
class FrontPoint:
    """A plan on the way: its graph and schedule, their simulated figures, the owners of
    the tensors recomputed and swapped so far (in the order the greedy chose them), and the
    duplicate operators merged away before the first round."""

    peak_bytes: int
    latency_s: float
    graph: Graph
    order: tuple[str, ...]
    peak_steps: int  # steps at the peak (a plateau narrowing is progress too)
    recomputed: tuple[str, ...] = ()
    swapped: tuple[str, ...] = ()
    merged: tuple[str, ...] = ()


@dataclass(frozen=True)
class RuleFront:
    """The Pareto front the greedy reached (first point: the scheduled step), every point it
    visited, and why it stopped (``"no progress"``, ``"time budget"``, ``"round limit"``,
    ``"latency limit"``, ``"peak limit"`` or ``"saving rate"``)."""

    points: tuple[FrontPoint, ...]
    visited: tuple[FrontPoint, ...]
    stopped_by: str
    seconds: float
    passed: tuple[FrontPoint, ...] = ()  # a batch's prefixes (step 6): on the front, not continued from


@dataclass(frozen=True)
class _Candidate:
    """A proposal of a rule before it is rewritten: its target, its rank, how to rewrite it."""

    target: str
    rank: float  # Echo's estimate: bytes saved per second added (higher first)
    rewrite: Callable[[], Rewrite | None]
    proposal: Any = None  # what :class:`_Batching` applies together with others


Propose = Callable[[Graph, Timeline], list[_Candidate]]


@dataclass(frozen=True)
class _Batching:
    """How a rule applies several of one round's proposals in one rewrite (step 6 of the
    module docstring): which proposals go together, and the rewrite of a batch."""

    independent: Callable[[Any, Any], bool]
    together: Callable[[Graph, Timeline, list[Any]], Rewrite | None]


@dataclass(frozen=True)
class _Limits:
    """When the greedy stops short of running out of progress."""

    time_budget: float  # seconds
    max_rounds: int | None  # ``None``: no limit
    latency_s: float | None  # stop once a point is slower than this (``None``: no limit)
    peak_bytes: int | None = None  # stop once a point peaks at most this (``None``: no limit)
    at_limits: bool = True  # where a batch crosses a limit, bisect for its prefix at the limit
    saving_rate: float | None = None  # stop once the best a round frees is fewer bytes per second added


@dataclass(frozen=True)
class _Limit:
    """One limit a round crossed: ``"latency"`` (seconds) or ``"peak"`` (bytes)."""

    kind: str
    value: float


def recompute_front(
    graph: Graph,
    model: CostModel,
    order: Sequence[str] | None = None,
    heavy: bool = True,
    max_ops: int = MAX_OPS,
    time_budget: float = DEFAULT_TIME_BUDGET_S,
    max_rounds: int | None = None,
    latency_limit_s: float | None = None,
    progress: bool = False,
    peak_limit_bytes: int | None = None,
    batching: bool = True,
    at_limits: bool = True,
    min_saving_rate: float | None = None,
) -> RuleFront:
    """The front of recompute-only plans of ``graph`` (module docstring), from ``order``
    (default: its memory-optimal order). ``heavy`` lets matrix products and convolutions
    be recomputed too (the ranking still prefers cheap operators: they cost less per byte).
    Without ``batching`` each round recomputes one tensor (no step 6).
    With ``peak_limit_bytes`` the greedy stops at the first point that peaks no higher
    (``"peak limit"``): further rounds would only add time. Without ``at_limits`` a batch
    that crosses a limit adds no bisected prefix at it (step 6): for a caller that will
    add time to the points (fission), a point right at the latency limit is of no use.
    With ``min_saving_rate`` (bytes per second) the greedy stops (``"saving rate"``) at the
    first round whose best candidate frees fewer bytes at the peak per second it adds (a
    round that only narrows the peak's plateau frees none): for a caller that can swap
    instead, a transfer frees memory at the host link's rate even where no compute hides
    it. On ResNet-50 at paper size (h200) the greedy reaches 0.474 of eager's peak in 3 s
    at 2e11 bytes per second, then spends 7 s on rounds that free 1-50 KB each at 3e6 to
    5e7 bytes per second (1.10x to 1.29x eager's latency), where the link moves 5e10."""
    model = RewriteFamilyCostModel(model)

    def propose(current: Graph, timeline: Timeline) -> list[_Candidate]:
        return [
            _Candidate(
                p.target,
                p.saving / max(recompute_seconds(current, p.segment, model), _NO_SECONDS),
                lambda p=p: rematerialized(current, timeline, p),
                p,
            )
            for p in remat_proposals(current, timeline, heavy, max_ops)
        ]

    limits = _Limits(time_budget, max_rounds, latency_limit_s, peak_limit_bytes, at_limits, min_saving_rate)
    together = _Batching(independent, rematerialized_together) if batching else None
    return _greedy(graph, model, order, propose, "recomputed", limits, progress, together, dedupe=True)


def swap_front(
    graph: Graph,
    model: CostModel,
    order: Sequence[str] | None = None,
    time_budget: float = DEFAULT_TIME_BUDGET_S,
    max_rounds: int | None = None,
    latency_limit_s: float | None = None,
    progress: bool = False,
    peak_limit_bytes: int | None = None,
) -> RuleFront:
    """The front of swap-only plans of ``graph`` (module docstring), Loads placed to hide
    their transfers. Raises ValueError where ``model`` prices a device without memory of
    its own (:func:`require_device_memory`). ``peak_limit_bytes`` as for
    :func:`recompute_front`."""
    require_device_memory(model)
    model = RewriteFamilyCostModel(model)

    def propose(current: Graph, timeline: Timeline) -> list[_Candidate]:
        return [
            _Candidate(p.target, p.saving, lambda p=p: swapped(current, timeline, p, model), p)
            for p in swap_proposals(current, timeline)
        ]

    def together(current: Graph, timeline: Timeline, proposals: list[Any]) -> Rewrite | None:
        return swapped_together(current, timeline, proposals, model)

    limits = _Limits(time_budget, max_rounds, latency_limit_s, peak_limit_bytes)
    return _greedy(graph, model, order, propose, "swapped", limits, progress, _Batching(independent_swaps, together))


def require_device_memory(model: CostModel) -> None:
    """Raise ValueError unless ``model`` prices a device with memory of its own (a GPU):
    on a CPU, host memory is device memory and a swap frees nothing."""
    if not has_device_memory(model):
        raise ValueError(
            "swapping frees no memory on a CPU, whose memory is host memory: plan for a GPU "
            "(--device cuda on a machine with one, or a device profile such as h200)"
        )


def pareto(points: Sequence[FrontPoint]) -> tuple[FrontPoint, ...]:
    """The points no other point beats on both peak and latency, by increasing latency
    (so with strictly decreasing peaks); of equal points, the first."""
    front: list[FrontPoint] = []
    for point in sorted(points, key=lambda p: (p.latency_s, p.peak_bytes)):
        if not front or point.peak_bytes < front[-1].peak_bytes:
            front.append(point)
    return tuple(front)


def _greedy(
    graph: Graph,
    model: CostModel,
    order: Sequence[str] | None,
    propose: Propose,
    kind: str,
    limits: _Limits,
    progress: bool,
    batching: _Batching | None = None,
    dedupe: bool = False,
) -> RuleFront:
    """Rounds of the module docstring until no progress or one of ``limits``, from the
    step with its duplicates merged first where ``dedupe`` (step 0)."""
    if not limits.time_budget > 0:
        raise ValueError(f"the time budget must be a positive number of seconds, got {limits.time_budget!r}")
    start = time.perf_counter()
    deadline = start + limits.time_budget
    order = tuple(schedule(graph).order if order is None else order)
    current = _point(graph, order, model)
    if dedupe:
        deduped = _merged_in_halves(current, duplicates(graph, order), frozenset(), model, deadline)
        current = replace(deduped, merged=tuple(n for n in order if n not in deduped.graph.index))
    originals = frozenset(current.graph.index)
    visited, passed = [current], []
    stopped_by = "no progress"
    batch = 1  # proposals the next round tries together (step 6); the first round takes one
    with collector_paused(), tqdm(desc=f"magis: {kind} greedy", unit="round", disable=not progress) as bar:
        while True:
            limited = _limit_reached(current, len(visited), limits, deadline)
            if limited is not None:
                stopped_by = limited
                break
            step = _best_step(current, model, propose, deadline)
            if step is None:
                break
            if limits.saving_rate is not None and (not step.key[0] or step.key[1] < limits.saving_rate):
                stopped_by = "saving rate"
                break
            taken, rewrite = [step.candidate], step.rewrite
            if batching is not None and step.key[0]:
                wide = _batch(current, step, batching, batch, model) if batch > 1 else None
                if wide is not None:
                    taken, rewrite = wide
                    passed += _prefixes(current, step, taken, batching, kind, model)
                batch = min(2 * batch, MAX_BATCH) if wide is not None or batch == 1 else max(2, batch // 2)
            targets = tuple(c.target for c in taken)
            before, current = current, _applied(current, rewrite, targets, kind, model)
            current = _with_shared_copies(current, originals, model, deadline)
            if not _advances(before, current.peak_bytes, current.peak_steps):  # its merges undid it:
                break  # the same round would come again
            crossed = _crossed(before, current, limits) if limits.at_limits else None
            if batching is not None and len(taken) > 1 and crossed is not None:
                at_limit = _limit_prefix(before, step, taken, batching, kind, model, crossed)
                passed += [at_limit] if at_limit is not None else []
            visited.append(current)
            bar.update()
            bar.set_postfix_str(f"peak {current.peak_bytes / 2**20:.1f} MiB, {current.latency_s * 1e3:.3f} ms")
    seconds = time.perf_counter() - start
    return RuleFront(pareto([*visited, *passed]), tuple(visited), stopped_by, seconds, tuple(passed))


def _advances(current: FrontPoint, peak_bytes: int, peak_steps: int) -> bool:
    """Whether a peak of ``peak_bytes`` held at ``peak_steps`` steps is progress from ``current``:
    a lower peak, or as high with fewer steps at it. A rewrite is ranked by it
    (:func:`_progress`), and so is the round that took it once its duplicates are merged (step
    5), into what the graph computed before: a round of a narrowing plateau can end where it
    started, and the next would propose it again."""
    return peak_bytes < current.peak_bytes or (peak_bytes == current.peak_bytes and peak_steps < current.peak_steps)


def _limit_reached(current: FrontPoint, visited: int, limits: _Limits, deadline: float) -> str | None:
    """Which of ``limits`` stops the greedy before another round from ``current``, the last
    of ``visited`` points (the first is the start, so ``visited - 1`` rounds ran), as
    :attr:`RuleFront.stopped_by` names it; ``None`` to go on."""
    if limits.max_rounds is not None and visited > limits.max_rounds:
        return "round limit"
    if time.perf_counter() > deadline:
        return "time budget"
    if limits.latency_s is not None and current.latency_s > limits.latency_s:
        return "latency limit"
    if limits.peak_bytes is not None and current.peak_bytes <= limits.peak_bytes:
        return "peak limit"
    return None


def _crossed(before: FrontPoint, after: FrontPoint, limits: _Limits) -> _Limit | None:
    """The limit a round crossed, going from within a latency limit to past it, or from
    above a peak limit to within it (the round the greedy stops after); ``None`` if neither."""
    if limits.latency_s is not None and before.latency_s <= limits.latency_s < after.latency_s:
        return _Limit("latency", limits.latency_s)
    if limits.peak_bytes is not None and before.peak_bytes > limits.peak_bytes >= after.peak_bytes:
        return _Limit("peak", limits.peak_bytes)
    return None


@dataclass(frozen=True)
class _Step:
    """The best candidate of a round, its rewrite and progress key, and what the round saw."""

    candidate: _Candidate
    rewrite: Rewrite
    key: tuple[int, float, int]  # :func:`_progress`
    ranked: list[_Candidate]
    timeline: Timeline


def _best_step(current: FrontPoint, model: CostModel, propose: Propose, deadline: float) -> _Step | None:
    """The candidate that makes the most progress from ``current`` (steps 1-3 of the module
    docstring), or ``None`` when none does."""
    timeline = Timeline.of(current.graph, current.order)
    ranked = sorted(propose(current.graph, timeline), key=lambda c: -c.rank)
    for chunk in range(0, len(ranked), TOP):
        best: _Step | None = None
        for candidate in ranked[chunk : chunk + TOP]:
            rewrite = candidate.rewrite()
            if rewrite is None:
                continue
            key = _progress(current, rewrite, model)
            if key is not None and (best is None or key > best.key):
                best = _Step(candidate, rewrite, key, ranked, timeline)
        if best is not None:
            return best
        if time.perf_counter() > deadline:
            return None
    return None


def _batch(
    current: FrontPoint, step: _Step, batching: _Batching, size: int, model: CostModel
) -> tuple[list[_Candidate], Rewrite] | None:
    """The round's best candidate with the next best-ranked ones independent of it and of
    each other, ``size`` in all, applied in one rewrite (step 6 of the module docstring);
    ``None`` unless the batch lowers the peak below the best candidate's alone, at no less
    than :data:`BATCH_EFFICIENCY` of its bytes dropped per second added."""
    taken = [step.candidate]
    for candidate in step.ranked:
        if len(taken) == size:
            break
        if candidate is not step.candidate and all(
            batching.independent(candidate.proposal, other.proposal) for other in taken
        ):
            taken.append(candidate)
    if len(taken) < 2:
        return None
    rewrite = batching.together(current.graph, step.timeline, [c.proposal for c in taken])
    key = _progress(current, rewrite, model) if rewrite is not None else None
    if rewrite is None or key is None or rewrite.memory is None or step.rewrite.memory is None:
        return None
    if rewrite.memory.peak >= step.rewrite.memory.peak or key[1] < BATCH_EFFICIENCY * step.key[1]:
        return None
    return taken, rewrite


def _prefixes(
    current: FrontPoint, step: _Step, taken: list[_Candidate], batching: _Batching, kind: str, model: CostModel
) -> list[FrontPoint]:
    """The points of the first 1, 2, 4, … of a batch's candidates ``taken`` (fewer than all),
    each in its rewrite's own order: what the front would hold had the batch grown more
    slowly (step 6 of the module docstring)."""
    points = (
        _prefix(current, step, taken, size, batching, kind, model)
        for size in (2**i for i in range((len(taken) - 1).bit_length()))
    )
    return [point for point in points if point is not None]


def _limit_prefix(
    current: FrontPoint,
    step: _Step,
    taken: list[_Candidate],
    batching: _Batching,
    kind: str,
    model: CostModel,
    limit: _Limit,
) -> FrontPoint | None:
    """Where a batch crosses a limit (step 6 of the module docstring), its prefix closest
    to that limit on the right side, found by bisection over the prefix's size: the
    longest one within a latency limit, or the shortest one within a peak limit. A
    limit that falls inside a batch's jump would otherwise leave the plan at the last
    power-of-two prefix, up to half a batch of layers short of it."""

    def within(point: FrontPoint) -> bool:
        return (point.latency_s if limit.kind == "latency" else point.peak_bytes) <= limit.value

    # invariant: ``low`` candidates are on the current side of the limit, ``high`` past it
    low, high, best = 0, len(taken), None
    while high - low > 1:
        size = (low + high) // 2
        point = _prefix(current, step, taken, size, batching, kind, model)
        if point is None:
            return best
        inside = within(point)
        if inside == (limit.kind == "latency"):  # within a latency limit: a longer prefix may fit too
            low = size
        else:
            high = size
        if inside:
            best = point
    return best


def _prefix(
    current: FrontPoint,
    step: _Step,
    taken: list[_Candidate],
    size: int,
    batching: _Batching,
    kind: str,
    model: CostModel,
) -> FrontPoint | None:
    """The point of a batch's first ``size`` candidates, in its rewrite's own order."""
    proposals = [c.proposal for c in taken[:size]]
    rewrite = step.rewrite if size == 1 else batching.together(current.graph, step.timeline, proposals)
    if rewrite is None:
        return None
    point = _point(rewrite.graph, rewrite.order, model, rewrite.memory)
    return _after(current, point, kind, [c.target for c in taken[:size]])


def _after(current: FrontPoint, point: FrontPoint, kind: str, targets: Sequence[str]) -> FrontPoint:
    """``point`` with ``current``'s history and ``targets`` added to its ``kind``."""
    history = {"recomputed": current.recomputed, "swapped": current.swapped}
    history[kind] = (*history[kind], *targets)
    return replace(point, **history, merged=current.merged)


def _progress(current: FrontPoint, rewrite: Rewrite, model: CostModel) -> tuple[int, float, int] | None:
    """How much ``rewrite`` (in its own order) improves on ``current``, higher better:
    a lower peak first, by bytes dropped per second added; then a narrower plateau.
    ``None`` when the peak rises, or stays with as many steps at it."""
    memory = rewrite.memory or simulate_memory(rewrite.graph, rewrite.order)
    if not _advances(current, memory.peak, len(memory.peak_steps)):
        return None
    drop = current.peak_bytes - memory.peak
    added = estimate_latency(rewrite.graph, rewrite.order, model).total_s - current.latency_s
    return (int(drop > 0), drop / max(added, _NO_SECONDS), -len(memory.peak_steps))


def _applied(
    current: FrontPoint, rewrite: Rewrite, targets: tuple[str, ...], kind: str, model: CostModel
) -> FrontPoint:
    """The point ``rewrite`` leads to: its graph rescheduled incrementally around what it
    touched (MAGIS Alg. 2), or in the rule's own order where that is better."""
    rescheduled = incremental_schedule(current.graph, current.order, rewrite.graph, rewrite.touched, INCREMENTAL_S)
    options = [
        _point(rewrite.graph, rewrite.order, model, rewrite.memory),
        _point(rewrite.graph, tuple(rescheduled), model),
    ]
    return _after(current, min(options, key=lambda p: (p.peak_bytes, p.latency_s)), kind, targets)


def _with_shared_copies(point: FrontPoint, originals: frozenset[str], model: CostModel, deadline: float) -> FrontPoint:
    """``point`` with its duplicate recomputed copies merged (step 5 of the module docstring)."""
    return _merged_in_halves(point, shared_copies(point.graph, point.order, originals), originals, model, deadline)


def _merged_in_halves(
    point: FrontPoint,
    pairs: Sequence[tuple[str, str]],
    left: frozenset[str],
    model: CostModel,
    deadline: float,
) -> FrontPoint:
    """The duplicates ``pairs`` merged (:func:`magis.rules.remat.merged_duplicates`, no
    node of ``left`` merged into another) all at once where that raises no step above
    the peak and saves time, else each half in turn, and so on: a merge that would raise
    the peak (a copy kept alive from one layer's backward to the next) is set apart in a
    logarithmic number of simulations, where trying the merges one by one takes as many
    as there are (about one per layer and round)."""
    pairs = [(drop, keep) for drop, keep in pairs if drop in point.graph.index and keep in point.graph.index]
    if not pairs or time.perf_counter() > deadline:
        return point
    rewrite = merged_duplicates(point.graph, point.order, pairs, left)
    merged = _point(rewrite.graph, rewrite.order, model)
    if merged.peak_bytes <= point.peak_bytes and merged.latency_s < point.latency_s:
        return _after(point, merged, "recomputed", ())
    if len(pairs) == 1:
        return point
    half = len(pairs) // 2
    point = _merged_in_halves(point, pairs[:half], left, model, deadline)
    return _merged_in_halves(point, pairs[half:], left, model, deadline)


def _point(graph: Graph, order: Sequence[str], model: CostModel, memory: MemoryProfile | None = None) -> FrontPoint:
    """``graph`` in ``order`` simulated (its memory timeline taken from ``memory`` where given)."""
    memory = memory or simulate_memory(graph, order)
    latency = estimate_latency(graph, order, model).total_s
    return FrontPoint(memory.peak, latency, graph, tuple(order), len(memory.peak_steps))
