"""A plan: the training step the M-Optimizer chose, ready to train with (what :func:`magis.optimize` returns).

An inference plan (``optimize(..., inference=True)``) runs the forward alone:
``plan(*batch)`` returns the model's output, as ``with torch.no_grad(): model(*batch)``.

``plan(*batch)`` (``plan(batch)`` for a mapping or one tensor: the batch as it was
given to :func:`magis.optimize`) runs one training step with the magis runtime
(:mod:`magis.backend.runtime`: generated code unless ``plan.runtime`` says otherwise),
on the model's parameters as they are at that call (an optimizer updates them in
place between calls): it returns the loss (or what the user's ``training_step``
returned: ``(loss, logits)``, ``{"loss": ..., ...}``, the other tensors detached),
accumulates each parameter's gradient into ``.grad`` as ``loss.backward()`` would, and
writes the new BatchNorm statistics into the model's buffers as an eager step does. Random ops draw from torch's
generator in eager's order, so a seeded plan reproduces a seeded eager step.
``plan(*batch, grad_scale=scaler)`` seeds the backward with the ``GradScaler``'s scale
(or ``grad_scale=s``, a number or tensor, with ``s``; :mod:`magis.frontend.grad_seed`),
leaving in ``.grad`` what ``scaler.scale(loss).backward()`` would, so
``scaler.step(optimizer)`` and ``scaler.update()`` work unchanged; the loss returned is unscaled.

A plan runs the step it was made for and refuses, before anything runs, a call that
differs: another batch structure, shape or dtype, or a batch tensor that requires grad
(:class:`~magis.frontend.step.BatchSpec`); a submodule in another train/eval mode, of
another class or settings, or with other hooks; a parameter frozen or unfrozen; another
autocast state (:class:`~magis.frontend.conditions.Conditions`).

The figures are simulated (MAGIS §5): ``peak_bytes`` and ``latency_s`` of the plan,
``baseline_peak_bytes`` and ``baseline_latency_s`` of the captured step in its
captured order, what the magis runtime does without optimization. On a CPU, where the
choice was confirmed by timing (:mod:`magis.search.timed_choice`; ``report().search["timed"]``),
both latencies are timed instead, in turns: the plan's beside the captured step's, an
inference plan's (called as its user calls it) beside the model's own forward.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree

from magis.backend.codegen import GeneratedStep, generate
from magis.backend.compiled import STEP_SCRATCH_SHARE, CompiledSegment, Trial, compiled_segments
from magis.backend.cuda_graph import CudaGraphStep
from magis.backend.program import Program, lower
from magis.backend.runtime import RUNTIMES, ModuleInputs, ModuleTensors, Runtime, StepRunner, run_program
from magis.backend.verify import Verification
from magis.cost.latency import CostModel, cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.cost.op_keys import NodeStrides, replay_strides
from magis.cost.op_timing import random_tensor, time_calls, time_in_turns
from magis.frontend.capture import forked_generators, same_generator_named
from magis.frontend.conditions import Conditions, ConditionsWatch, autocast_off, refuse_gradients_off
from magis.frontend.grad_seed import seeded
from magis.frontend.optimizer import (
    GradientNorm,
    OptimizerError,
    ParameterUpdate,
    group_layout,
    layout_difference,
    unplanned_reason,
)
from magis.frontend.step import BatchSpec, StepOutput, user_model
from magis.ir.graph import Graph
from magis.plan_file import read_plan_file, write_plan_file
from magis.search.m_optimizer import Objective, SearchResult

#: how a plan's step can run: the runtimes of :mod:`magis.backend.runtime` (``generated``, the
#: default, and ``interpreted``) and ``compiled`` (:mod:`magis.backend.compiled`, ``optimize(compile=True)``)
PlanRuntime = Literal["generated", "interpreted", "compiled"]
PLAN_RUNTIMES: tuple[PlanRuntime, ...] = (*RUNTIMES, "compiled")


@dataclass(frozen=True)
class PlanReport:
    """What :meth:`Plan.report` returns; :meth:`to_dict` is its JSON form.

    ``transformations`` lists the fissioned regions, the recomputed and swapped tensors,
    the batch norm weights the step divides by (each call checks them:
    :class:`~magis.backend.runtime.DivisorError`) and every step of the search's path;
    ``search`` its statistics. ``verified``: the
    captured step was checked against eager PyTorch before the search (``verification``
    says what was found, or why it was not checked: ``verify=False``, a model on fake
    or meta tensors).
    """

    device: str
    mode: str  # "memory" (the lowest latency within memory_limit_bytes) or "latency"
    memory_limit_bytes: int | None
    latency_limit_s: float | None
    baseline_peak_bytes: int
    baseline_latency_s: float
    peak_bytes: int
    latency_s: float
    peak_ratio: float
    latency_ratio: float
    transformations: dict[str, Any]
    search: dict[str, Any]
    verified: bool
    verification: str
    #: the optimizer's part of the step (:func:`optimizer_summary`); None without ``optimizer=``
    optimizer: dict[str, Any] | None = None
    #: how the step runs (:meth:`Plan.runtime_summary`)
    runtime: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class InfeasibleLimit(ValueError):
    """No plan found meets the limit; the message names the best figure found and the floor.

    ``best`` is the best plan the search found, which misses the limit (a near miss
    may still be worth running or saving), or ``None`` when nothing was searched.
    """

    def __init__(self, message: str, best: Plan | None = None) -> None:
        super().__init__(message)
        self.best = best


@dataclass(eq=False)
class Plan:
    """The optimized training step of one model at one input shape (module docstring)."""

    model: torch.nn.Module = field(repr=False)
    graph: Graph = field(repr=False)  # what runs
    order: tuple[str, ...] = field(repr=False)
    peak_bytes: int
    latency_s: float
    baseline_peak_bytes: int
    baseline_latency_s: float
    device: str
    objective: Objective
    search: SearchResult = field(repr=False)
    baseline: Graph = field(repr=False)  # the captured step, run in its node order
    cost_model: CostModel = field(repr=False)
    batch: BatchSpec = field(repr=False)  # the example batch's structure, shapes and dtypes
    conditions: Conditions = field(repr=False)  # the modules, trainability and autocast at capture
    grad_seed: torch.Tensor | None = field(repr=False)  # the backward's seed (magis.frontend.grad_seed)
    verification: Verification  # the captured step against eager, or why it was not checked
    planning_only: bool = False  # the model is on fake or meta tensors
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)  # the user's, stepped by each call
    max_grad_norm: float | None = None  # clipping before the update
    runtime: PlanRuntime = "generated"  # how the step runs: one of PLAN_RUNTIMES
    cuda_graphs: bool = True  # on CUDA, replay the step as a CUDA graph (magis.backend.cuda_graph)
    #: compiled, keep a segment compiled only where it runs faster than its ops (timed when first called)
    timed: bool = True
    output_spec: pytree.TreeSpec | None = field(default=None, repr=False)  # an inference plan's output structure
    output_nones: tuple[int, ...] = field(default=(), repr=False)  # where its leaves are None
    step_output: StepOutput = field(default_factory=StepOutput, repr=False)  # what the training step returns
    #: the user's loss_fn and training_step, whose global values each call checks (not saved)
    step_functions: tuple[Callable[..., Any] | None, ...] = field(default=(), repr=False)

    @cached_property
    def watch(self) -> ConditionsWatch:
        """What each call's check of :attr:`conditions` glances at
        (:class:`~magis.frontend.conditions.ConditionsWatch`)."""
        return ConditionsWatch()

    @cached_property
    def module_inputs(self) -> ModuleInputs:
        """The step's parameters and buffers as found in :attr:`model`, bound at each call."""
        return ModuleInputs(self.program.graph, self.model)

    @cached_property
    def program(self) -> Program:
        return lower(self.graph, self.order)

    @cached_property
    def generated(self) -> GeneratedStep:
        """The step as generated Python (:mod:`magis.backend.codegen`); ``generated.source`` is its text."""
        return generated_step(self.program)

    @cached_property
    def compiled(self) -> GeneratedStep:
        """The generated step with its maximal segments of aten ops compiled by Inductor
        (:mod:`magis.backend.compiled`); with :attr:`timed`, each compiled and timed against its
        ops here and now, kept where faster (else each compiles on its first call)."""
        device = torch.device("cuda" if self.on_cuda else "cpu")
        return generated_step(self.program, compile=True, timed_on=device if self.timed else None)

    def __call__(self, *batch: Any, grad_scale: float | torch.Tensor | torch.amp.GradScaler | None = None) -> Any:
        """One training step on ``batch``, given as to :func:`magis.optimize`: the loss (module
        docstring); an inference plan's forward: the model's output."""
        if self.planning_only:
            raise RuntimeError(
                "this plan was made for a model on fake or meta tensors: it needs real weights to run "
                "(optimize the model with its real parameters)"
            )
        given = self.batch.given(batch)
        inputs = self.batch.tensors(given)
        self.conditions.check(self.model, self.step_functions, self.watch)
        self._check_generators()
        if self.graph.signature.inference:
            return self._infer(inputs, grad_scale)
        refuse_gradients_off()
        self.batch.refuse_gradients(given)
        if self.optimizer is not None:
            _check_whole_step(self.model, self.optimizer, grad_scale)
        in_plan = self.optimizer if self.graph.signature.optimizer else None
        with seeded(self.grad_seed, grad_scale), autocast_off():
            result = run_program(
                self.program,
                self.model,
                inputs,
                optimizer=in_plan,
                runtime=self._runner(),
                module_inputs=self.module_inputs,
            )
        if in_plan is not None:
            in_plan._opt_called = True  # what optimizer.step() sets: an LR scheduler checks it was stepped
        with torch.no_grad():  # result.gradients is in the signature's order, as _gradient_params
            for param, gradient in zip(self._gradient_params.current(), result.gradients.values(), strict=True):
                if param.grad is None:
                    param.grad = gradient if _owns_storage(gradient, param) else gradient.clone()
                else:
                    param.grad.add_(gradient)
        if self.optimizer is not None and in_plan is None:  # not planned: stepped here, as eager does
            if self.max_grad_norm is not None:
                stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_([p for p in stepped if p.grad is not None], self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return self.step_output.rebuild(result.loss, result.outputs)

    @cached_property
    def _gradient_params(self) -> ModuleTensors:
        """The parameters the step returns gradients of, found in the model at each call without a
        walk of every module (the 95 of a tiny ResNet-50 took 0.25 ms a call to walk, on a CPU)."""
        return ModuleTensors(self.model, [(name, "_parameters") for name in self.graph.signature.gradients])

    def _check_generators(self) -> None:
        """A ``ValueError`` where a generator the graph draws from is no longer the model's: a
        module's generator replaced since ``optimize`` (``self.generator = torch.Generator()``),
        whose new stream eager draws from and the graph would not."""
        for generator in self.graph.generators:
            if same_generator_named(generator, self.model) is None:
                raise ValueError(
                    "the plan draws from a torch.Generator the model no longer holds (a module's generator "
                    "replaced since optimize; reseeding it in place is fine): set it back, or optimize again"
                )

    def _infer(self, inputs: list[Any], grad_scale: Any) -> Any:
        """An inference plan's step: the model's output, rebuilt from the graph's results."""
        if grad_scale is not None:
            raise ValueError("grad_scale scales a backward: an inference plan (inference=True) has none")
        with autocast_off():
            runner = self._runner()
            result = run_program(self.program, self.model, inputs, runtime=runner, module_inputs=self.module_inputs)
        leaves = list(result.outputs)
        for position in self.output_nones:  # in increasing order: each lands where it was
            leaves.insert(position, None)
        return pytree.tree_unflatten(leaves, self.output_spec)

    def _runner(self) -> Runtime | StepRunner:
        """What runs the bound step: the generated code or its compiled form (made once), replayed
        as a CUDA graph on CUDA unless ``cuda_graphs`` is off, or the interpreter."""
        if self.runtime not in PLAN_RUNTIMES:
            raise ValueError(f"runtime {self.runtime!r} is not one of {', '.join(PLAN_RUNTIMES)}")
        if self.runtime == "interpreted":
            return self.runtime
        step = self.compiled if self.runtime == "compiled" else self.generated
        if not (self.cuda_graphs and self.on_cuda):
            return step
        if self.runtime not in self._replayed:
            self._replayed[self.runtime] = CudaGraphStep(step, self.graph.signature.user_inputs, self._graph_limit())
        return self._replayed[self.runtime]

    def _graph_limit(self) -> int | None:
        """What a CUDA graph of the step may hold beside the resident tensors: the memory limit
        (+2%, the tolerance of a measured peak) less the resident bytes; None in latency mode."""
        if self.objective.memory_bytes is None:
            return None
        resident = simulate_memory(self.graph, self.order).persistent_bytes
        return int(1.02 * self.objective.memory_bytes) - resident

    @property
    def on_cuda(self) -> bool:
        """Whether the model's tensors are on a CUDA device (its first parameter or buffer says)."""
        first = next(itertools.chain(self.model.parameters(), self.model.buffers()), None)
        return first is not None and first.is_cuda

    @cached_property
    def _replayed(self) -> dict[PlanRuntime, CudaGraphStep]:
        """The step of each runtime replayed as a CUDA graph (made at its first call)."""
        return {}

    def save(self, path: str | Path) -> Path:
        """Write the plan to ``path`` (:mod:`magis.plan_file`; not the model's weights), atomically:
        :func:`load_plan` reads it back for a model with the same parameters, without searching."""
        return write_plan_file(path, {name: getattr(self, name) for name in _SAVED_FIELDS}, self.model)

    def report(self) -> PlanReport:
        """The figures, the transformations applied, the search's statistics and the verification."""
        best, stats = self.search.best, self.search.stats
        rewrites = [{"rule": s.rule, "description": s.description} for s in best.steps]
        return PlanReport(
            device=self.device,
            mode=self.objective.mode,
            memory_limit_bytes=self.objective.memory_bytes,
            latency_limit_s=self.objective.latency_s,
            baseline_peak_bytes=self.baseline_peak_bytes,
            baseline_latency_s=self.baseline_latency_s,
            peak_bytes=self.peak_bytes,
            latency_s=self.latency_s,
            peak_ratio=self.peak_bytes / self.baseline_peak_bytes,
            latency_ratio=self.latency_s / self.baseline_latency_s,
            transformations={
                "fission": best.regions(),
                "recomputed": [r["description"] for r in rewrites if r["rule"] == "remat"],
                "swapped": [r["description"] for r in rewrites if r["rule"] == "swap"],
                "divides_by": [self.graph.signature.parameters[w] for w, _ in self.graph.signature.divided_by],
                "steps": rewrites,
            },
            search={
                "seconds": stats.seconds,
                "states": stats.states,
                "expanded": stats.expanded,
                "duplicates": stats.duplicates,
                "invalid": stats.invalid,
                "first_feasible_s": stats.first_feasible_s,
                "stopped_by": stats.stopped_by,
                "states_per_rule": dict(stats.rules),
                "timed": {"plans": stats.timed_plans, "rounds": stats.timed_rounds, "choice": stats.timed_choice},
            },
            verified=self.verification.verified,
            verification=self.verification.note,
            optimizer=None if self.optimizer is None else optimizer_summary(self.graph, self.order, self.optimizer),
            runtime=self.runtime_summary(),
        )

    def runtime_summary(self) -> dict[str, Any]:
        """How the step runs: ``name`` (:data:`PLAN_RUNTIMES`) and, compiled, its ``segments``, the
        ``compiled_ops`` of its ``ops`` they hold, each segment that Inductor could not compile
        (``fallbacks``: its first op and why; it runs its ops as they are), and, timed, the
        ``whole_step``: its median seconds compiled and as generated code, the mean ``ratio`` of
        the two over paired rounds and its standard error (``ratio_error``), and whether it
        ``kept_compiled`` (else no segment is compiled, and ``why_not_kept`` says why)."""
        summary: dict[str, Any] = {"name": self.runtime}
        if self.runtime == "compiled":
            segments = self.compiled.segments
            summary["segments"] = len(segments)
            summary["compiled_ops"] = sum(s.ops for s in segments)
            summary["ops"] = len(self.program.instructions)
            summary["fallbacks"] = [
                {"first_op": s.first_op, "reason": s.fallback} for s in segments if s.fallback is not None
            ]
            whole = self.compiled.whole_trial
            if whole is not None:
                summary["whole_step"] = {
                    "compiled_s": whole.compiled_s,
                    "generated_s": whole.ops_s,
                    "ratio": whole.ratio,
                    "ratio_error": whole.ratio_error if math.isfinite(whole.ratio_error) else None,
                    "kept_compiled": whole.compiled_wins,
                    "why_not_kept": whole.why_not_compiled,
                }
        replayed = self._replayed.get(self.runtime)
        if replayed is not None:
            summary["cuda_graph"] = {
                "captured": replayed.fallback is None and replayed.captures > 0,
                "captures": replayed.captures,
                "pool_bytes": replayed.pool_bytes,
                "fallback": replayed.fallback,
            }
        elif self.on_cuda and self.runtime != "interpreted":
            why = "not run yet" if self.cuda_graphs else "off (cuda_graphs=False)"
            summary["cuda_graph"] = {"captured": False, "fallback": why}
        return summary

    def plot(self, path: str | Path) -> Path:
        """A PNG of the simulated memory over the step's time, the captured step beside the
        plan (MAGIS Figure 16's picture); returns the path written."""
        from matplotlib.figure import Figure  # optional (the "plot" extra); no pyplot: no global state

        path = Path(path)
        fig = Figure(figsize=(8, 4))
        ax = fig.subplots()
        baseline_order = tuple(n.name for n in self.baseline.nodes)
        for label, graph, order in (
            ("captured step", self.baseline, baseline_order),
            ("magis plan", self.graph, self.order),
        ):
            memory = simulate_memory(graph, order).timeline
            latency = estimate_latency(graph, order, self.cost_model)
            ends = [(start + seconds) * 1e3 for start, seconds in zip(latency.start_s, latency.per_node_s)]
            ax.step(ends, [m / 2**20 for m in memory], where="post", label=label)
        if self.objective.memory_bytes is not None:
            ax.axhline(self.objective.memory_bytes / 2**20, color="grey", linestyle="--", label="memory limit")
        ax.set_xlabel(f"simulated time (ms, {self.device})")
        ax.set_ylabel("live memory (MiB)")
        ax.set_title("memory timeline: captured step vs magis plan")
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        return path


#: rounds of a compiled segment's trial against its ops (:class:`~magis.backend.compiled.Trial`)
TRIAL_ROUNDS = 3
#: quiet paired rounds of a compiled step's trial against its generated code (:func:`_faster_whole`),
#: and the seconds after which no further round starts
WHOLE_TRIAL_ROUNDS = 5
WHOLE_TRIAL_SECONDS = 120.0


def generated_step(program: Program, compile: bool = False, timed_on: torch.device | None = None) -> GeneratedStep:
    """``program`` as generated code (:mod:`magis.backend.codegen`); with ``compile``, its maximal
    segments of aten ops compiled (:func:`magis.backend.compiled.compiled_segments`, which ends
    a segment where the simulated memory peaks), the step's and each region part's. With
    ``timed_on`` (the device the step runs on) each segment is compiled now and kept only
    where it runs faster than its ops (:meth:`~magis.backend.compiled.CompiledSegment.faster_compiled`,
    on random inputs of its shapes); the others run as generated code. The step so compiled is
    then timed whole against its generated code, and kept only where clearly faster (:func:`_faster_whole`)."""
    if not compile:
        return generate(program)
    # a segment's inputs as the step lays them out (the step's graph's are the whole trial's too)
    step_strides = replay_strides(program.graph, every_op=True) if timed_on is not None else {}

    def segments(part: Program, ends: frozenset[str]) -> tuple[CompiledSegment, ...]:
        live = simulate_memory(part.graph, part.order).timeline
        if timed_on is None:
            return compiled_segments(part, live, ends)
        strides = step_strides if part.graph is program.graph else replay_strides(part.graph, every_op=True)
        timer = partial(time_calls, device=timed_on, repeats=TRIAL_ROUNDS)

        def wins(segment: CompiledSegment) -> bool:
            return segment.faster_compiled(_random_inputs(part.graph, segment.inputs, strides, timed_on), timer)

        # tried segments may run through the peak; where one loses, the runs between its
        # near-peak instructions are tried instead (magis.backend.compiled's docstring)
        kept, away = [], compiled_segments(part, live, ends)
        for wide in compiled_segments(part, live, ends, near_peak=True):
            if wins(wide):
                kept.append(wide)
            else:
                inside = [s for s in away if wide.start <= s.start and s.stop <= wide.stop and s.ops < wide.ops]
                kept += [s for s in inside if wins(s)]
        return tuple(kept)

    if timed_on is None:
        return generate(program, segments=segments)
    # the trials draw random inputs and run the step's random ops: the caller's generators (the
    # devices' and any module's own the step draws from) are left as they were, so the step's
    # draws (dropout) at the call that made the trials are eager's
    cuda = [timed_on.index or 0] if timed_on.type == "cuda" else []
    with forked_generators(program.graph.generators, cuda):
        step = generate(program, segments=segments)
        return _faster_whole(step, generate(program), step_strides, timed_on) if step.segments else step


def _faster_whole(
    compiled: GeneratedStep, plain: GeneratedStep, strides: dict[str, NodeStrides], device: torch.device
) -> GeneratedStep:
    """``compiled`` if it runs faster whole than ``plain`` (the same program without compiled
    segments) and holds no more memory (but :data:`~magis.backend.compiled.STEP_SCRATCH_SHARE`
    of its peak, its kernels' scratch), else ``plain``; either carries the trial
    (:class:`~magis.backend.compiled.Trial`) as its ``whole_trial``; ``strides`` lays out the
    step's values as it lays them out (:func:`~magis.cost.op_keys.replay_strides`, every op).

    Segments that each won their trial can still slow the step they sit in (another segment's
    code evicts theirs from the caches, a layout hands the next op a slower path): BERT small's
    plan at 0.8 of eager's peak ran 1.054 of eager's step with its winning segments compiled and
    1.003 as generated code (issue #30's yardstick, 2026-11-29). The whole steps run on random
    inputs laid out as the step lays them out, in :data:`WHOLE_TRIAL_ROUNDS` paired rounds
    (:func:`~magis.cost.op_timing.time_in_turns`; the caller forks the generators they draw
    from); the compiled step is kept only where it is faster by more than the standard
    error of the rounds' ratios (:class:`~magis.backend.compiled.Trial`): else it saves less
    than the noise of a step, and generated code is the step whose time the plan predicts."""
    graph = compiled.program.graph
    env = dict(zip(graph.inputs, _random_inputs(graph, graph.inputs, strides, device)))

    def call(step: GeneratedStep) -> Callable[[list[Any]], Any]:
        return lambda args: step(dict(args[0]))  # a step frees what it reads from its own copy

    runs = [call(compiled), call(plain)]
    for run in runs:
        run([env])  # warm-up: a compiled segment's code loads on its first call in a step
    timed = time_in_turns([partial(run, [env]) for run in runs], device, WHOLE_TRIAL_ROUNDS, WHOLE_TRIAL_SECONDS)
    trial = Trial.metered(*runs, [env], *timed.seconds, *timed.ratio(0, 1), scratch_share=STEP_SCRATCH_SHARE)
    return replace(compiled if trial.compiled_wins else plain, whole_trial=trial)


def _random_inputs(
    graph: Graph, names: Sequence[str], strides: dict[str, NodeStrides], device: torch.device
) -> list[Any]:
    """Random tensors shaped and laid out as the values ``names`` of ``graph`` (a tuple for a
    tuple-valued op), as :func:`~magis.cost.op_timing.random_tensor` makes them; ``None`` for
    a value without a tensor (the optimizer's handle)."""
    values: list[Any] = []
    for name in names:
        node = graph[name]
        made = [
            None if meta is None else random_tensor(meta, stride, device)
            for meta, stride in zip(node.outputs, strides[name])
        ]
        values.append(tuple(made) if node.tuple_output else made[0] if made else None)
    return values


#: what a plan file holds: every field but the model, optimizer and step functions (the caller's) and
#: the cost model (made anew); its runtime too: a plan searched for ``compile=True`` was priced compiled
_SAVED_FIELDS = tuple(
    f.name for f in fields(Plan) if f.name not in ("model", "cost_model", "optimizer", "step_functions")
)


def load_plan(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Plan:
    """The plan :meth:`Plan.save` wrote to ``path``, run on ``model``, which must have the
    parameters and buffers it was made for (names, shapes, dtypes, which are trainable) under
    the same magis and torch: otherwise a ``ValueError`` names the first difference. A plan
    made with ``optimizer=`` needs an optimizer of the same kind and param groups. It runs as
    it was saved (``runtime``, ``cuda_graphs``, ``timed``)."""
    model = user_model(model)
    saved = read_plan_file(path, model)
    if set(saved) != set(_SAVED_FIELDS):
        raise ValueError(f"{path} holds a plan of another layout ({sorted(set(saved) ^ set(_SAVED_FIELDS))})")
    signature = saved["graph"].signature
    if signature.optimizer and optimizer is None:
        raise ValueError(f"{path} holds a plan that updates the parameters: load_plan(path, model, optimizer)")
    if signature.optimizer:
        difference = layout_difference(signature.optimizer_groups, group_layout(optimizer, model))
        if difference is not None:
            raise OptimizerError(f"{path}: {difference}")
    return Plan(model=model, cost_model=cost_model(saved["device"], estimate_unseen=True), optimizer=optimizer, **saved)


def optimizer_summary(graph: Graph, order: tuple[str, ...], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a plan does with the optimizer: whether its update is inside the step (else why not),
    how many parameters are updated before the backward ends (the last gradient is made), and
    what clipping holds: the gradient bytes live when the norm is taken."""
    reason = unplanned_reason(optimizer)
    summary: dict[str, Any] = {"name": type(optimizer).__name__, "in_plan": bool(graph.signature.optimizer)}
    if not graph.signature.optimizer:
        summary["note"] = reason or "stepped after the plan"
        return summary
    pos = {name: i for i, name in enumerate(order)}
    updates = [n for n in graph.nodes if isinstance(n.target, ParameterUpdate)]
    gradients = {g for n in updates for g in n.target.gradients(n)}
    backward_ends = max(pos[g] for g in gradients)
    summary["parameters"] = sum(len(n.target.params) for n in updates)
    summary["updated_before_backward_ends"] = sum(len(n.target.params) for n in updates if pos[n.name] < backward_ends)
    summary["note"] = "updated inside the step, each update placed by the search"
    norm = next((n for n in graph.nodes if isinstance(n.target, GradientNorm)), None)
    if norm is not None:
        held = {k for g in norm.inputs for k in graph.storages[g] if k}
        summary["clipping_holds_bytes"] = sum(graph.storage_bytes[k] for k in held)
        summary["note"] += "; clipping holds every gradient until the norm is known"
    return summary


def _check_whole_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_scale: Any) -> None:
    """A plan that steps the optimizer starts from no gradients of the parameters it steps (the
    others accumulate in ``.grad`` as in eager) and takes no loss scale."""
    if grad_scale is not None:
        raise ValueError(
            "grad_scale goes with a GradScaler, which steps the optimizer itself: optimize without "
            "optimizer= and call scaler.step(optimizer) after the plan"
        )
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held = next((name for name, p in model.named_parameters() if p.grad is not None and id(p) in stepped), None)
    if held is not None:
        raise ValueError(
            f"{held}.grad holds a gradient: a plan made with optimizer= computes the gradients and "
            "applies them itself; call optimizer.zero_grad() before it (or optimize without optimizer= "
            "to accumulate into .grad)"
        )


def _owns_storage(gradient: torch.Tensor, param: torch.Tensor) -> bool:
    """A gradient can become ``.grad`` as it is: a whole tensor laid out like its parameter."""
    return gradient._base is None and gradient.stride() == param.stride() and gradient.dtype == param.dtype
