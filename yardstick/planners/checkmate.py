"""Checkmate: optimal rematerialization as a mixed-integer program (Jain et al., MLSys 2020, §4).

The step's operators run in a fixed topological order (the captured one), in
*stages*: stage ``t`` computes operator ``t`` and may first recompute any earlier
ones. An operator makes one or more *values* (:class:`~yardstick.planners.recompute_problem.Value`:
storages freed together; the paper's operators make one). Binary variables:

- ``R[t,k]``: operator ``k`` is computed in stage ``t`` (``R[t,t] = 1``, none after ``t``);
- ``S[t,v]``: value ``v`` is resident at the start of stage ``t`` (kept from stage ``t-1``);
- ``FREE[t,v,k]``: value ``v`` is freed right after operator ``k`` runs in stage ``t``
  (``v`` an input of ``k``, or made by ``k``).

Constraints: an operator's inputs are resident or computed before it in the stage
(``R[t,k] <= R[t,maker(v)] + S[t,v]``); only what was resident or computed can be
kept (``S[t+1,v] <= S[t,v] + R[t,maker(v)]``); memory is accounted step by step,
``U[t,k] = U[t,k-1] + R[t,k]·m_k - Σ_v m_v·FREE[t,v,k-1]`` with ``U[t,k]`` (plus the
operator's transient workspace) within the budget; and ``FREE`` is linearised from
"``k`` runs, ``v`` is not kept, and no later reader of ``v`` runs in this stage" by
counting those hazards, as the paper linearises it. The objective is the total
compute time ``Σ_t Σ_k C_k R[t,k]``. Random ops (dropout) and units viewed by another
unit are never recomputed (:mod:`yardstick.planners.recompute_problem`); outputs are kept to the end,
and a recomputed operator's copies of them are transient.

Large graphs are coarsened (the paper plans over layer-level graphs): the units of
:func:`~yardstick.planners.recompute_problem.remat_problem` (views folded into their producers) are
grouped into runs of consecutive units, each run one stage, random units alone
(:func:`stages`). A run's values are those of its units that later runs read; what
it holds only while it runs (its intermediate values) is its workspace; the bytes
of graph outputs it makes stay to the end. Every figure is an upper bound on what
the run needs, so a plan within the budget for the coarse program is within it for
real (:func:`~magis.cost.memory.simulate_memory` of the replayed plan checks it),
and runs are cut so that the bound never exceeds the step's own peak: a budget the
step meets without recomputation is never infeasible.
The program is solved by HiGHS (``highspy``) under a time limit, from a
plan of DTR's eviction policy (:func:`eviction_heuristic`); the plan reports whether it is
optimal or the gap left.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import highspy
import numpy as np

from yardstick.planners.recompute_problem import DoesNotFit, RematProblem, Value

#: stages above which the units are grouped into runs (HiGHS solves ~60 stages in seconds to a minute)
DEFAULT_MAX_STAGES = 60
DEFAULT_TIME_LIMIT_S = 60.0


@dataclass(frozen=True)
class Stages:
    """The values the program schedules: runs of consecutive units of a :class:`RematProblem`.

    ``values`` are the runs' values (:class:`~yardstick.planners.recompute_problem.Value` with ``unit`` the
    run, ``readers`` the later runs), ``made[r]`` and ``reads[r]`` index them; what only
    the run itself reads is no value here but part of its workspace.
    """

    runs: tuple[tuple[int, ...], ...]  # units of each run, in order
    values: tuple[Value, ...]
    made: tuple[tuple[int, ...], ...]
    reads: tuple[tuple[int, ...], ...]
    kept: tuple[int, ...]  # bytes of a run's units that live to the end (graph outputs)
    workspace: tuple[int, ...]  # a run's peak above the values and outputs it leaves (its transient bytes)
    cost: tuple[float, ...]
    fixed: frozenset[int]  # computed once (a random unit, or one another unit views)
    static: int

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def size(self) -> tuple[int, ...]:
        """Bytes of each run's values."""
        return tuple(sum(self.values[v].size for v in made) for made in self.made)


def stages(problem: RematProblem, max_stages: int = DEFAULT_MAX_STAGES, budget: int | None = None) -> Stages:
    """Group ``problem``'s units into runs (one unit per run when they fit in ``max_stages``).

    The program counts a run's inputs as resident until the run ends and its
    intermediate values at their peak inside it, an upper bound on what it holds, so
    a coarse grouping may turn a budget the units meet into an infeasible program
    (Checkmate's issue #151). A run is therefore never longer than keeps that bound,
    in the schedule without recomputation, within the step's own peak
    (:attr:`~yardstick.planners.recompute_problem.RematProblem.no_remat_peak`): whatever budget that
    schedule meets, the program meets too. Below it, a run with only its own inputs
    resident must also leave half of ``budget``'s room above the step's parameters and
    outputs to the values kept across it, or no plan could hold any. Runs end early
    where many bytes cross their boundary or the step is at its largest, and stretch
    elsewhere; their length is capped by the least cap that keeps them within
    ``max_stages`` (where the bounds allow as few), random units' runs of their own
    not counted (each is one stage the program never recomputes: it adds no choice).
    """
    n = len(problem)
    if n <= max_stages:
        return _stages_of(problem, [[u] for u in range(n)])
    floor = problem.static + sum(problem.kept)
    alone = problem.no_remat_peak if budget is None else min(problem.no_remat_peak, (budget + floor) // 2)
    cut = _RunBoundaries(problem, alone)
    low, high = 1, n  # the least cap on a run's units that gives at most max_stages runs
    while low < high:
        middle = (low + high) // 2
        if sum(run[0] not in problem.once for run in cut.runs(middle)) <= max_stages:
            high = middle
        else:
            low = middle + 1
    return _stages_of(problem, cut.runs(low))


class _RunBoundaries:
    """Greedy grouping of consecutive units into runs whose bounds stay within limits.

    In the schedule without recomputation, a run starting at unit ``a`` holds the values
    made before ``a`` and read from ``a`` on (all of them, to its end) and, at its unit
    ``j``, the values it made that are still read from ``j`` on, plus ``j``'s workspace:
    that bound stays within the step's peak. Alone, it holds only the values made
    before ``a`` that it reads: that bound stays within ``alone``.
    """

    def __init__(self, problem: RematProblem, alone: int) -> None:
        self.problem = problem
        n = len(problem)
        last = [max(v.readers, default=v.unit) for v in problem.values]
        self.dying: list[list[int]] = [[] for _ in range(n)]  # values whose last reader is each unit
        crossing = [0] * (n + 1)  # bytes made before each unit and read from it on
        for v, value in enumerate(problem.values):
            self.dying[last[v]].append(v)
            crossing[value.unit + 1] += value.size
            crossing[last[v] + 1] -= value.size
        self.held = list(itertools.accumulate(crossing))  # entering each unit, outputs aside
        self.kept_before = [0, *itertools.accumulate(problem.kept)]
        self.limit = problem.no_remat_peak
        self.alone = alone

    def runs(self, cap: int) -> list[list[int]]:
        """Runs of at most ``cap`` units, each as long as its bounds allow; a random unit is a run
        of its own (it is never recomputed, and would pin the units around it)."""
        p = self.problem
        runs: list[list[int]] = []
        start = 0
        while start < len(p):
            run = [start]
            base = p.static + self.kept_before[start]
            inputs = set(p.reads[start])  # the values made before the run that it reads
            inside = p.size[start] + p.kept[start]  # bytes the run made that are still read
            peak = inside + p.workspace[start]  # the most it holds at once, inputs aside
            while start not in p.once and len(run) < cap and run[-1] + 1 < len(p):
                j = run[-1] + 1
                if j in p.once:
                    break
                inside += (
                    p.size[j]
                    + p.kept[j]
                    - sum(p.values[v].size for v in self.dying[j - 1] if p.values[v].unit >= start)
                )
                peak = max(peak, inside + p.workspace[j])
                inputs.update(v for v in p.reads[j] if p.values[v].unit < start)
                read = sum(p.values[v].size for v in inputs)
                if base + self.held[start] + peak > self.limit or base + read + peak > self.alone:
                    break
                run.append(j)
            runs.append(run)
            start = run[-1] + 1
        return runs


def _stages_of(problem: RematProblem, runs: list[list[int]]) -> Stages:
    """The coarse program of ``runs``: their values (a unit's values read by later runs, grouped by
    the runs that read them), outputs, workspace (peak while the run runs alone), cost."""
    run_of = {u: r for r, units in enumerate(runs) for u in units}
    run_value: dict[int, int] = {}  # unit value -> run value
    grouped: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for v, value in enumerate(problem.values):
        readers = tuple(sorted({run_of[w] for w in value.readers} - {run_of[value.unit]}))
        if readers:
            grouped.setdefault((run_of[value.unit], readers), []).append(v)
    values = []
    for (r, readers), members in sorted(grouped.items()):
        for v in members:
            run_value[v] = len(values)
        values.append(Value(r, sum(problem.values[v].size for v in members), readers))
    made: list[list[int]] = [[] for _ in runs]
    for v, value in enumerate(values):
        made[value.unit].append(v)
    reads, kept, workspace = [], [], []
    for r, units in enumerate(runs):
        # what the run reads from earlier runs (a unit value read inside its own run is no run value)
        reads.append(
            tuple(
                sorted({run_value[v] for u in units for v in problem.reads[u] if run_of[problem.values[v].unit] != r})
            )
        )
        kept.append(sum(problem.kept[u] for u in units))
        workspace.append(_run_peak(problem, units, run_of) - sum(values[v].size for v in made[r]) - kept[r])
    return Stages(
        tuple(tuple(u) for u in runs),
        tuple(values),
        tuple(map(tuple, made)),
        tuple(reads),
        tuple(kept),
        tuple(workspace),
        tuple(sum(problem.cost[u] for u in units) for units in runs),
        frozenset(r for r, units in enumerate(runs) if problem.once & set(units)),
        problem.static,
    )


def _run_peak(problem: RematProblem, units: list[int], run_of: dict[int, int]) -> int:
    """The most bytes ``units`` (one run) hold at once, run alone: what they made and is still read
    (to the run's end where a later run reads it), their outputs, and each unit's workspace."""
    r = run_of[units[0]]
    live = peak = 0
    for u in units:
        live += problem.size[u] + problem.kept[u]
        peak = max(peak, live + problem.workspace[u])
        for v in problem.made[u] + problem.reads[u]:
            value = problem.values[v]
            if run_of[value.unit] == r and max(value.readers, default=value.unit) == u:
                live -= value.size  # u is its last reader, and no later run reads it
    return peak


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

    HiGHS starts from the plan of :func:`eviction_heuristic` where it finds one, so
    the time limit leaves at least that plan, with the gap still open. Where the
    grouped program is infeasible, it is grouped again twice as finely, down to one
    unit per stage, within the same time limit. Raises
    :class:`~yardstick.planners.recompute_problem.DoesNotFit` when some unit cannot run within
    ``budget`` whatever else is freed, when the program is infeasible, or when no
    plan was found within ``time_limit_s``.
    """
    if budget <= 0 or time_limit_s <= 0 or max_stages < 1:
        raise ValueError(
            f"budget, time_limit_s and max_stages must be positive, got {budget}, {time_limit_s} and {max_stages}"
        )
    start = time.perf_counter()
    need, unit = _largest_step(problem)
    if need > budget:
        raise DoesNotFit(
            f"Checkmate: {problem.units[unit][0]} needs {need} bytes with only its inputs, the parameters and "
            f"the outputs before it resident, over {budget} bytes"
        )
    while True:
        st = stages(problem, max_stages, budget)
        model = _Program(st, budget)
        highs = _solve(model, time_limit_s - (time.perf_counter() - start))
        status = highs.getModelStatus()
        if status != highspy.HighsModelStatus.kInfeasible or len(st) == len(problem):
            break
        if time.perf_counter() - start >= time_limit_s:
            break
        max_stages = 2 * len(st)
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


def _largest_step(problem: RematProblem) -> tuple[int, int]:
    """The most bytes one unit needs whatever the plan, and which unit: the parameters, the outputs
    made up to it, the values it reads, its own and its workspace. No plan fits a smaller budget."""
    kept_before = 0
    largest = (0, 0)
    for u in range(len(problem)):
        kept_before += problem.kept[u]
        inputs = sum(problem.values[v].size for v in problem.reads[u])
        need = problem.static + kept_before + inputs + problem.size[u] + problem.workspace[u]
        largest = max(largest, (need, u))
    return largest


def _solve(model: _Program, time_limit_s: float) -> highspy.Highs:
    """HiGHS run on ``model`` for at most ``time_limit_s``, from :func:`eviction_heuristic`'s plan."""
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", max(float(time_limit_s), 1e-3))
    highs.setOptionValue("mip_rel_gap", 1e-6)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("primal_feasibility_tolerance", 1e-10)
    highs.setOptionValue("mip_feasibility_tolerance", 1e-10)
    highs.passModel(model.lp())
    incumbent = eviction_heuristic(model)
    if incumbent is not None:
        start_from = highspy.HighsSolution()
        start_from.col_value = list(incumbent)
        start_from.value_valid = True
        highs.setSolution(start_from)
    highs.run()
    return highs


def eviction_heuristic(model: _Program) -> np.ndarray | None:
    """A feasible point of ``model``, or ``None`` where this heuristic finds none.

    DTR's eviction policy (Kirisame et al., ICLR 2021) at the granularity of the
    program's stages: a stage recomputes the runs whose values it reads and does not
    hold (recursively), and keeps for the stages after it every value a later stage
    reads, but those it must drop to fit, least ``cost / (size x staleness)`` first
    (``cost``: of every run that recomputing it takes, DTR's evicted neighbourhood).
    To fit is for the stage's own steps (where only dropping what it reads or makes
    helps: the rest it holds throughout) and for the next stage's, that one keeping
    only what the stage after it reads and what it may not drop. Without recomputation where that fits; no
    backtracking: a stage that cannot fit so ends the search. Values of runs computed
    once are never dropped.
    """
    st = model.st
    n = len(st)
    x = np.zeros(len(model.cost))
    resident: set[int] = set()
    last_read = {v: value.unit for v, value in enumerate(st.values)}  # the last stage that read each value

    def evictable(v: int) -> bool:
        return st.values[v].size > 0 and st.values[v].unit not in st.fixed

    def h(v: int, t: int, keep: set[int]) -> float:
        value = st.values[v]
        again = _recomputed(st, value.unit, keep - {v})
        return sum(st.cost[k] for k in again) / (value.size * (t + 1 - last_read[v]))

    def kept_after(t: int, held: set[int], computed: set[int], wanted: Iterable[int]) -> set[int]:
        """Of ``wanted``, what stage ``t`` can keep: held or made, and of use to a later stage."""
        have = held.union(*(st.made[k] for k in computed))
        return {v for v in wanted if v in have and v in model.S[t + 1] and any(j > t for j in st.values[v].readers)}

    for t in range(n):
        computed = _recomputed(st, t, resident)
        for k in computed:
            last_read.update((v, t) for v in st.reads[k])
        keep = kept_after(t, resident, computed, range(len(st.values)))
        touched = {v for k in computed for v in (*st.reads[k], *st.made[k])}
        while True:
            over = model.try_stage(x, t, computed, resident, keep)
            droppable = touched
            if not over and t + 1 < n:
                after = _recomputed(st, t + 1, keep)
                wanted = {v for v in keep if not evictable(v)}.union(st.reads[t + 2] if t + 2 < n else ())
                onward = kept_after(t + 1, keep, after, wanted)
                over = model.try_stage(x, t + 1, after, keep, onward)
                droppable = keep
            if not over:
                break
            candidates = sorted((v for v in keep & droppable if evictable(v)), key=lambda v: h(v, t, keep))
            if not candidates:
                return None
            freed = 0
            for v in candidates:  # enough to cover the excess, before measuring again
                keep.remove(v)
                freed += st.values[v].size
                if freed >= over * model.budget:
                    break
        resident = keep
    return x


def _recomputed(st: Stages, t: int, resident: set[int]) -> set[int]:
    """The runs that computing run ``t`` holding ``resident`` takes: ``t`` and, recursively, the
    makers of the values they read and it does not hold."""
    runs, todo = {t}, [t]
    while todo:
        for v in st.reads[todo.pop()]:
            maker = st.values[v].unit
            if v not in resident and maker not in runs:
                runs.add(maker)
                todo.append(maker)
    return runs


class _Program:
    """The MILP's columns and rows, built as a sparse row-wise matrix.

    ``R[t][k]`` and ``S[t][v]`` (a dict: only values some later stage may use) are the
    decisions; every other column is *defined* by one row given the columns before it
    (memory ``U`` by its balance, ``FREE`` by its hazards), which :meth:`try_stage`
    uses to complete a stage's decisions into a point of the program.
    """

    def __init__(self, st: Stages, budget: int) -> None:
        self.st = st
        self.budget = budget
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        n = len(st)
        self.defined: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # per stage: (column, its row)
        self.steps: list[list[int]] = [[] for _ in range(n)]  # per stage: the budget row of each run
        self.R, self.S = self._decisions()
        self._dependency_rows()
        self._memory_rows()

    def _decisions(self) -> tuple[list[list[int]], list[dict[int, int]]]:
        """The columns ``R[t][k]`` (stage ``t`` computes run ``k``) and ``S[t][v]`` (value ``v`` is
        resident as stage ``t`` starts; only values a stage from ``t`` on may use)."""
        st, n = self.st, len(self.st)
        R = [
            [
                self.col(st.cost[k], 1.0 if k == t else 0.0, 0.0 if k in st.fixed and k < t else 1.0)
                for k in range(t + 1)
            ]
            for t in range(n)
        ]

        def useful(v: int, t: int) -> bool:  # a stage from t on may read it, or recompute a reader
            return any(j >= t or j not in st.fixed for j in st.values[v].readers)

        S = [
            {v: self.col(0.0, 0.0, 1.0) for v, value in enumerate(st.values) if value.unit < t and useful(v, t)}
            for t in range(n + 1)
        ]
        return R, S

    def _dependency_rows(self) -> None:
        """A run's inputs are resident or computed earlier in its stage; a value is kept only if it
        was resident or computed."""
        st, inf = self.st, highspy.kHighsInf
        for t in range(len(st)):
            for k in range(t + 1):  # dependencies: resident or computed earlier in the stage
                if self.upper[self.R[t][k]] == 0.0:
                    continue
                for v in st.reads[k]:
                    self.row({self.R[t][k]: 1.0, self.R[t][st.values[v].unit]: -1.0, self.S[t][v]: -1.0}, -inf, 0.0)
            for v, kept in self.S[t + 1].items():  # keep only what was resident or computed
                coeffs = {kept: 1.0, self.R[t][st.values[v].unit]: -1.0}
                if v in self.S[t]:
                    coeffs[self.S[t][v]] = -1.0
                self.row(coeffs, -inf, 0.0)

    def _memory_rows(self) -> None:
        """Memory ``U[t][k]`` after each run ``k`` of each stage ``t``, by its balance, within the budget."""
        st, inf = self.st, highspy.kHighsInf
        # bytes as fractions of the budget: rows near 1, so HiGHS' tolerances stay below a byte
        b = 1.0 / self.budget
        size = st.size
        kept_before = np.cumsum([0, *st.kept])
        for t in range(len(st)):
            previous = None
            for k in range(t + 1):
                u = self.col(0.0, -inf, inf, integer=False)
                coeffs = {u: 1.0, self.R[t][k]: -size[k] * b}
                constant = st.kept[t] * b if k == t else 0.0  # outputs stay from their stage on
                if previous is None:
                    constant += (st.static + float(kept_before[t])) * b
                    for v, resident in self.S[t].items():
                        coeffs[resident] = -st.values[v].size * b
                else:
                    coeffs[previous] = -1.0
                    for v, free in self.frees(t, k - 1):
                        coeffs[free] = coeffs.get(free, 0.0) + st.values[v].size * b
                self.defined[t].append((u, len(self.rows)))
                self.row(coeffs, constant, constant)
                self.steps[t].append(len(self.rows))
                # a recomputed run's outputs are copies no one reads: transient, like its workspace
                transient = st.workspace[k] + (st.kept[k] if k < t else 0)
                self.row({u: 1.0, self.R[t][k]: transient * b}, -inf, 1.0)
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
        """New columns ``FREE[t,v,k]``, one per value ``v`` that may be freed after run ``k`` in stage ``t``."""
        st = self.st
        out = []
        for v in (*st.reads[k], *st.made[k]):
            if st.values[v].size == 0:
                continue
            free = self.col(0.0, 0.0, 1.0)
            later = [self.R[t][j] for j in st.values[v].readers if k < j <= t]
            kept = self.S[t + 1].get(v)
            # hazards: k does not run, v is kept, a later reader of v runs in this stage
            hazards = {self.R[t][k]: -1.0, **({kept: 1.0} if kept is not None else {}), **{r: 1.0 for r in later}}
            bound = 2 + len(later)
            # 1 - FREE <= hazards  and  hazards <= bound (1 - FREE); hazards = 1 - R + S + Σ R_later
            self.defined[t].append((free, len(self.rows)))
            self.row({**hazards, free: 1.0}, 0.0, highspy.kHighsInf)
            self.row({**hazards, free: float(bound)}, -highspy.kHighsInf, float(bound) - 1.0)
            out.append((v, free))
        return out

    def try_stage(self, x: np.ndarray, t: int, computed: set[int], resident: set[int], keep: set[int]) -> float:
        """Set stage ``t`` in ``x``: it computes ``computed`` (each run's inputs resident or computed
        before it), holds ``resident`` as it starts and ``keep`` as it ends; the columns its rows
        define follow. Returns by how much (a fraction of the budget) its worst step exceeds it."""
        for k, column in enumerate(self.R[t]):
            x[column] = k in computed
        for v, column in self.S[t].items():
            x[column] = v in resident
        for v, column in self.S[t + 1].items():
            x[column] = v in keep
        for column, row in self.defined[t]:  # the least each defining row allows, given what precedes it
            coeffs, lower, _ = self.rows[row]
            rest = sum(a * x[c] for c, a in coeffs.items() if c != column)
            x[column] = max(self.lower[column], (lower - rest) / coeffs[column])
        over = (sum(a * x[c] for c, a in self.rows[row][0].items()) - self.rows[row][2] for row in self.steps[t])
        return max(0.0, max(over) - 1e-9)

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
