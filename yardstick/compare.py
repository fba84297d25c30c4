"""Compare methods on one workload: peak memory and latency, each as a ratio to eager PyTorch
(to eager's full step, ``eager+step``, in a comparison of full steps: :mod:`yardstick.methods.full_step`).

Measured (presets tiny and small): every method's step runs for real, through
:mod:`yardstick.protocol` — one metered step each, gradients checked against
eager's, then interleaved timing rounds. Simulated (preset paper, or on request):
every method's graph and order go through magis' memory simulator and latency
cost model (a named device profile, ``h200`` by default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from magis.backend.eager import GRADIENT_TOLERANCE, compare_gradients
from magis.backend.meter import resident_tensors
from magis.backend.runtime import StepResult
from magis.backend.verify import EAGER_NOISE_MARGIN
from magis.cost.latency import CostModel, cost_model, estimate_latency
from magis.cost.memory import simulate_memory
from magis.models import get_workload
from yardstick import protocol
from yardstick.methods import (
    DEFAULT_BUDGETS,
    DEFAULT_DEVICE,
    PEER,
    MethodUnavailable,
    Runnable,
    Subject,
    Variant,
    variants,
)
from yardstick.protocol import DEFAULT_ROUNDS, Rounds, Spread

#: latency overhead under which :func:`best_within` looks for the lowest peak
OVERHEAD = 0.10

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Row:
    """One method's figures, and its ratios to eager's figures of the same run."""

    method: str
    peak_bytes: int
    latency_s: float
    peak_ratio: float
    latency_ratio: float
    measured: bool
    kind: str
    latency_ratio_q1: float | None = None  # interquartile range of the per-round ratios (measured only)
    latency_ratio_q3: float | None = None
    latency_ratio_stderr: float | None = None  # standard error of latency_ratio (measured, 2+ rounds)
    rounds: int | None = None  # timed rounds the ratio is taken over (measured only)
    wall_s: float | None = None  # median wall-clock seconds (measured only; latency_s is on the protocol's clock)
    max_grad_error: float | None = None  # against eager (measured only)
    gradient_note: str | None = None  # why the gradients are not eager's (gradient accumulation), if they are not
    details: dict[str, Any] | None = None  # the method's plan: solver status, gap, solve seconds, micro-batches...


@dataclass
class Comparison:
    """A comparison of methods on one workload at one preset."""

    workload: str
    preset: str
    measured: bool
    settings: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it did not run

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.workload,
            "preset": self.preset,
            "measured": self.measured,
            **self.settings,
            "rows": [asdict(r) for r in self.rows],
            "skipped": self.skipped,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Comparison:
        """The comparison :meth:`to_json` wrote."""
        fixed = {"model", "preset", "measured", "rows", "skipped"}
        settings = {k: v for k, v in data.items() if k not in fixed}
        rows = [Row(**r) for r in data["rows"]]
        return Comparison(data["model"], data["preset"], data["measured"], settings, rows, dict(data["skipped"]))


def compare(
    workload: str,
    preset: str,
    methods: Sequence[str] | None = None,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    *,
    batch: int | None = None,
    simulate: bool | None = None,
    device: str | None = None,
    rounds: Rounds = DEFAULT_ROUNDS,
    threads: int | None = 1,
    seed: int = protocol.DEFAULT_SEED,
    progress: Progress | None = None,
) -> Comparison:
    """Run or simulate ``methods`` (default: all) on ``workload`` at ``preset``.

    ``simulate`` defaults to True for the paper preset (fake weights) and False
    otherwise; ``device`` names the cost model of simulated latencies (default
    ``h200``). Measured runs use ``threads`` intra-op threads (``None``: torch's
    default); with one, latency is CPU time (see :mod:`yardstick.protocol`),
    timed over ``rounds`` (see :class:`yardstick.protocol.Rounds`).
    ``budgets`` apply to budgeted methods. Raises ValueError for an unknown
    workload, method or device, or a budget outside ``(0, 1]``.
    """
    say = progress or (lambda _message: None)
    chosen = variants(methods, budgets, batch or get_workload(workload).presets.get(preset, {}).get("batch"))
    simulate = preset == "paper" if simulate is None else simulate
    if not simulate and preset == "paper":
        raise ValueError("the paper preset is built on fake tensors and can only be simulated")
    if device is not None and not simulate:
        raise ValueError("a device profile prices simulated latencies: simulate, or use the paper preset")
    model = cost_model(device or DEFAULT_DEVICE) if simulate else None
    say(f"building {workload} ({preset})")
    subject = Subject(workload, preset, batch, seed)
    torch._dynamo.reset()  # compiled variants of earlier comparisons must not use up dynamo's recompile limit
    settings: dict[str, Any]
    if model is not None:
        settings = {"device": device or DEFAULT_DEVICE}
        comparison = Comparison(workload, preset, False, settings)
        _simulate_all(comparison, subject, chosen, model, say)
    else:
        settings = {
            "threads": protocol.set_threads(threads),
            **asdict(rounds),
            "seed": seed,
            "freed_memory_kept": protocol.keep_freed_memory(),
        }
        comparison = Comparison(workload, preset, True, settings)
        _measure_all(comparison, subject, chosen, rounds, seed, say)
    return comparison


def _simulate_all(
    comparison: Comparison, subject: Subject, chosen: list[Variant], model: CostModel, say: Progress
) -> None:
    figures: dict[Variant, tuple[int, float]] = {}
    for variant in chosen:
        start = time.perf_counter()
        try:
            graph, order = variant.simulate(subject)
            details = variant.details(subject)
        except MethodUnavailable as err:
            _skip(comparison, variant, err, chosen[0], say)
            continue
        peak = simulate_memory(graph, order).peak
        latency = estimate_latency(graph, order, model).total_s
        figures[variant] = (peak, latency, details)
        say(
            f"{variant.name}: simulated peak {peak / 2**20:.1f} MiB, latency {latency * 1e3:.2f} ms "
            f"({len(graph)} nodes, {time.perf_counter() - start:.1f} s)"
        )
    eager_peak, eager_latency, _ = figures[chosen[0]]
    comparison.rows = [
        Row(
            v.name,
            peak,
            latency,
            peak / eager_peak,
            latency / eager_latency,
            False,
            v.method.kind,
            gradient_note=(details or {}).get("gradient_note"),
            details=details,
        )
        for v, (peak, latency, details) in figures.items()
    ]


def _measure_all(
    comparison: Comparison,
    subject: Subject,
    chosen: list[Variant],
    rounds: Rounds,
    seed: int,
    say: Progress,
) -> None:
    steps: dict[Variant, protocol.Step] = {}
    peaks: dict[Variant, int] = {}
    errors: dict[Variant, float] = {}
    notes: dict[Variant, str | None] = {}
    details: dict[Variant, dict[str, Any] | None] = {}
    reference = None
    # a compiled step's peak is its allocator's, kernels' scratch included: its ratio is to eager's
    # peak counted so too (measured once, when a compiled row first needs it)
    eager_allocated: int | None = None
    compiled: set[Variant] = set()
    first: tuple[protocol.Step, list[torch.Tensor]] | None = None
    for variant in chosen:
        start = time.perf_counter()
        try:
            runnable = variant.real(subject)
            details[variant] = variant.details(subject)
            resident = [*resident_tensors(runnable.built.model, runnable.built.example_inputs), *runnable.resident]
            first = first or (runnable.step, resident)
            peak, result = protocol.measure_peak(runnable.step, resident, seed, runnable.compiled)
            if runnable.compiled:
                if eager_allocated is None:
                    eager_allocated = protocol.measure_peak(*first, seed, compiled=True)[0]
                compiled.add(variant)
                counted = {"peak": "the allocator's (compiled code)", "eager_allocated_bytes": eager_allocated}
                details[variant] = {**(details[variant] or {}), **counted}
        except MethodUnavailable as err:
            _skip(comparison, variant, err, chosen[0], say)
            continue
        gradients = _gradients_and_loss(runnable, result)
        reference = gradients if reference is None else reference
        versus_eager, notes[variant] = compare_gradients(reference, gradients), runnable.gradient_note
        errors[variant] = versus_eager.max_error
        tolerance = GRADIENT_TOLERANCE.get(result.loss.dtype, 0.0)
        if versus_eager.same_names and versus_eager.max_error > tolerance and notes[variant] is None:
            notes[variant] = _float32_rounding(subject, chosen[0], reference, gradients, tolerance, seed)
        if not versus_eager.same_names or (versus_eager.max_error > tolerance and notes[variant] is None):
            raise RuntimeError(
                f"{variant.name} does not compute eager's gradients on {subject.workload}: {versus_eager.describe()}"
            )
        steps[variant], peaks[variant] = runnable.step, peak
        agreement = "match eager" if notes[variant] is None else f"differ from eager's ({notes[variant]})"
        say(
            f"{variant.name}: peak {peak / 2**20:.1f} MiB, gradients {agreement} "
            f"(max rel. error {errors[variant]:.1g}), first step {time.perf_counter() - start:.1f} s"
        )
    del reference
    name = chosen[0].name
    say(
        f"timing {len(steps)} methods against {name}: {rounds.warmup} warm-up + {rounds.repeats} rounds, "
        f"up to {rounds.max_repeats} for ratios within {rounds.precision:.1%} standard error"
    )
    timings = protocol.interleaved_timings({v.name: s for v, s in steps.items()}, name, rounds, seed, say)
    comparison.settings["clock"] = timings[name].clock
    for variant in steps:
        timed = timings[variant.name]
        ratio, spread = timed.ratio, timed.ratio_spread
        comparison.rows.append(
            Row(
                variant.name,
                peaks[variant],
                timed.spread.median,
                peaks[variant] / (eager_allocated if variant in compiled else peaks[chosen[0]]),
                ratio.value,
                True,
                variant.method.kind,
                spread.q1,
                spread.q3,
                ratio.stderr if math.isfinite(ratio.stderr) else None,  # one round: unknown (JSON has no inf)
                len(timed.ratios),
                Spread.of(timed.wall).median,
                errors[variant],
                notes[variant],
                details[variant],
            )
        )


def _gradients_and_loss(runnable: Runnable, result: StepResult) -> dict[str, torch.Tensor]:
    """What a method's step is checked on: the gradients it uses (its own, or what it says it
    used) and its loss under ``"<loss>"``."""
    used = result.gradients if runnable.used_gradients is None else runnable.used_gradients()
    return {**used, "<loss>": result.loss}


def _float32_rounding(
    subject: Subject,
    reference: Variant,
    eager: dict[str, torch.Tensor],
    gradients: dict[str, torch.Tensor],
    tolerance: float,
    seed: int,
) -> str | None:
    """Why gradients that differ from eager's float32 ones are right all the same, or None.

    Where a gradient's terms cancel (a convolution before batch norm over few elements, at
    random weights) float32 rounding alone moves it by tens of percent, eager's own included,
    and other kernels (Inductor's) round otherwise. Both are then set against the reference
    method run in float64 on the same weights and batch: the gradients pass if each is within
    :data:`~magis.backend.verify.EAGER_NOISE_MARGIN` times eager's own float32 error (or the
    tolerance) of the float64 ones, as the capture's verification does on CUDA."""
    if eager["<loss>"].dtype == torch.float64:
        return None

    def make() -> dict[str, torch.Tensor]:
        exact = replace(subject, dtype=torch.float64)
        runnable = reference.real(exact)
        _, result = protocol.measure_peak(runnable.step, [], seed)
        return _gradients_and_loss(runnable, result)

    exact = subject.once("float64_reference", make)
    eager_error = compare_gradients(exact, eager).errors
    error = compare_gradients(exact, gradients).errors
    if any(e > max(tolerance, EAGER_NOISE_MARGIN * eager_error.get(name, 0.0)) for name, e in error.items()):
        return None
    worst = max(error, key=error.__getitem__)
    return (
        f"float32 rounding: against the step in float64 each gradient is within {EAGER_NOISE_MARGIN:g}x eager's own "
        f"float32 error (largest {error[worst]:.2g} at {worst}, eager's there {eager_error.get(worst, 0.0):.2g})"
    )


def _skip(comparison: Comparison, variant: Variant, err: Exception, reference: Variant, say: Progress) -> None:
    if variant is reference:
        raise err
    comparison.skipped[variant.name] = str(err)
    say(f"{variant.name}: skipped: {err}")


def pareto_front(rows: Sequence[Row]) -> list[Row]:
    """The rows no other row beats on both peak ratio and latency ratio, by increasing peak."""
    front: list[Row] = []
    for row in sorted(rows, key=lambda r: (r.peak_ratio, r.latency_ratio)):
        if not front or row.latency_ratio < front[-1].latency_ratio:
            front.append(row)
    return front


def best_within(rows: Sequence[Row], overhead: float = OVERHEAD, kind: str | None = PEER) -> Row | None:
    """The row of ``kind`` (``None``: any) with the lowest peak at most ``overhead`` slower than eager."""
    allowed = [r for r in rows if (kind is None or r.kind == kind) and r.latency_ratio <= 1.0 + overhead]
    return min(allowed, key=lambda r: (r.peak_ratio, r.latency_ratio), default=None)
