"""What one run of MAGIS Algorithm 3 keeps, and how a mutation becomes an M-State.

The :class:`Ledger` holds the hashes of the graphs seen (Alg. 3, lines 5-8 and 12-14:
:func:`magis.search.graph_hash.wl_hash`), the queue ordered by ``BetterThan``
(:class:`~magis.search.objective.Objective`), the best state, the statistics and the
budget (states and seconds). :meth:`Ledger.evaluate` is line 18 and the simulation of
line 19: a graph not seen before is scheduled incrementally (Alg. 2,
:func:`magis.schedule.incremental_schedule`) from its parent's schedule, the order
carried over from the parent kept instead where its peak is lower, and simulated.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

from magis.analysis.ftrans import InvalidFission
from magis.analysis.ftree import FTree
from magis.cost.latency import CostModel
from magis.cost.memory import peak_memory
from magis.ir.graph import Graph
from magis.rules.ftree_mutation import apply_ftree
from magis.schedule import incremental_schedule
from magis.search.graph_hash import wl_hash
from magis.search.objective import Objective
from magis.search.state import EMPTY_TREE, MState, Mutation, Step, changed_nodes, simulate_state

#: seconds for one incremental schedule (Alg. 2); on a large graph its DP may stop at this
#: limit, so there the schedule (and the plan) can depend on the machine's speed
INCREMENTAL_S = 1.0


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
    #: the choice confirmed by timing (:mod:`magis.search.timed_choice`): plans timed, rounds
    #: counted, and what the timing decided (empty: nothing was timed)
    timed_plans: int = 0
    timed_rounds: int = 0
    timed_choice: str = ""


@dataclass
class Ledger:
    """The graphs seen, the queue, the best state, the statistics and the budget of one search."""

    objective: Objective
    cost_model: CostModel
    time_budget: float  # seconds from :attr:`start`
    max_states: int
    bar: tqdm  # one tick per state made
    stats: SearchStats = field(default_factory=SearchStats)
    seen: set[str] = field(default_factory=set)  # Weisfeiler-Lehman hashes of the graphs made
    queue: list[tuple[tuple, int, MState]] = field(default_factory=list)  # (rank, made as, state)
    counter: Iterator[int] = field(default_factory=itertools.count)  # ties go to the state made first
    start: float = field(init=False)
    deadline: float = field(init=False)
    best: MState = field(init=False)  # set by :meth:`begin`
    #: the states no other state beats in both peak and latency (the first of equals kept)
    front: list[MState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = time.perf_counter()
        self.deadline = self.start + self.time_budget

    def begin(self, graph: Graph, order: tuple[str, ...]) -> MState:
        """The captured step in ``order``: the first state, and the best so far (Alg. 3, line 9)."""
        key = wl_hash(graph)
        self.seen.add(key)
        self.stats.states += 1
        self.bar.update()
        self.best = simulate_state(graph, order, EMPTY_TREE, graph, order, key, self.cost_model)
        return self.best

    def out_of_budget(self) -> bool:
        """Whether the search must stop (:attr:`SearchStats.stopped_by` says why)."""
        if self.stats.states >= self.max_states:
            self.stats.stopped_by = "state limit"
        elif time.perf_counter() > self.deadline:
            self.stats.stopped_by = "time budget"
        else:
            return False
        return True

    def consider(self, state: MState, push: bool) -> None:
        """Keep ``state`` if it is the best so far; queue it if ``push``."""
        if self.objective.better_than(state, self.best) or state is self.best:
            self.best = state
            if self.stats.first_feasible_s is None and self.objective.met_by(state):
                self.stats.first_feasible_s = time.perf_counter() - self.start
            self.bar.set_postfix_str(f"best peak {state.peak_bytes / 2**20:.2f} MiB, {state.latency_s * 1e3:.3f} ms")
        if push:
            heapq.heappush(self.queue, (self.objective.queue_rank(state), next(self.counter), state))
        self._onto_front(state)

    def _onto_front(self, state: MState) -> None:
        """Add ``state`` to :attr:`front` unless a state there is as good in both figures."""
        peak, latency = state.peak_bytes, state.latency_s
        if any(s.peak_bytes <= peak and s.latency_s <= latency for s in self.front):
            return
        self.front = [s for s in self.front if not (peak <= s.peak_bytes and latency <= s.latency_s)]
        self.front.append(state)

    def pop(self) -> MState:
        """The best state queued (Alg. 3, line 12), taken off the queue."""
        _, _, state = heapq.heappop(self.queue)
        self.stats.expanded += 1
        return state

    def applied(self, base: Graph, base_order: tuple[str, ...], tree: FTree, step: Step) -> Mutation | None:
        """``base`` fissioned as ``tree`` says, ``base_order`` carried over (None if it does not apply)."""
        try:
            applied = apply_ftree(base, tree, base_order)
        except InvalidFission:
            self.stats.invalid += 1
            return None
        return Mutation(base, base_order, tree, applied.graph, applied.order, (step,))

    def evaluate(self, parent: MState, mutation: Mutation, reschedule: bool = True) -> MState | None:
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
            (*parent.frozen, *mutation.frozen),
        )
        self.stats.states += 1
        rule = mutation.steps[-1].rule
        self.stats.rules[rule] = self.stats.rules.get(rule, 0) + 1
        self.bar.update()
        return state
