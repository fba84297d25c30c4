"""The methods a benchmark compares, as a registry: magis and its peers, one code path for all.

Every method gives, for a workload at a preset (a :class:`Subject`), two things:

- ``real(subject, budget)``: a :class:`Runnable`, a
  :data:`~yardstick.protocol.Step` that runs one training step for real and
  returns the loss and the gradients (checked against eager PyTorch's by
  :mod:`yardstick.compare`), and the model whose weights it uses;
- ``simulate(subject, budget)``: the graph and operator order the method would run,
  for magis' simulator (peak memory) and cost model (latency).

Measured and simulated figures of one method therefore come from the same
configuration of it, and at tiny/small sizes they can be checked against each
other. Adding a method is one :func:`register` call. A ``budgeted`` method runs
once per memory budget (``compile@0.5``).

Peers (what a practitioner reaches for today):

- ``eager`` — plain PyTorch: forward, loss, ``backward()``. The reference.
- ``checkpoint-block`` — activation checkpointing of every block:
  transformers' ``gradient_checkpointing_enable()``, or ``torch.utils.checkpoint``
  around each block of other models (:mod:`yardstick.peers.checkpointing`).
- ``checkpoint-sqrt`` — √n segments of blocks, each checkpointed (Chen et al. 2016).
- ``compile`` — ``torch.compile``'s min-cut partitioner under
  ``torch._functorch.config.activation_memory_budget`` (:mod:`yardstick.peers.partitioned_capture`).
- ``accumulate`` — gradient accumulation over k micro-batches (``accumulate@4``), one
  variant per divisor k > 1 of the batch, and the combinations a practitioner
  stacks: ``accumulate@4+checkpoint-block``, ``accumulate@4+compile@0.5``
  (:mod:`yardstick.peers.accumulation`). Where that is not the full batch's gradient
  (batch norm, dropout, masked labels) the row's ``gradient_note`` says why.
- ``checkmate`` — Checkmate's optimal rematerialization (MILP, HiGHS) of the captured
  step within ``budget`` (:mod:`yardstick.planners.checkmate`); the row's ``details`` give the
  solver status, the gap left and the solve time.
- ``dtr`` — Dynamic Tensor Rematerialization's eviction policy simulated on the
  captured step within ``budget`` (:mod:`yardstick.planners.dtr`).
- ``rockmate`` — Rockmate 2.0's schedule (rotor + ILP, the ``rockmate`` package) within ``B``
  times eager's measured activations on the GPU (:mod:`yardstick.peers.rockmate`). Opt-in
  (``--methods rockmate``; not in the default set) and measured only: it needs
  ``rockmate`` and CUDA, and is skipped with the reason otherwise; it has no simulation.

The memory limit of ``checkmate@B`` and ``dtr@B`` is what no plan can free (parameters,
buffers, inputs, and the gradients and loss the step returns) plus ``B`` times the
rest of the captured step's simulated peak: as ``compile@B``, a budget for activations. Both plan with the
``h200`` cost model (:data:`DEFAULT_DEVICE`) and run for real as magis-runtime
graphs holding the recomputed copies.

magis:

- ``magis-captured`` — the captured graph run by the magis runtime in captured order.
- ``magis-scheduled`` — the same graph in the memory-optimal order of :func:`magis.schedule.schedule`.
- ``magis-fission`` — the step made separable along its samples with one F-Tree node
  enabled (:func:`magis.search.single_fission.best_single_fission`): the fewest parts
  whose simulated peak is within ``budget`` times the scheduled peak (``magis-fission@0.5``).
- ``magis-optimize`` — the M-Optimizer (MAGIS Alg. 3, :mod:`magis.search.m_optimizer`) in
  memory-limit mode at ``budget`` times the captured step's simulated peak (eager's
  step, as magis sees it): the lowest simulated latency within it, or the lowest peak
  when nothing fits (``magis-optimize@0.5``). Its latencies are priced by the local
  device's profiled cost model for tiny/small presets and by ``h200`` for paper.
- ``magis-optimize-lat`` — the same search in latency-limit mode: the lowest simulated
  peak within ``L`` times the captured step's simulated latency, one variant per
  limit of :data:`LATENCY_LIMITS` (``magis-optimize-lat@1.1``; MAGIS Fig. 9).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from magis.backend.eager import eager_step, split_batch
from magis.backend.runtime import StepResult, lower, run_program
from magis.cost.latency import CostModel, cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.frontend.capture import CaptureError, LossFn, capture, default_loss
from magis.ir.graph import Graph
from magis.models import Built, build_workload, get_workload
from magis.search.m_optimizer import DEFAULT_MAX_STATES, Mode, Objective, SearchResult, m_optimize
from magis.search.single_fission import SingleFission, choose_within, single_fission_options
from yardstick.peers.accumulation import accumulated_graph, gradient_differences
from yardstick.peers.checkpointed_capture import capture_checkpointed
from yardstick.peers.checkpointing import checkpoint_every_block, checkpoint_sqrt_segments
from yardstick.peers.partitioned_capture import (
    GraphRecorder,
    capture_partitioned,
    check_budget,
    compile_backend,
    memory_budget,
)
from yardstick.planners.checkmate import CheckmatePlan, checkmate_plan
from yardstick.planners.dtr import DTRPlan, dtr_plan
from yardstick.planners.recompute_problem import DoesNotFit, RematProblem, remat_problem, replay
from yardstick.protocol import Step

#: what ``simulate`` returns: a graph and the order of its nodes the method runs
Simulated = tuple[Graph, Sequence[str]]

PEER = "peer"
MAGIS = "magis"
#: the device profile simulated figures are priced on by default, and the baselines' planners plan for
DEFAULT_DEVICE = "h200"
#: HiGHS' time limit for one Checkmate program (per workload and budget)
CHECKMATE_TIME_LIMIT_S = 60.0
#: dynamo's recompile limit while a compiled peer runs: room for each budget at each micro-batch count
MAX_COMPILED_VARIANTS = 64

#: seconds and states the M-Optimizer searches per workload and budget in the yardstick (its defaults)
OPTIMIZE_SECONDS = 60.0
OPTIMIZE_STATES = DEFAULT_MAX_STATES


class MethodUnavailable(RuntimeError):
    """A registered method cannot run in this installation (the message says why)."""


@dataclass(eq=False)
class Subject:
    """One workload at one preset: what every method of a comparison works on.

    The model (real tensors, or fake ones for the paper preset), its captured graph
    and the memory-optimal order of it are made once and shared by the methods
    that need them; a method that changes the model works on its own
    :meth:`rebuild` (the same weights and inputs: builds are seeded).
    """

    workload: str
    preset: str
    batch: int | None = None
    seed: int = 0
    built: Built = field(init=False)
    _searches: dict[tuple[Mode, float], SearchResult] = field(init=False, default_factory=dict, repr=False)
    #: Rockmate's solved module and the build it runs, per budget (``rockmate@B``: solved once)
    _rockmate: dict[float, Any] = field(init=False, default_factory=dict, repr=False)
    #: set on the subjects of gradient accumulation (:meth:`accumulating`): k micro-batches of batch / k
    micro_batches: int = 1

    def __post_init__(self) -> None:
        self.built = self.rebuild()
        self._plans: dict[tuple[str, float], tuple[CheckmatePlan | DTRPlan, Graph, tuple[str, ...]]] = {}
        self._accumulating: dict[int, Subject] = {}

    @property
    def batch_size(self) -> int:
        """The batch the workload is built at (the preset's unless :attr:`batch` says otherwise)."""
        return self.batch or get_workload(self.workload).presets[self.preset]["batch"]

    def accumulating(self, micro_batches: int) -> Subject:
        """This subject run as ``micro_batches`` micro-batches (made once per count).

        It shares this subject's build and captured step (which its gradient notes read).
        """
        if micro_batches == self.micro_batches:
            return self
        if micro_batches not in self._accumulating:
            if micro_batches < 1 or self.batch_size % micro_batches:
                raise ValueError(f"{micro_batches} micro-batches do not divide the batch of {self.batch_size}")
            _ = self.graph  # capture before sharing
            child = copy.copy(self)
            child.micro_batches, child._plans, child._accumulating = micro_batches, {}, {}
            self._accumulating[micro_batches] = child
        return self._accumulating[micro_batches]

    def micro_step(self, built: Built) -> tuple[torch.nn.Module, tuple, LossFn]:
        """What one micro-batch of ``built`` runs: the model, the first micro-batch's inputs
        (views of the batch) and the loss scaled by ``1 / micro_batches``."""
        inputs = split_batch(built.example_inputs, self.micro_batches)[0]
        base = built.loss_fn

        def loss_fn(output: Any) -> torch.Tensor:
            loss = default_loss(output) if base is None else base(output)
            return loss / self.micro_batches

        return built.model, inputs, loss_fn

    def rebuild(self) -> Built:
        """A new build of the workload, identical to :attr:`built`."""
        return build_workload(self.workload, self.preset, self.batch, self.seed)

    @property
    def inputs(self) -> tuple:
        return tuple(self.built.example_inputs)

    @cached_property
    def graph(self) -> Graph:
        """The training step captured by :func:`magis.frontend.capture.capture`."""
        return capture(self.built.model, self.inputs, self.built.loss_fn)

    @cached_property
    def single_fissions(self) -> list[SingleFission]:
        """The scheduled step and each single fission of it (one enumeration for every budget)."""
        return single_fission_options(self.graph, self.scheduled_order)

    def single_fission(self, budget: float) -> SingleFission:
        """magis' best single fission within ``budget`` times the scheduled peak."""
        return choose_within(self.single_fissions, int(budget * self.single_fissions[0].peak_bytes))

    def optimized(self, limit: float, mode: Mode = "memory") -> SearchResult:
        """The M-Optimizer's search for the best state within ``limit`` times the captured
        step's simulated peak (``memory`` mode) or latency (``latency`` mode), run once per limit."""
        if (mode, limit) not in self._searches:
            peak, latency = self.captured_simulated
            if mode == "memory":
                objective = Objective(mode, memory_bytes=int(limit * peak))
            else:
                objective = Objective(mode, latency_s=limit * latency)
            result = m_optimize(
                self.graph, objective, self.search_model, OPTIMIZE_SECONDS, OPTIMIZE_STATES, progress=False
            )
            self._searches[mode, limit] = result
        return self._searches[mode, limit]

    @cached_property
    def search_model(self) -> CostModel:
        """What the M-Optimizer's searches price on: the h200 profile at paper size (fake
        tensors), this machine's CPU otherwise, estimating what the captured step does not
        hold as :func:`magis.optimize` does."""
        return cost_model("h200" if self.preset == "paper" else "cpu", estimate_unseen=True)

    @cached_property
    def captured_simulated(self) -> tuple[int, float]:
        """The captured step's simulated peak and latency (captured order, :attr:`search_model`):
        what the M-Optimizer's limits and simulated ratios are taken against."""
        captured = [n.name for n in self.graph.nodes]
        latency = estimate_latency(self.graph, captured, self.search_model).total_s
        return simulate_memory(self.graph, captured).peak, latency

    @cached_property
    def remat_problem(self) -> RematProblem:
        """The captured step as the rematerialization baselines see it, priced on :data:`DEFAULT_DEVICE`."""
        model = cost_model(DEFAULT_DEVICE)
        return remat_problem(self.graph, lambda name: model.node_seconds(self.graph, name))

    def memory_limit(self, budget: float) -> int:
        """What stays whatever the plan (parameters, inputs, the gradients and loss it returns) plus
        ``budget`` times the rest of the captured step's simulated peak: the activations' share."""
        problem = self.remat_problem
        floor = problem.static + sum(problem.kept)
        peak = simulate_memory(self.graph, [n.name for n in self.graph.nodes]).peak
        return int(floor + budget * (peak - floor))

    def remat_plan(self, planner: str, budget: float) -> tuple[CheckmatePlan | DTRPlan, Graph, tuple[str, ...]]:
        """``planner``'s (``checkmate`` or ``dtr``) plan within :meth:`memory_limit`, its graph and order
        (made once per budget). Raises :class:`MethodUnavailable` when no plan fits."""
        key = (planner, budget)
        if key not in self._plans:
            limit = self.memory_limit(budget)
            try:
                if planner == "checkmate":
                    plan: CheckmatePlan | DTRPlan = checkmate_plan(self.remat_problem, limit, CHECKMATE_TIME_LIMIT_S)
                else:
                    plan = dtr_plan(self.remat_problem, limit)
            except DoesNotFit as err:
                raise MethodUnavailable(f"{err} (budget {budget:g}: {limit} bytes)") from err
            self._plans[key] = (plan, *replay(self.remat_problem, plan.sequence))
        return self._plans[key]

    @cached_property
    def scheduled_order(self) -> tuple[str, ...]:
        """The captured graph's memory-optimal order (:func:`magis.schedule.schedule`)."""
        try:
            from magis.schedule import schedule
        except ImportError as err:
            raise MethodUnavailable(f"magis.schedule.schedule is not available ({err})") from err
        return tuple(schedule(self.graph).order)


@dataclass(frozen=True)
class Runnable:
    """A method's real step, and the build it runs: its weights, buffers and inputs are resident memory."""

    step: Step
    built: Built
    #: why its gradients are not the full batch's (accumulation), ``None`` when they must equal eager's
    gradient_note: str | None = None


@dataclass(frozen=True)
class Method:
    """A way to run a training step, for real and as a graph for the simulator."""

    name: str
    description: str
    kind: str  # PEER or MAGIS
    real: Callable[[Subject, float | None], Runnable]
    simulate: Callable[[Subject, float | None], Simulated]
    budgeted: bool = False  # runs once per activation memory budget
    #: runs once per latency limit (a ratio to the captured step's simulated latency), not per budget
    latency_limits: tuple[float, ...] = ()
    micro_batched: bool = False  # runs once per micro-batch count k > 1 dividing the batch (accumulation)
    #: facts of a variant's plan for its row (solver status, solve time...), ``None``: none
    details: Callable[[Subject, float | None], dict[str, Any]] | None = None
    #: left out of the default method set: runs only when named (an optional package's peer)
    opt_in: bool = False


@dataclass(frozen=True)
class Variant:
    """A method at one budget (``None`` for a method without one) and micro-batch count: one row of a comparison."""

    method: Method
    budget: float | None = None
    micro_batches: int | None = None  # micro-batched methods only

    @property
    def name(self) -> str:
        name = self.method.name
        if self.micro_batches is not None:
            name = name.replace(ACCUMULATE, f"{ACCUMULATE}@{self.micro_batches}", 1)
        return name if self.budget is None else f"{name}@{self.budget:g}"

    def subject(self, subject: Subject) -> Subject:
        """The subject this variant runs on: ``subject``, or its accumulating version."""
        return subject if self.micro_batches is None else subject.accumulating(self.micro_batches)

    def real(self, subject: Subject) -> Runnable:
        """The variant's step on ``subject``, run for real."""
        return self.method.real(self.subject(subject), self.budget)

    def simulate(self, subject: Subject) -> Simulated:
        """The variant's graph and order on ``subject``, for the simulator."""
        return self.method.simulate(self.subject(subject), self.budget)

    def details(self, subject: Subject) -> dict[str, Any] | None:
        """Facts of the variant's plan for its row, if the method reports any."""
        report = self.method.details
        return None if report is None else report(self.subject(subject), self.budget)


METHODS: dict[str, Method] = {}
REFERENCE = "eager"
DEFAULT_BUDGETS = (1.0, 0.5, 0.1)
#: the latency limits of latency-limited methods: MAGIS Fig. 9's 5% and 10% overheads
LATENCY_LIMITS = (1.05, 1.10)
#: the prefix of the micro-batched methods' names
ACCUMULATE = "accumulate"


def register(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (its name must be new)."""
    if method.name in METHODS:
        raise ValueError(f"a method called {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def variants(
    names: Sequence[str] | None = None, budgets: Sequence[float] = DEFAULT_BUDGETS, batch: int | None = None
) -> list[Variant]:
    """The variants to compare: ``names`` (default: every method but the opt-in ones), eager first, one per budget
    and, for micro-batched methods, one per divisor ``k > 1`` of ``batch`` (none without a batch).

    A name may fix its own limit, ``magis-optimize@0.8`` or ``magis-optimize-lat@1.05``:
    that variant alone, whatever ``budgets`` says. Raises ValueError naming the valid
    choices for an unknown method, a budget outside ``(0, 1]`` or a latency limit below 1.
    """
    names = [n for n, m in METHODS.items() if not m.opt_in] if names is None else list(names)
    fixed = [_fixed_limit(n) for n in names]
    if not budgets:
        raise ValueError("give at least one activation memory budget")
    budgets = [check_budget(b) for b in budgets]
    ordered = [(REFERENCE, None), *dict.fromkeys(f for f in fixed if f[0] != REFERENCE)]
    out: list[Variant] = []
    counts = [k for k in range(2, (batch or 0) + 1) if batch % k == 0]
    for name, limit in ordered:
        method = METHODS[name]
        for k in counts if method.micro_batched else [None]:
            if limit is not None:
                out.append(Variant(method, limit, k))
                continue
            limits = budgets if method.budgeted else method.latency_limits or [None]
            out += [Variant(method, limit, k) for limit in limits]
    return out


def _fixed_limit(name: str) -> tuple[str, float | None]:
    """``("magis-optimize", 0.8)`` for ``"magis-optimize@0.8"``, ``(name, None)`` for a plain
    method name; ValueError for anything else."""
    if name in METHODS:
        return name, None
    base, _, text = name.rpartition("@")
    method = METHODS.get(base)
    if method is None or not (method.budgeted or method.latency_limits):
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)} (a budgeted one may end in @B)")
    try:
        limit = float(text)
    except ValueError:
        raise ValueError(f"{name!r}: the limit after '@' must be a number, got {text!r}") from None
    if method.budgeted:
        return base, check_budget(limit)
    if not limit >= 1.0:
        raise ValueError(f"{name!r}: a latency limit is a ratio to the captured step's latency, at least 1")
    return base, limit


# --------------------------------------------------------------------- steps
def _eager(built: Built, subject: Subject, model: torch.nn.Module | None = None) -> Runnable:
    """An eager PyTorch step of ``built`` (the subject's build, or a changed rebuild) over the
    subject's micro-batches; ``model`` (default: ``built.model``) is what runs it."""
    model = built.model if model is None else model
    k = subject.micro_batches

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            try:
                return eager_step(model, built.example_inputs, built.loss_fn, k)
            except ValueError as err:  # e.g. batch norm of one value per channel
                if k == 1:
                    raise
                raise MethodUnavailable(f"a micro-batch of {subject.batch_size // k} does not run: {err}") from err

    note = gradient_differences(subject.graph, built.example_inputs, k) if k > 1 else None
    return Runnable(step, built, note)


def _runtime(subject: Subject, order: Sequence[str], graph: Graph | None = None) -> Runnable:
    """``graph`` (default: the captured one) run by the magis runtime in ``order``."""
    program = lower(subject.graph if graph is None else graph, order)

    def step(scope: AbstractContextManager) -> StepResult:
        with scope:
            return run_program(program, subject.built.model, subject.inputs)

    return Runnable(step, subject.built)


def _in_order(graph: Graph) -> Simulated:
    return graph, [n.name for n in graph.nodes]


def _micro(
    subject: Subject, built: Built, trace: Callable[[torch.nn.Module, tuple, LossFn], Graph], compiled: bool = False
) -> Simulated:
    """The graph of ``built``'s step as ``trace(model, inputs, loss_fn)`` captures it, in its order;
    for an accumulating subject, its micro-batches one after another (:func:`accumulated_graph`;
    a ``compiled`` backward hands its gradients to ``.grad`` all at once)."""
    if subject.micro_batches == 1:
        return _in_order(trace(built.model, tuple(built.example_inputs), built.loss_fn))
    try:
        micro = trace(*subject.micro_step(built))
    except (ValueError, CaptureError) as err:  # e.g. batch norm of one value per channel
        size = subject.batch_size // subject.micro_batches
        raise MethodUnavailable(f"a micro-batch of {size} does not run: {err}") from err
    return accumulated_graph(micro, [n.name for n in micro.nodes], subject.micro_batches, together=compiled)


# --------------------------------------------------------------------- peers
def _eager_real(subject: Subject, _budget: float | None) -> Runnable:
    return _eager(subject.built, subject)


def _eager_simulate(subject: Subject, _budget: float | None) -> Simulated:
    if subject.micro_batches == 1:
        return _in_order(subject.graph)  # captured once, shared with the magis methods
    return _micro(subject, subject.built, capture)


def _checkpointing(apply: Callable[[torch.nn.Module, tuple], Any]) -> tuple[Callable, Callable]:
    """``real`` and ``simulate`` of a checkpointing peer: ``apply(model, inputs)`` changes a rebuild."""

    def checkpointed(subject: Subject) -> Built:
        built = subject.rebuild()
        apply(built.model, tuple(built.example_inputs))
        return built

    def real(subject: Subject, _budget: float | None) -> Runnable:
        return _eager(checkpointed(subject), subject)

    def simulate(subject: Subject, _budget: float | None) -> Simulated:
        return _micro(subject, checkpointed(subject), capture_checkpointed)

    return real, simulate


def _compile_real(subject: Subject, budget: float | None) -> Runnable:
    assert budget is not None
    recorder = GraphRecorder()
    compiled = torch.compile(subject.built.model, backend=compile_backend(recorder))
    inner = _eager(subject.built, subject, compiled)

    def step(scope: AbstractContextManager) -> StepResult:
        recorder.scope, calls = scope, recorder.calls
        try:
            with memory_budget(budget), _room_for_every_variant():
                result = inner.step(contextlib.nullcontext())
        finally:
            recorder.scope = None
        if recorder.calls == calls:
            raise RuntimeError("torch.compile ran the step eagerly: no compiled graph was called")
        grads = {name.removeprefix("_orig_mod."): g for name, g in result.gradients.items()}
        return StepResult(result.loss, grads, {})

    return Runnable(step, subject.built, inner.gradient_note)


def _room_for_every_variant() -> AbstractContextManager:
    """Dynamo's recompile limit raised for one compiled step: every ``compile@B`` variant of a
    comparison (and of each micro-batch count) compiles the same ``forward`` code object with
    its own backend, and past the limit (8 by default) dynamo runs the step eagerly."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    return config.patch(**{name: MAX_COMPILED_VARIANTS})


def _compile_simulate(subject: Subject, budget: float | None) -> Simulated:
    assert budget is not None

    def trace(model: torch.nn.Module, inputs: tuple, loss_fn: LossFn) -> Graph:
        return capture_partitioned(model, inputs, loss_fn, budget)

    return _micro(subject, subject.built, trace, compiled=True)


def _accumulation_details(subject: Subject, _budget: float | None) -> dict[str, Any]:
    note = gradient_differences(subject.graph, subject.inputs, subject.micro_batches)
    return {"micro_batches": subject.micro_batches, "micro_batch": subject.batch_size // subject.micro_batches} | (
        {"gradient_note": note} if note else {}
    )


def _remat(planner: str) -> tuple[Callable, Callable, Callable]:
    """``real``, ``simulate`` and ``details`` of a rematerialization baseline (``checkmate``, ``dtr``)."""

    def real(subject: Subject, budget: float | None) -> Runnable:
        assert budget is not None
        _, graph, order = subject.remat_plan(planner, budget)
        return _runtime(subject, order, graph)

    def simulate(subject: Subject, budget: float | None) -> Simulated:
        assert budget is not None
        _, graph, order = subject.remat_plan(planner, budget)
        return graph, order

    def details(subject: Subject, budget: float | None) -> dict[str, Any]:
        assert budget is not None
        plan, graph, _ = subject.remat_plan(planner, budget)
        facts: dict[str, Any] = {
            "memory_limit_bytes": subject.memory_limit(budget),
            "recomputed_nodes": len(graph) - len(subject.graph),
        }
        if isinstance(plan, CheckmatePlan):
            coarse = "" if plan.stages == plan.units else f", grouped into {plan.stages} runs of consecutive units"
            facts |= {
                "solver": plan.status,
                "gap": plan.gap,
                "solve_s": round(plan.seconds, 2),
                "solved": f"{plan.units} units of {len(subject.graph)} nodes (views folded into producers){coarse}",
            }
        elif isinstance(plan, DTRPlan):
            facts |= {
                "evictions": plan.evictions,
                "recomputations": plan.recomputations,
                "random_ops": "never evicted (no mask is drawn twice)",
            }
        return facts

    return real, simulate, details


def _rockmate_step(subject: Subject, budget: float) -> Any:
    """Rockmate's module for ``subject`` at ``budget`` on the GPU (built and solved once per budget)."""
    from yardstick.peers import rockmate

    reason = rockmate.unavailable_reason()
    if reason is not None:
        raise MethodUnavailable(reason)
    if subject.micro_batches != 1:
        raise MethodUnavailable("rockmate is not combined with gradient accumulation")
    steps = subject._rockmate
    if budget not in steps:
        built = subject.rebuild()
        device = torch.device("cuda")
        model = built.model.to(device)
        inputs = rockmate.to_device(built.example_inputs, device)
        eager_peak, activations = rockmate.activation_bytes(model, inputs, built.loss_fn)
        try:
            step = rockmate.RockmateStep(model, inputs, built.loss_fn, int(budget * activations))
        except Exception as err:  # Rockmate's tracer or solvers fail on this model or budget
            raise MethodUnavailable(f"Rockmate failed: {type(err).__name__}: {err}") from err
        step.details |= {"eager_cuda_peak_bytes": eager_peak, "eager_cuda_activation_bytes": activations}
        steps[budget] = (step, Built(model, inputs, built.loss_fn))
    return steps[budget]


def _rockmate_real(subject: Subject, budget: float | None) -> Runnable:
    assert budget is not None
    rk_step, built = _rockmate_step(subject, budget)

    def step(scope: AbstractContextManager) -> StepResult:
        result = rk_step(scope)  # eager's reference runs on the CPU: compared there
        return StepResult(result.loss.cpu(), {n: g.cpu() for n, g in result.gradients.items()}, {})

    return Runnable(step, built)


def _rockmate_simulate(_subject: Subject, _budget: float | None) -> Simulated:
    raise MethodUnavailable("rockmate is measured only: its schedule is not a magis graph")


def _rockmate_details(subject: Subject, budget: float | None) -> dict[str, Any]:
    assert budget is not None
    return dict(_rockmate_step(subject, budget)[0].details)


# --------------------------------------------------------------------- magis
def _captured_real(subject: Subject, _budget: float | None) -> Runnable:
    return _runtime(subject, [n.name for n in subject.graph.nodes])


def _scheduled_real(subject: Subject, _budget: float | None) -> Runnable:
    return _runtime(subject, subject.scheduled_order)


def _scheduled_simulate(subject: Subject, _budget: float | None) -> Simulated:
    return subject.graph, subject.scheduled_order


def _fission_real(subject: Subject, budget: float | None) -> Runnable:
    assert budget is not None
    chosen = subject.single_fission(budget)
    return _runtime(subject, chosen.order, chosen.graph)


def _fission_simulate(subject: Subject, budget: float | None) -> Simulated:
    assert budget is not None
    chosen = subject.single_fission(budget)
    return chosen.graph, chosen.order


def _optimizer(mode: Mode) -> tuple[Callable[..., Runnable], Callable[..., Simulated], Callable[..., dict[str, Any]]]:
    """The M-Optimizer's real and simulated step in ``mode``, the variant's limit as its
    limit, and its row's details."""

    def real(subject: Subject, limit: float | None) -> Runnable:
        assert limit is not None
        best = subject.optimized(limit, mode).best
        return _runtime(subject, best.order, best.graph)

    def simulate(subject: Subject, limit: float | None) -> Simulated:
        assert limit is not None
        best = subject.optimized(limit, mode).best
        return best.graph, best.order

    def details(subject: Subject, limit: float | None) -> dict[str, Any]:
        """The search's statistics (MAGIS §7.4: how fast a first plan comes) and what the plan does."""
        assert limit is not None
        result = subject.optimized(limit, mode)
        stats = result.stats
        peak, latency = subject.captured_simulated
        return {
            # the plan as the search saw it: set beside a measured row, the simulator's fidelity
            "simulated_peak_ratio": result.best.peak_bytes / peak,
            "simulated_latency_ratio": result.best.latency_s / latency,
            "search_s": stats.seconds,
            "first_feasible_s": stats.first_feasible_s,
            "states": stats.states,
            "stopped_by": stats.stopped_by,
            "limit_met": stats.first_feasible_s is not None,
            "fission": result.best.regions(),
            "steps": [step.rule for step in result.best.steps],
        }

    return real, simulate, details


_CHECKPOINT_BLOCK = _checkpointing(lambda model, _inputs: checkpoint_every_block(model))
_REMAT = {planner: _remat(planner) for planner in ("checkmate", "dtr")}
_OPTIMIZE: dict[Mode, tuple] = {mode: _optimizer(mode) for mode in ("memory", "latency")}
register(Method("eager", "eager PyTorch: forward, loss, backward()", PEER, _eager_real, _eager_simulate))
register(
    Method(
        "checkpoint-block",
        "activation checkpointing of every block (transformers gradient_checkpointing_enable, torch.utils.checkpoint)",
        PEER,
        *_CHECKPOINT_BLOCK,
    )
)
register(
    Method(
        "checkpoint-sqrt",
        "checkpointing of sqrt(n) segments of blocks (Chen et al. 2016)",
        PEER,
        *_checkpointing(checkpoint_sqrt_segments),
    )
)
register(
    Method(
        "compile",
        "torch.compile's min-cut partitioner under activation_memory_budget",
        PEER,
        _compile_real,
        _compile_simulate,
        budgeted=True,
    )
)
register(
    Method(
        ACCUMULATE,
        "gradient accumulation: k micro-batches of batch/k, each loss x 1/k, gradients summed in .grad",
        PEER,
        _eager_real,
        _eager_simulate,
        micro_batched=True,
        details=_accumulation_details,
    )
)
register(
    Method(
        f"{ACCUMULATE}+checkpoint-block",
        "gradient accumulation over k micro-batches, every block checkpointed",
        PEER,
        *_CHECKPOINT_BLOCK,
        micro_batched=True,
        details=_accumulation_details,
    )
)
register(
    Method(
        f"{ACCUMULATE}+compile",
        "gradient accumulation over k micro-batches of torch.compile under activation_memory_budget",
        PEER,
        _compile_real,
        _compile_simulate,
        budgeted=True,
        micro_batched=True,
        details=_accumulation_details,
    )
)
register(
    Method(
        "checkmate",
        "Checkmate's optimal rematerialization (MILP solved by HiGHS) of the captured step within the budget",
        PEER,
        *_REMAT["checkmate"][:2],
        budgeted=True,
        details=_REMAT["checkmate"][2],
    )
)
register(
    Method(
        "dtr",
        "Dynamic Tensor Rematerialization's evictions (cost / (size x staleness)) simulated within the budget",
        PEER,
        *_REMAT["dtr"][:2],
        budgeted=True,
        details=_REMAT["dtr"][2],
    )
)
register(
    Method(
        "rockmate",
        "Rockmate 2.0 (rotor + ILP rematerialization) within budget x eager's activations; needs rockmate and CUDA",
        PEER,
        _rockmate_real,
        _rockmate_simulate,
        budgeted=True,
        details=_rockmate_details,
        opt_in=True,
    )
)
register(Method("magis-captured", "magis runtime, captured order", MAGIS, _captured_real, _eager_simulate))
register(Method("magis-scheduled", "magis runtime, memory-optimal order", MAGIS, _scheduled_real, _scheduled_simulate))
register(
    Method(
        "magis-fission",
        "magis runtime, the step made separable with one fissioned region: fewest parts within budget x scheduled peak",
        MAGIS,
        _fission_real,
        _fission_simulate,
        budgeted=True,
    )
)
register(
    Method(
        "magis-optimize",
        "magis' M-Optimizer (MAGIS Alg. 3): lowest simulated latency within budget x the captured step's peak",
        MAGIS,
        *_OPTIMIZE["memory"][:2],
        budgeted=True,
        details=_OPTIMIZE["memory"][2],
    )
)
register(
    Method(
        "magis-optimize-lat",
        "magis' M-Optimizer (MAGIS Alg. 3): lowest simulated peak within L x the captured step's latency",
        MAGIS,
        *_OPTIMIZE["latency"][:2],
        latency_limits=LATENCY_LIMITS,
        details=_OPTIMIZE["latency"][2],
    )
)
