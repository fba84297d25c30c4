"""The M-Optimizer: MAGIS Algorithm 3, the search that coordinates graph transformation and scheduling.

Algorithm 3 (MAGIS §6.2), as implemented here:

- lines 9-10: the captured step is scheduled (:func:`magis.schedule.schedule`) and
  becomes the first M-State; the step made separable along its samples gets its
  F-Tree (Algorithm 1); the first level of the search holds each F-Tree root at every
  fission number, the points of a recompute greedy (each with its roots fissioned
  too) and every other F-Tree node at its smallest fission number (the Mutate rule
  raises it later, reaching what :mod:`magis.search.single_fission` enumerates), so
  a feasible plan comes early however large the graph;
- line 12: the queue pops the best state by ``BetterThan`` (:class:`Objective`);
- lines 13-17: every registered M-Rule (:mod:`magis.search.registry`) makes new
  states: an F-Tree rule changes fission numbers, a graph rule rewrites the graph
  under the F-Tree, whose candidates are then re-analysed where the rewrite touched
  them (``Analyze``: :func:`magis.analysis.ftree.update_ftree`);
- lines 5-8, 12-14: a graph whose Weisfeiler-Lehman hash was seen is skipped
  (:func:`magis.search.graph_hash.wl_hash`);
- line 18: each new graph is scheduled incrementally (Alg. 2,
  :func:`magis.schedule.incremental_schedule`) from its parent's schedule; the order
  carried over from the parent (each region where its nodes ran) is kept instead
  when its peak is lower (the first level keeps the carried order: a feasible plan
  comes fast, and its children are rescheduled);
- lines 19-21: the state is simulated and pushed when it is not worse than the best
  relaxed by ``δ`` (:data:`DELTA`, 1.1): ``BetterThan(μ', δ·μ_best)``.

The search is anytime: :attr:`SearchResult.best` is the best state at any moment;
it stops when the queue is empty, after ``max_states`` states, or at the time budget.
Ties in the queue go to the state made first, and states are made in rule
registration order, so the same graph, limits and cost model give the same plan
whenever the state limit (not the clock) ends the search, and the first level's
recompute greedy ends by running out of progress (on small steps it does; on
thousands of nodes its share of the budget may end it).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal
from weakref import WeakKeyDictionary

from tqdm import tqdm

from magis.analysis.ftrans import InvalidFission
from magis.analysis.ftree import DEFAULT_LEVELS, FTree, next_divisor, update_ftree
from magis.backend.transfer import host_bytes_per_second
from magis.cost.latency import CostModel, has_device_memory
from magis.cost.memory import peak_memory, simulate_memory
from magis.ir.graph import Graph
from magis.rules.ftree_mutation import apply_ftree, consistent
from magis.rules.rewrite import Rewrite
from magis.schedule import incremental_schedule, schedule
from magis.search.collector import collector_paused
from magis.search.graph_hash import wl_hash
from magis.search.registry import DEVICE_ONLY_RULES, MRule, rules
from magis.search.rule_front import FrontPoint, pareto, recompute_front, swap_front
from magis.search.single_fission import fission_numbers, separable_step
from magis.search.state import EMPTY_TREE, MState, Step, changed_nodes, simulate_state

#: relaxation of the acceptance test (MAGIS §6.2: "empirically set to 1.1")
DELTA = 1.1
#: states simulated before the search stops (bounds it where the clock would make it nondeterministic)
DEFAULT_MAX_STATES = 2000
#: seconds for the first, full schedule of the captured step (at most a quarter of the budget)
SCHEDULE_S = 20.0
#: share of the time budget the recompute greedy of the first level may spend
DIVE_SHARE = 0.4
#: points of that greedy's front made states (each then fissioned along its roots)
DIVE_STATES = 6
#: points of the recompute dive the swap greedy walks on from (:meth:`_Search._swap_dive`)
SWAP_STARTS = 3
#: seconds for one incremental schedule (Alg. 2); on a large graph its DP may stop at this
#: limit, so there the schedule (and the plan) can depend on the machine's speed
INCREMENTAL_S = 1.0

Mode = Literal["memory", "latency"]


@dataclass(frozen=True)
class Objective:
    """``BetterThan`` of Algorithm 3 for one of its two modes.

    ``memory`` mode: states within ``memory_bytes`` come first, by lower latency, then
    the others by lower peak. ``latency`` mode is the dual: within ``latency_s``, lower
    peak first. In memory mode a ``latency_s`` too is a second limit a plan must meet
    (:meth:`met_by`), though the order is that of memory mode.
    """

    mode: Mode
    memory_bytes: int | None = None
    latency_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode == "memory" and self.memory_bytes is None:
            raise ValueError("memory mode needs a memory limit")
        if self.mode == "latency" and self.latency_s is None:
            raise ValueError("latency mode needs a latency limit")

    def rank(self, peak: float, latency: float) -> tuple[int, float, float]:
        """The sort key of a state with this peak and latency (lower is better)."""
        if self.mode == "memory":
            assert self.memory_bytes is not None
            return (0, latency, peak) if peak <= self.memory_bytes else (1, peak, latency)
        assert self.latency_s is not None
        return (0, peak, latency) if latency <= self.latency_s else (1, latency, peak)

    def better_than(self, a: MState, b: MState) -> bool:
        return self.rank(a.peak_bytes, a.latency_s) < self.rank(b.peak_bytes, b.latency_s)

    def acceptable(self, state: MState, best: MState, delta: float = DELTA) -> bool:
        """The relaxed test of Alg. 3: ``state`` is no worse than ``best`` with the figures
        ``best`` is ranked by scaled by ``delta`` (whether ``best`` meets the limit stays as it is)."""
        meets, first, second = self.rank(best.peak_bytes, best.latency_s)
        return self.rank(state.peak_bytes, state.latency_s) <= (meets, first * delta, second * delta)

    def met_by(self, state: MState | FrontPoint) -> bool:
        """Whether ``state`` meets every limit given."""
        memory_ok = self.memory_bytes is None or state.peak_bytes <= self.memory_bytes
        latency_ok = self.latency_s is None or state.latency_s <= self.latency_s
        return memory_ok and latency_ok


@dataclass
class SearchStats:
    """What the search did: states simulated, popped, skipped as seen, rewrites that did not apply."""

    states: int = 0
    expanded: int = 0
    duplicates: int = 0
    invalid: int = 0
    seconds: float = 0.0
    first_feasible_s: float | None = None  # when the best state first met the limits
    stopped_by: str = ""  # "queue empty", "state limit" or "time budget"
    rules: dict[str, int] = field(default_factory=dict)  # states made per rule


@dataclass(frozen=True)
class SearchResult:
    """The best state found, the first state (the scheduled captured step) and statistics."""

    best: MState
    initial: MState
    stats: SearchStats


def m_optimize(
    graph: Graph,
    objective: Objective,
    cost_model: CostModel,
    time_budget: float = 60.0,
    max_states: int = DEFAULT_MAX_STATES,
    rule_names: Sequence[str] | None = None,
    levels: int = DEFAULT_LEVELS,
    progress: bool = True,
) -> SearchResult:
    """Algorithm 3 on the captured step ``graph`` (module docstring). By default every
    registered rule takes part, but swapping only on a device with memory of its own."""
    active = rules(rule_names)
    if rule_names is None and not has_device_memory(cost_model):
        active = tuple(r for r in active if r.name not in DEVICE_ONLY_RULES)
    with collector_paused():
        return _Search(objective, cost_model, active, levels, time_budget, max_states, progress).run(graph)


@dataclass(frozen=True)
class _Mutation:
    """A state before it is scheduled and simulated: its graph, in the order carried over."""

    base: Graph
    base_order: tuple[str, ...]
    tree: FTree
    graph: Graph
    carried: tuple[str, ...]
    steps: tuple[Step, ...]  # what made it from its parent (the recompute dive: several remats)
    #: the carried order is an incremental schedule of ``graph`` itself (a rewrite under an
    #: F-Tree that fissions nothing): scheduling it again would change nothing
    scheduled: bool = False


class _Search:
    """One run of Algorithm 3: the queue, the hashes seen, the best state and the statistics."""

    def __init__(
        self,
        objective: Objective,
        cost_model: CostModel,
        active: tuple[MRule, ...],
        levels: int,
        time_budget: float,
        max_states: int,
        progress: bool,
    ) -> None:
        if time_budget <= 0:
            raise ValueError(f"the time budget must be positive, got {time_budget}")
        if max_states < 1:
            raise ValueError(f"max_states must be at least 1, got {max_states}")
        self.objective, self.cost_model, self.active, self.levels = objective, cost_model, active, levels
        self.time_budget, self.max_states, self.progress = time_budget, max_states, progress
        self.stats = SearchStats()
        self.seen: set[str] = set()
        #: (hash of a rewritten graph, fission numbers of its parent): rewrites met before are
        #: skipped before they are scheduled, the costly part of making a state
        self.seen_rewrites: set[tuple[str, tuple[int, ...]]] = set()
        self.queue: list[tuple[tuple, int, MState]] = []
        self.counter = itertools.count()
        self._rewrites: WeakKeyDictionary[Graph, dict[str, list[Rewrite]]] = WeakKeyDictionary()
        #: states made of the dive's points before the first level reaches them (a swap
        #: start's plan within the memory limit: :meth:`_swap_dive`), by the point's id
        self.early: dict[int, MState] = {}

    # ------------------------------------------------------------------ Algorithm 3
    def run(self, graph: Graph) -> SearchResult:
        self.start = time.perf_counter()
        self.deadline = self.start + self.time_budget
        self.bar = tqdm(total=self.max_states, desc="magis: search", unit="state", disable=not self.progress)
        try:
            initial = self._initial(graph)
            self.best = initial
            self._consider(initial, push=True)
            self._first_level(graph, initial)
            self._loop()
        finally:
            self.bar.close()
        self.stats.seconds = time.perf_counter() - self.start
        return SearchResult(self.best, initial, self.stats)

    def _initial(self, graph: Graph) -> MState:
        """The captured step in a memory-optimal order (Alg. 3, line 9)."""
        order = schedule(graph, time_limit_s=min(SCHEDULE_S, self.time_budget / 4)).order
        key = wl_hash(graph)
        self.seen.add(key)
        self.stats.states += 1
        self.bar.update()
        return simulate_state(graph, order, EMPTY_TREE, graph, order, key, self.cost_model)

    def _first_level(self, graph: Graph, initial: MState) -> None:
        """The separable step with its F-Tree and its roots fissioned (:meth:`_fissions`),
        the points of the recompute and swap greedies (:meth:`_dive`), best first, each
        with its roots fissioned where the limit points (:meth:`_dive_fissions`), then
        every other F-Tree node of the separable step at its smallest ``n``, then the
        points' roots at every other ``n``: the likeliest plans first, so that a feasible
        one comes soonest."""
        step = separable_step(graph, initial.order, self.levels)
        root = _Mutation(
            step.graph, step.order, step.tree, step.graph, step.order, (Step("separable", "make separable"),)
        )
        separable = self._evaluate(initial, root, reschedule=False)
        if separable is None:  # nothing to rewrite: the captured step is separable as it is
            separable = replace(initial, tree=step.tree)
        self._consider(separable, push=True)
        roots = self._fissions(separable, roots=True)
        points = self._dive(separable)
        dived = []
        for point in sorted(points, key=lambda p: self._with_fission(p, separable, roots)[1]):
            if self._out_of_budget():
                return
            state = self.early.pop(id(point), None) or self._dive_state(separable, point)
            if state is not None:
                self._dive_fissions(state, separable, roots)
                dived.append(state)
        self.early.clear()  # those the spread along the front left out stay states, unfissioned
        self._fissions(separable, roots=False)
        for state in dived:  # where time is left (small graphs): every n the estimate passed over
            self._fissions(state, roots=True)

    def _fissions(self, parent: MState, roots: bool) -> dict[tuple[str, int], MState]:
        """States of ``parent`` with one F-Tree node enabled: each root at every ``n``
        (``roots``), or each other node at its smallest ``n`` (the Mutate rule raises it
        later). A root spans the most of the step (the whole step along its samples is
        gradient accumulation), so the plans that trade parts for memory are there at
        once, not after many Mutate steps. The order carried over is kept. Returns the
        states made, by the node's label and ``n``."""
        tree = parent.tree
        if roots:
            chosen = [
                (i, n) for i, c in enumerate(tree.candidates) if c.parent is None for n in fission_numbers(c.length)
            ]
        else:
            chosen = [(i, next_divisor(c.length, 1)) for i, c in enumerate(tree.candidates) if c.parent is not None]
        made = {}
        for i, parts in chosen:
            if self._out_of_budget():
                break
            child = self._enabled(parent, i, parts)
            if child is not None:
                made[(tree.candidates[i].label, parts)] = child
        return made

    def _enabled(self, parent: MState, i: int, parts: int) -> MState | None:
        """``parent`` with F-Tree node ``i`` enabled at ``parts``, in the order carried over
        and considered (None where it does not apply or was seen)."""
        tree = parent.tree
        enabled = tree.with_parts({i: parts})
        mutation = self._applied(parent.base, parent.base_order, enabled, Step("enable", _describe(tree, enabled)))
        child = self._evaluate(parent, mutation, reschedule=False) if mutation is not None else None
        if child is not None:
            self._consider(child, push=True)
        return child

    def _dive_fissions(self, state: MState, separable: MState, roots: dict[tuple[str, int], MState]) -> None:
        """Each root of a point of the recompute greedy fissioned at the ``n`` where the
        limit lies. Fission and recomputation add their time and save their memory
        nearly independently: the separable step's root fissions (``roots``) tell, with
        what the greedy added and saved, which ``n`` just meets the limit (latency mode:
        the largest within it; memory mode: the smallest within it). From that guess the
        search walks ``n`` up or down until whether the limit is met changes: two or three
        states per root instead of one per fission number, on graphs where each costs seconds."""
        likely, _ = self._with_fission(state, separable, roots)
        for i, candidate in enumerate(state.tree.candidates):
            if candidate.parent is not None:
                continue
            numbers = fission_numbers(candidate.length)
            guess = likely.get(candidate.label)
            k = numbers.index(guess) if guess in numbers else 0
            direction = 0
            while 0 <= k < len(numbers) and not self._out_of_budget():
                child = self._enabled(state, i, numbers[k])
                if child is None:
                    break
                # a state within the limit: in latency mode more parts may save more; in
                # memory mode fewer parts may cost less time (and the other way round)
                within = self.objective.met_by(child)
                step = 1 if within == (self.objective.mode == "latency") else -1
                if direction and step != direction:
                    break
                direction, k = step, k + step

    def _dive(self, separable: MState) -> list[FrontPoint]:
        """The first level, continued: the greedy of the recompute rule walks from the
        separable step down its peak/latency front
        (:func:`magis.search.rule_front.recompute_front`), never past the latency limit,
        no further down than the memory limit; where swapping is registered (a device
        with memory of its own), the greedy of the swap rule walks on from points of that
        front (:meth:`_swap_dive`), and in memory mode the recompute greedy stops where the
        best it can do frees memory more slowly than the host link moves it (what it leaves,
        a swap may move, and the limit is met sooner). Both share :data:`DIVE_SHARE` of the
        budget. Of each dive, up to :data:`DIVE_STATES` points spread along its front and
        the one the objective ranks best are returned, to be made states (:meth:`_dive_state`)
        and fissioned. Algorithm 3 reaches such plans too, one rewrite at a time, but each
        of its expansions simulates every candidate of every rule."""
        names = {rule.name for rule in self.active}
        swapping, memory_mode = "swap" in names, self.objective.mode == "memory"
        rate_floor = host_bytes_per_second(self.cost_model) if swapping and memory_mode else None
        deadline = min(time.perf_counter() + DIVE_SHARE * self.time_budget, self.deadline)
        start = FrontPoint(
            separable.peak_bytes, separable.latency_s, separable.base, separable.base_order, peak_steps=0
        )
        recomputed: list[FrontPoint] = []
        if "remat" in names and deadline > time.perf_counter():
            front = recompute_front(
                separable.base,
                self.cost_model,
                separable.base_order,
                time_budget=deadline - time.perf_counter(),
                latency_limit_s=self.objective.latency_s,
                peak_limit_bytes=self.objective.memory_bytes,
                at_limits=memory_mode,  # a latency limit's points get fissioned
                min_saving_rate=rate_floor,
            )
            recomputed = [p for p in front.points if p.graph is not separable.base]  # the start is no dive
        fits = memory_mode and any(self.objective.met_by(p) for p in recomputed)
        if not swapping or fits:  # in memory mode: nothing left to swap for
            return self._spread(recomputed)
        if rate_floor is None:  # spread along the front: which start is best depends on the limit
            starts = [recomputed[k] for k in sorted(_evenly_spaced(len(recomputed), SWAP_STARTS))] or [start]
        else:  # each point freed memory faster than a swap would: the most recomputed ones
            starts = recomputed[-SWAP_STARTS:] or [start]
        swapped = self._swap_dive(separable, starts, deadline)
        return [*self._spread(recomputed), *self._spread(list(pareto(swapped)))]

    def _swap_dive(self, separable: MState, starts: list[FrontPoint], deadline: float) -> list[FrontPoint]:
        """The swap greedy (:func:`~magis.search.rule_front.swap_front`) from each of
        ``starts``, the most recomputed first, each given an equal share of the time left
        and stopping at the limits: swapping moves tensors recomputation cannot reach (a
        convolution's output before a batch norm), and which start is best depends on
        the limit. The first start's plan within a memory limit is made a state at once
        (:attr:`early`): a feasible plan as soon as there is one, not after every start.
        On ResNet-50 at paper size (h200) under 0.4 of eager's peak that plan comes two
        swaps after the recompute front's lowest point; the later starts give faster ones."""
        points: list[FrontPoint] = []
        starts = sorted(starts, key=lambda p: p.peak_bytes)
        for k, start in enumerate(starts):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            front = swap_front(
                start.graph,
                self.cost_model,
                start.order,
                time_budget=left / (len(starts) - k),
                latency_limit_s=self.objective.latency_s,
                peak_limit_bytes=self.objective.memory_bytes,
            )
            walked = [
                replace(p, recomputed=start.recomputed, merged=start.merged)
                for p in front.points
                if p.graph is not start.graph
            ]
            within = [p for p in walked if self.objective.met_by(p)]
            if within and not self.objective.met_by(self.best):
                first = min(within, key=lambda p: self.objective.rank(p.peak_bytes, p.latency_s))
                state = self._dive_state(separable, first)
                if state is not None:
                    self.early[id(first)] = state
            points += walked
        return points

    def _spread(self, points: list[FrontPoint]) -> list[FrontPoint]:
        """Up to :data:`DIVE_STATES` points spread along a front, and the best by the objective."""
        if not points:
            return []
        best = min(range(len(points)), key=lambda k: self.objective.rank(points[k].peak_bytes, points[k].latency_s))
        return [points[k] for k in sorted(_evenly_spaced(len(points), DIVE_STATES) | {best})]

    def _dive_state(self, separable: MState, point: FrontPoint) -> MState | None:
        """A point of a greedy (:meth:`_dive`) as a state, its F-Tree re-analysed (``Analyze``)
        so that fission can be laid over it."""
        profile = simulate_memory(point.graph, point.order)
        touched = changed_nodes(separable.base, point.graph)
        tree = update_ftree(separable.tree, point.graph, profile, touched, self.levels)
        steps = (Step("de-remat", f"merge {len(point.merged)} duplicate operator(s) (greedy)"),) if point.merged else ()
        steps += tuple(Step("remat", f"recompute {target} (greedy)") for target in point.recomputed)
        steps += tuple(Step("swap", f"swap {target} (greedy)") for target in point.swapped)
        mutation = _Mutation(point.graph, point.order, tree, point.graph, point.order, steps, scheduled=True)
        state = self._evaluate(separable, mutation)
        if state is not None:
            self._consider(state, push=True)
        return state

    def _with_fission(
        self, point: FrontPoint | MState, separable: MState, roots: dict[tuple[str, int], MState]
    ) -> tuple[dict[str, int], tuple]:
        """The fission number of each root where the limit lies for a plan that recomputes
        what ``point`` does (see :meth:`_dive_fissions`), and the objective's rank of that
        plan, estimated: fission and recomputation add their time nearly independently,
        and recomputation saves ``1/n`` of its bytes in each of ``n`` parts. The estimate
        is read off the separable step's fissions of each root (``roots``)."""
        objective = self.objective
        added = point.latency_s - separable.latency_s
        saved = separable.peak_bytes - point.peak_bytes
        numbers: dict[str, list[int]] = {}
        for label, n in roots:
            numbers.setdefault(label, []).append(n)
        parts: dict[str, int] = {}
        ranks = [objective.rank(point.peak_bytes, point.latency_s)]  # no fission at all
        for label, ns in numbers.items():
            estimates = {n: (roots[(label, n)].peak_bytes - saved / n, roots[(label, n)].latency_s + added) for n in ns}
            if objective.mode == "latency":
                assert objective.latency_s is not None
                within = [n for n, (_, latency) in estimates.items() if latency <= objective.latency_s]
                parts[label] = max(within, default=min(ns))
            else:
                assert objective.memory_bytes is not None
                within = [n for n, (peak, _) in estimates.items() if peak <= objective.memory_bytes]
                parts[label] = min(within, default=max(ns))
            ranks.append(objective.rank(*estimates[parts[label]]))
        return parts, min(ranks)

    def _loop(self) -> None:
        while self.queue:
            if self._out_of_budget():
                return
            _, _, parent = heapq.heappop(self.queue)
            self.stats.expanded += 1
            for mutation in self._mutations(parent):
                if self._out_of_budget():
                    return
                child = self._evaluate(parent, mutation)
                if child is not None:
                    self._consider(child, push=self.objective.acceptable(child, self.best))
        self.stats.stopped_by = "queue empty"

    def _out_of_budget(self) -> bool:
        if self.stats.states >= self.max_states:
            self.stats.stopped_by = "state limit"
        elif time.perf_counter() > self.deadline:
            self.stats.stopped_by = "time budget"
        else:
            return False
        return True

    def _consider(self, state: MState, push: bool) -> None:
        """Keep ``state`` if it is the best so far; queue it if ``push``."""
        if self.objective.better_than(state, self.best) or state is self.best:
            self.best = state
            if self.stats.first_feasible_s is None and self.objective.met_by(state):
                self.stats.first_feasible_s = time.perf_counter() - self.start
            self.bar.set_postfix_str(f"best peak {state.peak_bytes / 2**20:.2f} MiB, {state.latency_s * 1e3:.3f} ms")
        if push:
            rank = self.objective.rank(state.peak_bytes, state.latency_s)
            heapq.heappush(self.queue, (rank, next(self.counter), state))

    # ------------------------------------------------------------------ M-Rules
    def _mutations(self, state: MState) -> Iterator[_Mutation]:
        """Every mutation the registered rules make of ``state`` (Alg. 3, lines 15-17)."""
        for rule in self.active:
            if rule.kind == "ftree":
                for tree in rule.fn(state.tree):  # type: ignore[arg-type]
                    step = Step(rule.name, _describe(state.tree, tree))
                    mutation = self._applied(state.base, state.base_order, tree, step)
                    if mutation is not None:
                        yield mutation
                continue
            for rewrite in self._rewrites_of(rule, state.base, state.base_order):
                seen = (wl_hash(rewrite.graph), state.tree.parts)
                if seen in self.seen_rewrites:
                    self.stats.duplicates += 1
                    continue
                self.seen_rewrites.add(seen)
                touched = rewrite.touched or changed_nodes(state.base, rewrite.graph)
                if rewrite.order:  # the rule's own placement: valid, never above the old peak, and the
                    base_order = rewrite.order  # fissioned graph is rescheduled when evaluated
                else:
                    base_order = tuple(
                        incremental_schedule(state.base, state.base_order, rewrite.graph, touched, INCREMENTAL_S)
                    )
                profile = simulate_memory(rewrite.graph, base_order)
                tree = update_ftree(state.tree, rewrite.graph, profile, touched, self.levels)
                if not consistent(tree):
                    self.stats.invalid += 1
                    continue
                mutation = self._applied(rewrite.graph, base_order, tree, Step(rule.name, rewrite.description))
                if mutation is not None:
                    yield replace(mutation, scheduled=not rewrite.order and mutation.graph is rewrite.graph)

    def _rewrites_of(self, rule: MRule, base: Graph, order: tuple[str, ...]) -> list[Rewrite]:
        """A graph rule's rewrites of ``base`` in ``order``, found once per graph (F-Tree rules
        keep the base and its order)."""
        found = self._rewrites.setdefault(base, {})
        if rule.name not in found:
            found[rule.name] = rule.rewrites(base, order)
        return found[rule.name]

    def _applied(self, base: Graph, base_order: tuple[str, ...], tree: FTree, step: Step) -> _Mutation | None:
        """``base`` fissioned as ``tree`` says, ``base_order`` carried over (None if it does not apply)."""
        try:
            applied = apply_ftree(base, tree, base_order)
        except InvalidFission:
            self.stats.invalid += 1
            return None
        return _Mutation(base, base_order, tree, applied.graph, applied.order, (step,))

    def _evaluate(self, parent: MState, mutation: _Mutation, reschedule: bool = True) -> MState | None:
        """Hash, schedule and simulate a mutation of ``parent``; None for a graph seen before.

        Without ``reschedule`` the mutation keeps its carried-over order (the first level:
        a region runs where its nodes ran, as :mod:`magis.search.single_fission` has it).
        """
        key = wl_hash(mutation.graph)
        if key in self.seen:
            self.stats.duplicates += 1
            return None
        self.seen.add(key)
        order = mutation.carried
        if reschedule and not mutation.scheduled:
            touched = changed_nodes(parent.graph, mutation.graph)
            rescheduled = incremental_schedule(parent.graph, parent.order, mutation.graph, touched, INCREMENTAL_S)
            order = min((order, tuple(rescheduled)), key=lambda o: peak_memory(mutation.graph, o))
        state = simulate_state(
            mutation.base,
            mutation.base_order,
            mutation.tree,
            mutation.graph,
            order,
            key,
            self.cost_model,
            (*parent.steps, *mutation.steps),
        )
        self.stats.states += 1
        rule = mutation.steps[-1].rule
        self.stats.rules[rule] = self.stats.rules.get(rule, 0) + 1
        self.bar.update()
        return state


def _evenly_spaced(length: int, count: int) -> set[int]:
    """Up to ``count`` evenly spaced indices into a sequence of ``length``, the first and last included."""
    return {round(k * (length - 1) / max(count - 1, 1)) for k in range(count)} if length else set()


def _describe(old: FTree, new: FTree) -> str:
    """The F-Tree nodes whose fission number changed, e.g. ``input.dim0 (41 nodes): n 1 -> 2``."""
    return "; ".join(
        f"{c.label} ({len(c.nodes)} nodes): n {a} -> {b}"
        for c, a, b in zip(new.candidates, old.parts, new.parts)
        if a != b
    )
