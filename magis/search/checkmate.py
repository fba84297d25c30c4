"""Checkmate: optimal rematerialization as a mixed-integer program (Jain et al., MLSys 2020, §4).

The step's values are computed in a fixed topological order (the captured one), in
*stages*: stage ``t`` computes value ``t`` and may first recompute any earlier
values. Binary variables:

- ``R[t,i]``: value ``i`` is computed in stage ``t`` (``R[t,t] = 1``, none after ``t``);
- ``S[t,i]``: value ``i`` is resident at the start of stage ``t`` (kept from stage ``t-1``);
- ``FREE[t,i,k]``: value ``i`` is freed right after value ``k`` runs in stage ``t``
  (``i`` an input of ``k``, or ``k`` itself).

Constraints: an operator's inputs are resident or computed before it in the stage
(``R[t,k] <= R[t,i] + S[t,i]``); only what was resident or computed can be
kept (``S[t+1,i] <= S[t,i] + R[t,i]``); memory is accounted step by step,
``U[t,k] = U[t,k-1] + R[t,k]·m_k - Σ_i m_i·FREE[t,i,k-1]`` with ``U[t,k]`` (plus the
operator's transient workspace) within the budget; and ``FREE`` is
linearised from "``k`` runs, ``i`` is not kept, and no later user of ``i`` runs in
this stage" by counting those hazards, as the paper linearises it. The objective is the total compute
time ``Σ_t Σ_i C_i R[t,i]``. Values of random ops (dropout), graph outputs and
values viewed by another unit are never recomputed (:mod:`magis.search.remat`);
outputs are kept to the end.

Large graphs are coarsened (the paper plans over layer-level graphs): the units of
:func:`~magis.search.remat.remat_problem` (views folded into their producers) are
grouped into runs of consecutive units, each run one stage value, random units
alone. A run's value is the bytes its units make that later runs read; what it
holds only while it runs (its intermediate values) is its workspace; the bytes of
graph outputs it makes stay to the end. Every figure is an upper bound on what the
run needs, so a plan within the budget for the coarse program is within it for
real (:func:`~magis.cost.memory.simulate_memory` of the replayed plan checks it).
The program is solved by HiGHS (``highspy``) under a time limit; the plan reports
whether it is optimal or the gap left.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import highspy
import numpy as np

from magis.search.remat import DoesNotFit, RematProblem

#: stages above which the units are grouped into runs (HiGHS solves ~60 stages in seconds to a minute)
DEFAULT_MAX_STAGES = 60
DEFAULT_TIME_LIMIT_S = 60.0


@dataclass(frozen=True)
class Stages:
    """The values the program schedules: runs of consecutive units of a :class:`RematProblem`."""

    runs: tuple[tuple[int, ...], ...]  # units of each run, in order
    size: tuple[int, ...]  # bytes of a run's units read by later runs (freeable)
    kept: tuple[int, ...]  # bytes of a run's units that live to the end (graph outputs)
    workspace: tuple[int, ...]  # bytes a run holds only while it runs, above size + kept
    cost: tuple[float, ...]
    deps: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    fixed: frozenset[int]  # computed once (random, outputs)
    static: int

    def __len__(self) -> int:
        return len(self.runs)


def stages(problem: RematProblem, max_stages: int = DEFAULT_MAX_STAGES) -> Stages:
    """Group ``problem``'s units into at most about ``max_stages`` runs (one unit per run when they fit)."""
    n = len(problem)
    per_run = max(1, math.ceil(n / max_stages))
    runs: list[list[int]] = []
    for u in range(n):
        # a random unit is a run of its own: it is never recomputed, and would pin the units around it
        if not runs or _random(problem, u) or _random(problem, runs[-1][-1]) or len(runs[-1]) >= per_run:
            runs.append([u])
        else:
            runs[-1].append(u)
    run_of = {u: r for r, units in enumerate(runs) for u in units}
    size, kept, workspace, cost, deps, users, fixed = [], [], [], [], [], [], set()
    for r, units in enumerate(runs):
        inside = set(units)
        out_bytes = sum(problem.size[u] for u in units if any(run_of[v] > r for v in problem.users[u]))
        pinned = sum(problem.kept[u] for u in units)
        live, peak = 0, 0
        for i, u in enumerate(units):
            peak = max(peak, live + problem.size[u] + problem.kept[u] + problem.workspace[u])
            live += problem.size[u] + problem.kept[u]
            for v in (*problem.deps[u], u):  # free what no later unit of the run, nor a later run, reads
                if (
                    v in inside
                    and units.index(v) <= i
                    and not any((w in inside and units.index(w) > i) or run_of[w] > r for w in problem.users[v])
                ):
                    live -= problem.size[v]
        size.append(out_bytes)
        kept.append(pinned)
        workspace.append(max(0, peak - out_bytes - pinned))
        cost.append(sum(problem.cost[u] for u in units))
        deps.append(tuple(sorted({run_of[d] for u in units for d in problem.deps[u]} - {r})))
        users.append(tuple(sorted({run_of[w] for u in units for w in problem.users[u]} - {r})))
        if inside & problem.fixed:
            fixed.add(r)
    return Stages(
        tuple(tuple(u) for u in runs),
        tuple(size),
        tuple(kept),
        tuple(workspace),
        tuple(cost),
        tuple(deps),
        tuple(users),
        frozenset(fixed),
        problem.static,
    )


def _random(problem: RematProblem, u: int) -> bool:
    """A random op's unit (or one another unit views): never computed twice."""
    return u in problem.once


@dataclass(frozen=True)
class CheckmatePlan:
    """The solved program: the unit sequence to run (repeats recompute) and how it was solved."""

    sequence: tuple[int, ...]
    status: str  # "optimal" or "time limit"
    gap: float  # relative gap between the plan's cost and the best bound (0 when optimal)
    cost: float  # the objective: total compute seconds, recomputations included
    seconds: float
    stages: int
    units: int


def checkmate_plan(
    problem: RematProblem,
    budget: int,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_stages: int = DEFAULT_MAX_STAGES,
) -> CheckmatePlan:
    """Checkmate's MILP for ``problem`` within ``budget`` bytes, solved by HiGHS.

    Raises :class:`~magis.search.remat.DoesNotFit` when the program is infeasible or
    no plan was found within ``time_limit_s``.
    """
    if budget <= 0 or time_limit_s <= 0 or max_stages < 1:
        raise ValueError(
            f"budget, time_limit_s and max_stages must be positive, got {budget}, {time_limit_s} and {max_stages}"
        )
    start = time.perf_counter()
    st = stages(problem, max_stages)
    model = _Program(st, budget)
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", 1e-6)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("primal_feasibility_tolerance", 1e-10)
    highs.setOptionValue("mip_feasibility_tolerance", 1e-10)
    highs.passModel(model.lp())
    highs.run()
    status = highs.getModelStatus()
    info = highs.getInfo()
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    seconds = time.perf_counter() - start
    if status == highspy.HighsModelStatus.kInfeasible:
        raise DoesNotFit(f"Checkmate: no plan over {len(st)} stages fits {budget} bytes (the program is infeasible)")
    if not has_solution:
        raise DoesNotFit(
            f"Checkmate: no plan within {budget} bytes found in {seconds:.0f} s over {len(st)} stages "
            f"(HiGHS: {highs.modelStatusToString(status)})"
        )
    values = np.asarray(highs.getSolution().col_value)
    sequence = tuple(u for t in range(len(st)) for k in range(t + 1) if values[model.R[t][k]] > 0.5 for u in st.runs[k])
    optimal = status == highspy.HighsModelStatus.kOptimal
    gap = 0.0 if optimal else float(info.mip_gap)
    return CheckmatePlan(
        sequence,
        "optimal" if optimal else "time limit",
        gap,
        float(info.objective_function_value),
        seconds,
        len(st),
        len(problem),
    )


class _Program:
    """The MILP's columns and rows, built as a sparse row-wise matrix."""

    def __init__(self, st: Stages, budget: int) -> None:
        self.st = st
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        n = len(st)
        inf = highspy.kHighsInf
        self.R = [
            [
                self.col(st.cost[i], 1.0 if i == t else 0.0, 0.0 if i in st.fixed and i < t else 1.0)
                for i in range(t + 1)
            ]
            for t in range(n)
        ]
        self.S = [[self.col(0.0, 0.0, 1.0) for _ in range(t)] for t in range(n + 1)]
        for t in range(n):
            for k in range(t + 1):  # dependencies: resident or computed earlier in the stage
                for i in st.deps[k]:
                    self.row({self.R[t][k]: 1.0, self.R[t][i]: -1.0, self.S[t][i]: -1.0}, -inf, 0.0)
            for i in range(t + 1):  # keep only what was resident or computed
                coeffs = {self.S[t + 1][i]: 1.0, self.R[t][i]: -1.0}
                if i < t:
                    coeffs[self.S[t][i]] = -1.0
                self.row(coeffs, -inf, 0.0)
        # bytes as fractions of the budget: rows near 1, so HiGHS' tolerances stay below a byte
        b = 1.0 / budget
        kept_before = np.cumsum([0, *st.kept])
        for t in range(n):
            previous = None
            for k in range(t + 1):
                u = self.col(0.0, -inf, inf, integer=False)
                coeffs = {u: 1.0, self.R[t][k]: -st.size[k] * b}
                constant = st.kept[t] * b if k == t else 0.0  # outputs stay from their stage on
                if previous is None:
                    constant += (st.static + float(kept_before[t])) * b
                    for i in range(t):
                        coeffs[self.S[t][i]] = -st.size[i] * b
                else:
                    coeffs[previous] = -1.0
                    for i, free in self.frees(t, k - 1):
                        coeffs[free] = coeffs.get(free, 0.0) + st.size[i] * b
                self.row(coeffs, constant, constant)
                self.row({u: 1.0, self.R[t][k]: st.workspace[k] * b}, -inf, 1.0)
                previous = u

    def col(self, cost: float, lower: float, upper: float, integer: bool = True) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, coeffs: dict[int, float], lower: float, upper: float) -> None:
        self.rows.append((coeffs, lower, upper))

    def frees(self, t: int, k: int) -> list[tuple[int, int]]:
        """New columns ``FREE[t,i,k]``, one per value ``i`` that may be freed after ``k`` runs in stage ``t``."""
        st = self.st
        out = []
        for i in (*st.deps[k], k):
            if st.size[i] == 0:
                continue
            free = self.col(0.0, 0.0, 1.0)
            later = [self.R[t][j] for j in st.users[i] if k < j <= t]
            # hazards: k does not run, i is kept, a later user of i runs in this stage
            hazards = {self.R[t][k]: -1.0, self.S[t + 1][i]: 1.0, **{r: 1.0 for r in later}}
            bound = 2 + len(later)
            # 1 - FREE <= hazards  and  hazards <= bound (1 - FREE); hazards = 1 - R + S + Σ R_later
            self.row({**hazards, free: 1.0}, 0.0, highspy.kHighsInf)
            self.row({**hazards, free: float(bound)}, -highspy.kHighsInf, float(bound) - 1.0)
            out.append((i, free))
        return out

    def lp(self) -> highspy.HighsLp:
        lp = highspy.HighsLp()
        lp.num_col_ = len(self.cost)
        lp.num_row_ = len(self.rows)
        lp.col_cost_ = np.asarray(self.cost, dtype=float)
        lp.col_lower_ = np.asarray(self.lower, dtype=float)
        lp.col_upper_ = np.asarray(self.upper, dtype=float)
        lp.row_lower_ = np.asarray([lo for _, lo, _ in self.rows], dtype=float)
        lp.row_upper_ = np.asarray([hi for _, _, hi in self.rows], dtype=float)
        starts, index, value = [0], [], []
        for coeffs, _, _ in self.rows:
            index.extend(coeffs)
            value.extend(coeffs.values())
            starts.append(len(index))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(value, dtype=float)
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in self.integer
        ]
        return lp
