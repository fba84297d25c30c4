"""Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021), simulated on a captured step.

DTR is an online policy: the step runs operator by operator in its captured order;
when an allocation would exceed the memory limit, resident values are evicted, one
at a time, the one with the least ``h(t) = c(t) / (m(t) s(t))`` first (compute
cost ``c``, memory ``m``, staleness ``s``, the time since its last access: the
paper's heuristic with the tensor's own cost, without the evicted-neighbourhood
term of its ``h_DTR``). An operator whose input was evicted first recomputes it,
recursively. Values no later operator reads are freed at once (the reference count
drops: the paper's "banishing"). Never evicted here: parameters and inputs, the
bytes of graph outputs (gradients, loss), the inputs of the operator being computed
(locked), and every random op's value: a dropout mask is never drawn again
(a rule of docs/design.md; the paper's implementation replays the RNG state instead). So a
random value is freed only once no evicted reader may need it, and what read it
can then no longer be recomputed either: it is not evicted.

:func:`dtr_plan` returns the operations DTR ran, recomputations included, as a
:class:`~yardstick.planners.recompute_problem.RematProblem` sequence, which
:func:`~yardstick.planners.recompute_problem.replay` turns into a graph the simulator scores and the
runtime runs. Where an operator cannot run within the limit even with every
evictable value evicted, it raises :class:`~yardstick.planners.recompute_problem.DoesNotFit`; so it does
where DTR thrashes, running more than ``max_runs`` times the step's operators (at a
tenth of GPT-Neo's peak it ran 760 times them, 390 times eager's latency, in 4 minutes
of simulation; BTLM's had not ended after 25): a plan no user would run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from yardstick.planners.recompute_problem import DoesNotFit, RematProblem, sequence_peak


@dataclass(frozen=True)
class DTRPlan:
    """The units DTR ran, in order (repeats are recomputations), and its accounting."""

    sequence: tuple[int, ...]
    peak: int  # bytes, by DTR's own accounting (never above the limit)
    evictions: int
    recomputations: int


#: DTR gives up past this many operations per operator of the step (recomputations included)
MAX_RUNS = 20


def dtr_plan(problem: RematProblem, limit: int, max_runs: float = MAX_RUNS) -> DTRPlan:
    """Run ``problem``'s units in order under ``limit`` bytes with DTR's eviction policy,
    giving up (:class:`~yardstick.planners.recompute_problem.DoesNotFit`) past ``max_runs`` x its units run."""
    depth = sys.getrecursionlimit()
    sys.setrecursionlimit(max(depth, 4 * len(problem) + 1000))  # a recomputation may reach back through the step
    try:
        return _DTR(problem, limit, max_runs).run()
    finally:
        sys.setrecursionlimit(depth)


class _DTR:
    def __init__(self, problem: RematProblem, limit: int, max_runs: float) -> None:
        self.p = problem
        self.limit = limit
        self.max_operations = max_runs * len(problem)
        n = len(problem)
        self.resident = [False] * n
        self.dead = [False] * n  # freed after the program's last read (recomputed only if a reader is)
        # values that cannot be computed again: random ops, and readers of a freed one
        self.poisoned = [u in problem.once for u in range(n)]
        self.last_access = [0] * n
        self.locks = [0] * n
        self.live = problem.static
        self.peak = problem.static
        self.clock = 0
        self.sequence: list[int] = []
        self.evictions = 0
        # the units still to be run by the program (not recomputations) that read each value
        self.pending_users = [len(problem.users[u]) for u in range(n)]
        self.waiting: set[int] = set()  # poisoned values the program no longer reads, not yet freed
        if problem.static > limit:
            raise DoesNotFit(f"parameters and inputs alone take {problem.static} bytes, over the limit of {limit}")

    def run(self) -> DTRPlan:
        p = self.p
        for u in range(len(p)):
            self.compute(u)
            for d in p.deps[u]:
                self.pending_users[d] -= 1
                self.release_if_dead(d)
            self.release_if_dead(u)
            for w in list(self.waiting):
                self.release_if_dead(w)
        recomputations = len(self.sequence) - len(p)
        assert sequence_peak(p, self.sequence) <= self.peak
        return DTRPlan(tuple(self.sequence), self.peak, self.evictions, recomputations)

    def release_if_dead(self, u: int) -> None:
        """Free ``u`` once the program reads it no more (DTR's banishing). A value that cannot be
        recomputed waits until no evicted reader may need it; its readers then cannot be recomputed."""
        p = self.p
        if not self.resident[u] or self.pending_users[u] or self.locks[u]:
            return
        if self.poisoned[u]:
            memo: dict[int, bool] = {}
            if any(not self.resident[w] and self.needed(w, memo) for w in p.users[u]):
                self.waiting.add(u)
                return
            self.waiting.discard(u)
            for w in p.users[u]:
                self.poison(w)
        self.resident[u], self.dead[u] = False, True
        self.live -= p.size[u]

    def poison(self, u: int) -> None:
        """``u`` cannot be computed again; nor can what reads it, while ``u`` is not resident."""
        stack = [u]
        while stack:
            v = stack.pop()
            if not self.poisoned[v]:
                self.poisoned[v] = True
                if not self.resident[v]:
                    stack.extend(self.p.users[v])

    def needed(self, u: int, memo: dict[int, bool]) -> bool:
        """Whether the non-resident ``u`` may still be computed again: the program reads it later,
        or it may be recomputed for a non-resident reader (evicted, or freed) that may be.
        Depth first without recursion (paths run through the whole step); ``memo`` keeps the answers."""
        users, resident = self.p.users, self.resident
        stack = [u]
        while stack:
            v = stack[-1]
            if v in memo:
                stack.pop()
            elif self.pending_users[v]:
                memo[v] = True
                stack.pop()
            elif todo := [w for w in users[v] if not resident[w] and w not in memo]:
                stack.extend(todo)
            else:
                memo[v] = any(memo[w] for w in users[v] if not resident[w])
                stack.pop()
        return memo[u]

    def compute(self, u: int) -> None:
        """Make ``u`` resident: its inputs first (recomputed if evicted), then ``u`` itself."""
        p = self.p
        for d in p.deps[u]:
            if not self.resident[d]:
                assert not self.poisoned[d], f"{p.units[d][0]} cannot be recomputed"
                self.compute(d)
            self.locks[d] += 1
            self.last_access[d] = self.clock
        need = p.size[u] + p.kept[u] + p.workspace[u]
        while self.live + need > self.limit:
            self.evict(u, need)
        if len(self.sequence) >= self.max_operations:
            raise DoesNotFit(
                f"DTR thrashes within {self.limit} bytes: {len(self.sequence)} operations run (recomputations "
                f"included) before the step's {len(p)} are done"
            )
        self.clock += 1
        self.sequence.append(u)
        self.resident[u], self.dead[u] = True, False
        self.last_access[u] = self.clock
        self.peak = max(self.peak, self.live + need)
        self.live += p.size[u] + p.kept[u]
        for d in p.deps[u]:
            self.locks[d] -= 1

    def evict(self, u: int, need: int) -> None:
        """Free the resident value with the least cost / (size x staleness)."""
        p = self.p
        best, best_h = -1, float("inf")
        for v in range(len(p)):
            if not self.resident[v] or self.locks[v] or self.poisoned[v] or not p.size[v]:
                continue
            staleness = self.clock + 1 - self.last_access[v]
            h = p.cost[v] / (p.size[v] * staleness)
            if h < best_h:
                best, best_h = v, h
        if best < 0:
            raise DoesNotFit(
                f"DTR cannot run {p.units[u][0]} within {self.limit} bytes: it needs {need} more bytes "
                f"with {self.live} resident, none of which may be evicted (inputs of the operator, "
                "parameters, outputs, random values and what reads them)"
            )
        self.resident[best] = False
        self.live -= p.size[best]
        self.evictions += 1
