"""magis' own methods, run by the magis runtime.

- ``magis-captured`` — the captured graph in captured order.
- ``magis-scheduled`` — the same graph in the memory-optimal order of :func:`magis.schedule.schedule`.
- ``magis-fission`` — the step made separable along its samples with one F-Tree node enabled
  (:func:`magis.search.single_fission.best_single_fission`): the fewest parts whose simulated peak
  is within ``budget`` times the scheduled peak (``magis-fission@0.5``).
- ``magis-optimize`` — the M-Optimizer (MAGIS Alg. 3, :mod:`magis.search.m_optimizer`) in
  memory-limit mode at ``budget`` times the captured step's simulated peak (eager's step, as
  magis sees it): the lowest simulated latency within it, or the lowest peak when nothing fits
  (``magis-optimize@0.5``). Its latencies are priced by the local device's profiled cost model
  for tiny/small presets and by ``h200`` for paper (:func:`search_model`).
- ``magis-optimize-interpreted``, ``magis-optimize-compiled`` (opt-in) — ``magis-optimize``'s plan
  run by the interpreter, and with its segments compiled by Inductor (``compile=True``), beside
  its own generated code (issue #30).
- ``magis-optimize-lat`` — the same search in latency-limit mode: the lowest simulated peak within
  ``L`` times the captured step's simulated latency, one variant per limit of
  :data:`~yardstick.methods.method_registry.LATENCY_LIMITS` (``magis-optimize-lat@1.1``; MAGIS Fig. 9).
"""

from __future__ import annotations

from typing import Any

from magis.api import floor_bytes
from magis.cost.latency import CostModel, cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.plan import PlanRuntime
from magis.schedule import schedule
from magis.search.m_optimizer import DEFAULT_MAX_STATES, Mode, Objective, SearchResult, m_optimize
from magis.search.single_fission import SingleFission, choose_within, single_fission_options
from yardstick.methods.eager_peer import eager_simulate
from yardstick.methods.method_registry import LATENCY_LIMITS, MAGIS, Method, Runnable, Simulated, register
from yardstick.methods.steps import planned_steps, runtime_runnable
from yardstick.methods.subject import Subject

#: seconds and states the M-Optimizer searches per workload and budget in the yardstick (its defaults)
OPTIMIZE_SECONDS = 60.0
OPTIMIZE_STATES = DEFAULT_MAX_STATES


def search_details(result: SearchResult, peak: int, latency: float) -> dict[str, Any]:
    """A search's statistics (MAGIS §7.4: how fast a first plan comes) and what its plan does,
    beside the captured step's simulated ``peak`` and ``latency``: set beside a measured row,
    the simulator's fidelity."""
    stats, initial = result.stats, result.initial
    floor = floor_bytes(initial.graph, simulate_memory(initial.graph, initial.order))
    return {
        "simulated_peak_ratio": result.best.peak_bytes / peak,
        # what no plan holds less than (weights, gradients returned...): a limit below it is unmet by any search
        "floor_ratio": floor / peak,
        "simulated_latency_ratio": result.best.latency_s / latency,
        "search_s": stats.seconds,
        "first_feasible_s": stats.first_feasible_s,
        "states": stats.states,
        "stopped_by": stats.stopped_by,
        "limit_met": stats.first_feasible_s is not None,
        "fission": result.best.regions(),
        "steps": [step.rule for step in result.best.steps],
    }


def scheduled_order(subject: Subject) -> tuple[str, ...]:
    """The captured graph's memory-optimal order (:func:`magis.schedule.schedule`, made once)."""
    return subject.once("scheduled_order", lambda: tuple(schedule(subject.graph).order))


def fission_options(subject: Subject) -> list[SingleFission]:
    """The scheduled step and each single fission of it (one enumeration for every budget, made once)."""
    return subject.once("fission_options", lambda: single_fission_options(subject.graph, scheduled_order(subject)))


def fission_within(subject: Subject, budget: float) -> SingleFission:
    """magis' best single fission within ``budget`` times the scheduled peak."""
    options = fission_options(subject)
    return choose_within(options, int(budget * options[0].peak_bytes))


def search_model(subject: Subject) -> CostModel:
    """What the M-Optimizer's searches price on: the h200 profile at paper size (fake tensors),
    this machine's CPU otherwise, estimating what the captured step does not hold as
    :func:`magis.optimize` does (made once)."""
    device = "h200" if subject.preset == "paper" else "cpu"
    return subject.once("search_model", lambda: cost_model(device, estimate_unseen=True))


def captured_simulated(subject: Subject) -> tuple[int, float]:
    """The captured step's simulated peak and latency (captured order, :func:`search_model`):
    what the M-Optimizer's limits and simulated ratios are taken against (made once)."""

    def make() -> tuple[int, float]:
        captured = [n.name for n in subject.graph.nodes]
        latency = estimate_latency(subject.graph, captured, search_model(subject)).total_s
        return simulate_memory(subject.graph, captured).peak, latency

    return subject.once("captured_simulated", make)


def optimized(subject: Subject, limit: float, mode: Mode = "memory") -> SearchResult:
    """The M-Optimizer's search for the best state within ``limit`` times the captured step's
    simulated peak (``memory`` mode) or latency (``latency`` mode), run once per limit."""

    def make() -> SearchResult:
        peak, latency = captured_simulated(subject)
        if mode == "memory":
            objective = Objective(mode, memory_bytes=int(limit * peak))
        else:
            objective = Objective(mode, latency_s=limit * latency)
        return m_optimize(
            subject.graph, objective, search_model(subject), OPTIMIZE_SECONDS, OPTIMIZE_STATES, progress=False
        )

    return subject.once(("optimized", mode, limit), make)


def _captured_real(subject: Subject, _budget: float | None) -> Runnable:
    return runtime_runnable(subject, [n.name for n in subject.graph.nodes])


def _scheduled_real(subject: Subject, _budget: float | None) -> Runnable:
    return runtime_runnable(subject, scheduled_order(subject))


def _scheduled_simulate(subject: Subject, _budget: float | None) -> Simulated:
    return subject.graph, scheduled_order(subject)


def _fission(subject: Subject, budget: float) -> Simulated:
    chosen = fission_within(subject, budget)
    return chosen.graph, chosen.order


def _optimizer(
    name: str, description: str, mode: Mode, runtime: PlanRuntime = "generated", opt_in: bool = False, **limits: Any
) -> Method:
    """The M-Optimizer in ``mode`` as a method: a variant's budget or latency limit (``limits``
    say which) is its limit; its row's details are the search's; its plan runs as ``runtime``."""

    def best(subject: Subject, limit: float) -> Simulated:
        state = optimized(subject, limit, mode).best
        return state.graph, state.order

    def details(subject: Subject, limit: float | None) -> dict[str, Any]:
        """The search's statistics (MAGIS §7.4: how fast a first plan comes) and what the plan does."""
        assert limit is not None
        return search_details(optimized(subject, limit, mode), *captured_simulated(subject))

    return Method(name, description, MAGIS, *planned_steps(best, runtime), details=details, opt_in=opt_in, **limits)


register(Method("magis-captured", "magis runtime, captured order", MAGIS, _captured_real, eager_simulate))
register(Method("magis-scheduled", "magis runtime, memory-optimal order", MAGIS, _scheduled_real, _scheduled_simulate))
register(
    Method(
        "magis-fission",
        "magis runtime, the step made separable with one fissioned region: fewest parts within budget x scheduled peak",
        MAGIS,
        *planned_steps(_fission),
        budgeted=True,
    )
)
register(
    _optimizer(
        "magis-optimize",
        "magis' M-Optimizer (MAGIS Alg. 3): lowest simulated latency within budget x the captured step's peak",
        "memory",
        budgeted=True,
    )
)
register(
    _optimizer(
        "magis-optimize-interpreted",
        "magis-optimize's plan run by the interpreter, instruction by instruction",
        "memory",
        runtime="interpreted",
        opt_in=True,
        budgeted=True,
    )
)
register(
    _optimizer(
        "magis-optimize-compiled",
        "magis-optimize's plan with its segments of aten ops compiled by Inductor (compile=True)",
        "memory",
        runtime="compiled",
        opt_in=True,
        budgeted=True,
    )
)
register(
    _optimizer(
        "magis-optimize-lat",
        "magis' M-Optimizer (MAGIS Alg. 3): lowest simulated peak within L x the captured step's latency",
        "latency",
        latency_limits=LATENCY_LIMITS,
    )
)
