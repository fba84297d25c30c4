"""The M-Optimizer: MAGIS Algorithm 3, the search that coordinates graph transformation and scheduling.

Algorithm 3 (MAGIS §6.2), as implemented here:

- line 9: the captured step is scheduled (:func:`magis.schedule.schedule`) and becomes
  the first M-State;
- lines 10-11: the step made separable along its samples gets its F-Tree (Algorithm 1),
  and the first level of the search is made of it (:mod:`magis.search.first_level`):
  each F-Tree root at every fission number, the points of a recompute greedy (each with
  its roots fissioned too), every other F-Tree node at its smallest fission number, so
  a feasible plan comes early however large the graph;
- line 12: the queue pops the best state by ``BetterThan``
  (:class:`~magis.search.objective.Objective`);
- lines 13-17: every registered M-Rule (:mod:`magis.search.registry`) makes new
  states: an F-Tree rule changes fission numbers, a graph rule rewrites the graph
  under the F-Tree, whose candidates are then re-analysed where the rewrite touched
  them (``Analyze``: :func:`magis.analysis.ftree.update_ftree`);
- lines 5-8, 12-14: a graph whose Weisfeiler-Lehman hash was seen is skipped
  (:func:`magis.search.graph_hash.wl_hash`), as is a rewrite met before under the
  same fission numbers;
- line 18: each new graph is scheduled incrementally (Alg. 2,
  :func:`magis.schedule.incremental_schedule`) from its parent's schedule; the order
  carried over from the parent (each region where its nodes ran) is kept instead
  when its peak is lower (:meth:`magis.search.ledger.Ledger.evaluate`);
- lines 19-21: the state is simulated and pushed when it is not worse than the best
  relaxed by ``δ`` (:data:`magis.search.objective.DELTA`, 1.1): ``BetterThan(μ', δ·μ_best)``.

The search is anytime: :attr:`SearchResult.best` is the best state at any moment;
it stops when the queue is empty, after ``max_states`` states, or at the time budget.
Ties in the queue go to the state made first, and states are made in rule
registration order, so the same graph, limits and cost model give the same plan
whenever the state limit (not the clock) ends the search, and the first level's
recompute greedy ends by running out of progress (on small steps it does; on
thousands of nodes its share of the budget may end it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from weakref import WeakKeyDictionary

from tqdm import tqdm

from magis.analysis.ftree import DEFAULT_LEVELS, update_ftree
from magis.cost.latency import CostModel, has_device_memory
from magis.cost.memory import simulate_memory
from magis.ir.graph import Graph
from magis.rules.rewrite import Rewrite
from magis.schedule import incremental_schedule, schedule
from magis.search.collector import collector_paused
from magis.search.first_level import FirstLevel
from magis.search.graph_hash import wl_hash
from magis.search.ledger import INCREMENTAL_S, Ledger, SearchStats
from magis.search.objective import Mode, Objective
from magis.search.registry import DEVICE_ONLY_RULES, MRule, rules
from magis.search.state import MState, Mutation, Step, changed_nodes, fission_changes

__all__ = ["DEFAULT_MAX_STATES", "Mode", "Objective", "SearchResult", "SearchStats", "m_optimize"]

#: states simulated before the search stops (bounds it where the clock would make it nondeterministic)
DEFAULT_MAX_STATES = 2000
#: seconds for the first, full schedule of the captured step (at most a quarter of the budget)
SCHEDULE_S = 20.0


@dataclass(frozen=True)
class SearchResult:
    """The best state found, the first state (the scheduled captured step), statistics, and
    the states no other beats in both peak and latency (by peak; the best among them)."""

    best: MState
    initial: MState
    stats: SearchStats
    front: tuple[MState, ...] = ()


def m_optimize(
    graph: Graph,
    objective: Objective,
    cost_model: CostModel,
    time_budget: float = 60.0,
    max_states: int = DEFAULT_MAX_STATES,
    rule_names: Sequence[str] | None = None,
    levels: int = DEFAULT_LEVELS,
    progress: bool = True,
    left_out: Sequence[str] = (),
) -> SearchResult:
    """Algorithm 3 on the captured step ``graph`` (module docstring). By default every
    registered rule takes part, but swapping only on a device with memory of its own;
    never those ``left_out``."""
    active = tuple(r for r in rules(rule_names) if r.name not in left_out)
    if rule_names is None and not has_device_memory(cost_model):
        active = tuple(r for r in active if r.name not in DEVICE_ONLY_RULES)
    if time_budget <= 0:
        raise ValueError(f"the time budget must be positive, got {time_budget}")
    if max_states < 1:
        raise ValueError(f"max_states must be at least 1, got {max_states}")
    with (
        collector_paused(),
        tqdm(total=max_states, desc="magis: search", bar_format=_bar_format(time_budget), disable=not progress) as bar,
    ):
        ledger = Ledger(objective, cost_model, time_budget, max_states, bar)
        initial = ledger.begin(graph, schedule(graph, time_limit_s=min(SCHEDULE_S, time_budget / 4)).order)  # line 9
        ledger.consider(initial, push=True)
        FirstLevel(ledger, frozenset(rule.name for rule in active), levels).run(graph, initial)  # lines 10-11
        _Search(ledger, active, levels).loop()  # lines 12-21
    ledger.stats.seconds = time.perf_counter() - ledger.start
    front = tuple(sorted(ledger.front, key=lambda s: (s.peak_bytes, s.latency_s)))
    return SearchResult(ledger.best, initial, ledger.stats, front)


def _bar_format(time_budget: float) -> str:
    """The search bar: states made of ``max_states``, and the time spent against the budget."""
    budget = tqdm.format_interval(time_budget)
    return "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} states [{elapsed} of " + budget + "{postfix}]"


@dataclass
class _Search:
    """The main loop of Algorithm 3 over the states of ``ledger``, with the M-Rules ``active``."""

    ledger: Ledger
    active: tuple[MRule, ...]
    levels: int  # F-Tree levels (Algorithm 1)
    #: (hash of a rewritten graph, fission numbers of its parent): rewrites met before are
    #: skipped before they are scheduled, the costly part of making a state
    seen_rewrites: set[tuple[str, tuple[int, ...]]] = field(default_factory=set)
    #: each graph rule's rewrites of a base graph, found once per graph
    rewrites: WeakKeyDictionary[Graph, dict[str, list[Rewrite]]] = field(default_factory=WeakKeyDictionary)

    def loop(self) -> None:
        """Pop the best state, make every mutation of it, and push each child that is acceptable
        (Alg. 3, lines 12-21), until the queue is empty or the budget spent."""
        ledger = self.ledger
        while ledger.queue:
            if ledger.out_of_budget():
                return
            parent = ledger.pop()
            for mutation in self._mutations(parent):
                if ledger.out_of_budget():
                    return
                child = ledger.evaluate(parent, mutation)
                if child is not None:
                    ledger.consider(child, push=ledger.objective.acceptable(child, ledger.best))
        ledger.stats.stopped_by = "queue empty"

    def _mutations(self, state: MState) -> Iterator[Mutation]:
        """Every mutation the registered rules make of ``state`` (Alg. 3, lines 15-17)."""
        ledger = self.ledger
        for rule in self.active:
            if rule.kind == "ftree":
                for tree in rule.fn(state.tree):  # type: ignore[arg-type]
                    step = Step(rule.name, fission_changes(state.tree, tree))
                    mutation = ledger.applied(state.base, state.base_order, tree, step)
                    if mutation is not None:
                        yield mutation
                continue
            for rewrite in self._rewrites_of(rule, state.base, state.base_order):
                seen = (wl_hash(rewrite.graph), state.tree.parts)
                if seen in self.seen_rewrites:
                    ledger.stats.duplicates += 1
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
                if not tree.consistent():
                    ledger.stats.invalid += 1
                    continue
                mutation = ledger.applied(rewrite.graph, base_order, tree, Step(rule.name, rewrite.description))
                if mutation is not None:
                    yield replace(mutation, scheduled=not rewrite.order and mutation.graph is rewrite.graph)

    def _rewrites_of(self, rule: MRule, base: Graph, order: tuple[str, ...]) -> list[Rewrite]:
        """A graph rule's rewrites of ``base`` in ``order``, found once per graph (F-Tree rules
        keep the base and its order)."""
        found = self.rewrites.setdefault(base, {})
        if rule.name not in found:
            found[rule.name] = rule.rewrites(base, order)
        return found[rule.name]
