"""Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021), simulated on a captured step.

DTR is an online policy: the step runs operator by operator in its captured order;
when an allocation would exceed the memory limit, resident values are evicted, one
at a time, the one with the least ``h(t) = c(t) / (m(t) s(t))`` first (§3: compute
cost ``c``, memory ``m``, staleness ``s``, the time since its last access; this is
the paper's local-cost heuristic, without the evicted-neighbourhood term of
``h_DTR``). An operator whose input was evicted first recomputes it, recursively
(§2). Values no later operator reads are freed at once (the reference count drops:
the paper's "banishing" of dead tensors). What DTR never evicts here: parameters,
inputs and graph outputs (gradients, loss), the inputs of the operator being
computed (locked), and every random op's value: a dropout mask is never drawn again
(DESIGN.md's rule; the paper's own implementation replays the RNG state instead).

:func:`dtr_plan` returns the operations DTR ran, recomputations included, as a
:class:`~magis.search.remat.RematProblem` sequence, which
:func:`~magis.search.remat.replay` turns into a graph the simulator scores and the
runtime runs. Where an operator cannot run within the limit even with every
evictable value evicted, it raises :class:`~magis.search.remat.DoesNotFit`.
"""

from __future__ import annotations

from dataclasses import dataclass

from magis.search.remat import DoesNotFit, RematProblem, sequence_peak


@dataclass(frozen=True)
class DTRPlan:
    """The units DTR ran, in order (repeats are recomputations), and its accounting."""

    sequence: tuple[int, ...]
    peak: int  # bytes, by DTR's own accounting (never above the limit)
    evictions: int
    recomputations: int


def dtr_plan(problem: RematProblem, limit: int) -> DTRPlan:
    """Run ``problem``'s units in order under ``limit`` bytes with DTR's eviction policy."""
    return _DTR(problem, limit).run()


class _DTR:
    def __init__(self, problem: RematProblem, limit: int) -> None:
        self.p = problem
        self.limit = limit
        n = len(problem)
        self.resident = [False] * n
        self.last_access = [0] * n
        self.locks = [0] * n
        self.live = problem.static
        self.peak = problem.static
        self.clock = 0
        self.sequence: list[int] = []
        self.evictions = 0
        # the units still to be run by the program (not recomputations) that read each value
        self.pending_users = [len(problem.users[u]) for u in range(n)]
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
        recomputations = len(self.sequence) - len(p)
        assert sequence_peak(p, self.sequence) <= self.peak
        return DTRPlan(tuple(self.sequence), self.peak, self.evictions, recomputations)

    def release_if_dead(self, u: int) -> None:
        if self.resident[u] and self.pending_users[u] == 0 and u not in self.p.pinned:
            self.resident[u] = False
            self.live -= self.p.size[u]

    def compute(self, u: int) -> None:
        """Make ``u`` resident: its inputs first (recomputed if evicted), then ``u`` itself."""
        p = self.p
        for d in p.deps[u]:
            if not self.resident[d]:
                self.compute(d)
            self.locks[d] += 1
            self.last_access[d] = self.clock
        need = p.size[u] + p.workspace[u]
        while self.live + need > self.limit:
            self.evict(u, need)
        self.clock += 1
        self.sequence.append(u)
        self.resident[u] = True
        self.last_access[u] = self.clock
        self.peak = max(self.peak, self.live + need)
        self.live += p.size[u]
        for d in p.deps[u]:
            self.locks[d] -= 1

    def evict(self, u: int, need: int) -> None:
        """Free the resident value with the least cost / (size x staleness)."""
        p = self.p
        best, best_h = -1, float("inf")
        for v in range(len(p)):
            if not self.resident[v] or self.locks[v] or v in p.fixed or not p.size[v]:
                continue
            staleness = self.clock + 1 - self.last_access[v]
            h = p.cost[v] / (p.size[v] * staleness)
            if h < best_h:
                best, best_h = v, h
        if best < 0:
            raise DoesNotFit(
                f"DTR cannot run {p.units[u][0]} within {self.limit} bytes: it needs {need} more bytes "
                f"with {self.live} resident, none of which may be evicted (inputs of the operator, "
                "parameters, outputs, random values)"
            )
        self.resident[best] = False
        self.live -= p.size[best]
        self.evictions += 1
