"""The measurement protocol every benchmark of magis uses: peak memory and latency of training steps.

Peak: the project's :class:`~magis.backend.meter.LiveTensorMeter`, the live tensor
bytes after every aten op (MAGIS §2.1's M_i), with the resident tensors (parameters,
buffers, inputs) counted from the start, as ``torch.cuda.max_memory_allocated``
would. One metered step per method: on CPU the figure is deterministic. A step that
runs code Inductor compiled allocates below the dispatcher, where that meter sees
nothing: its allocator's peak is read instead (on CPU
:class:`~magis.backend.meter.CpuAllocatorMeter`, which also counts what kernels
allocate for themselves: a convolution's scratch is large), and its ratio is to
eager's peak counted the same way.

Latency: the methods being compared run interleaved, in rounds that bracket every
method between two steps of the reference (eager PyTorch): R A R B R C R, the
order of A, B, C rotating from round to round, after warm-up rounds that are
thrown away. Every step starts from the same RNG seed, with the garbage collector
run before it and disabled during it, and with one fixed number of intra-op
threads. A machine shared with other work slows whole stretches of time, so each
ratio is taken between neighbours — a step's time over the mean of the two
reference steps around it: steps that ran within seconds of each other share
the noise, and it cancels (on this project's 2-core machine the per-round ratios
scatter by 2-4%, against 5-7% when a step is compared with its round's average).
The ratios of the rounds are summarised by their trimmed mean and its standard
error (:class:`Estimate`). How many rounds a method needs for a given precision
depends on the machine, so the protocol keeps timing the methods whose standard
error is still above a target (1% by default) after the minimum number of rounds.

The allocator: PyTorch's CUDA caching allocator keeps the blocks it frees for the
next allocation; on CPU, glibc's malloc hands large blocks back to the kernel
(``munmap``, heap trimming) and maps fresh ones on the next step, paying a page
fault per 4 KiB touched. How many depends on a threshold glibc moves with the
history of the process (measured on bert-base small: 170k-270k faults, 0.5-0.8 s
of system time in a 7 s step, varying from step to step and run to run). So the
protocol first tells glibc to keep what is freed (:func:`keep_freed_memory`), as
the GPU allocator does: after the first step a step faults no page at all.

The clock: with one intra-op thread (the benchmarks' default) a step's latency is
the CPU time the process spends on it (user + system, ``time.process_time``):
on a shared machine its wall time also counts the time it waited for a core,
which is other work's noise, not the method's cost. With several threads CPU time
adds the threads up, so wall time is used. Both are recorded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from magis.backend.meter import LiveTensorMeter, allocator_meter
from magis.backend.runtime import StepResult

#: One training step of a method, run for real. It wraps ``scope`` around the tensor
#: work it does (the whole step, or each compiled graph of it; it may enter it more
#: than once) and returns the loss and gradients.
Step = Callable[[AbstractContextManager], StepResult]

DEFAULT_REPEATS = 7
DEFAULT_MAX_REPEATS = 21
DEFAULT_PRECISION = 0.01
#: the fraction of per-round ratios dropped at each end by :meth:`Estimate.trimmed_mean`
TRIM = 0.2
DEFAULT_WARMUP = 1
DEFAULT_SEED = 0


def set_threads(threads: int | None) -> int:
    """Fix torch's intra-op thread count for the whole run (``None``: keep torch's); returns it."""
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1


def keep_freed_memory() -> bool:
    """Make the C allocator keep freed memory for reuse, as PyTorch's CUDA caching allocator does.

    Turns off glibc's ``mmap`` of large blocks and the trimming of its heap, for the
    rest of the process: freed memory then stays mapped, and a timed step pays no
    page faults (see the module docstring). Returns False, changing nothing, where
    the C library has no ``mallopt`` (not glibc).
    """
    library = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(library), "mallopt", None) if library else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))


def measure_peak(
    step: Step, resident: Iterable[torch.Tensor], seed: int = DEFAULT_SEED, compiled: bool = False
) -> tuple[int, StepResult]:
    """Peak live tensor bytes of one ``step`` (resident tensors counted), and what it returned.
    A step that runs ``compiled`` code is measured by its allocator instead
    (:class:`~magis.backend.meter.CpuAllocatorMeter`, :class:`~magis.backend.meter.CudaPeakMeter`),
    which also counts Inductor's buffers."""
    gc.collect()
    resident = list(resident)
    device = next((t.device for t in resident if t.is_cuda), None)
    meter = allocator_meter(device, resident) if compiled else LiveTensorMeter(resident)
    torch.manual_seed(seed)
    result = step(meter)
    return meter.peak_bytes, result


@dataclass(frozen=True)
class Spread:
    """A median with its interquartile range."""

    median: float
    q1: float
    q3: float

    @staticmethod
    def of(values: Iterable[float]) -> Spread:
        data = sorted(values)
        if len(data) == 1:
            return Spread(data[0], data[0], data[0])
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
        return Spread(statistics.median(data), q1, q3)


@dataclass(frozen=True)
class Estimate:
    """A trimmed mean and its standard error.

    The mean of the values left once the lowest and the highest ``trim`` fraction
    are dropped: a step slowed by a burst of other work cannot drag it, yet it
    uses more of the data than a median. The standard error is Yuen's (1974),
    from the winsorized variance: ``sqrt((n - 1) s_w^2 / (h (h - 1)))`` for ``h``
    values kept of ``n`` (Wilcox, *Introduction to Robust Estimation*, §4.3). It is
    infinite when fewer than two values are kept: one value says nothing of the spread.
    """

    value: float
    stderr: float

    @staticmethod
    def trimmed_mean(values: Iterable[float], trim: float = TRIM) -> Estimate:
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        data = sorted(values)
        if not data:
            raise ValueError("a trimmed mean of no values")
        n = len(data)
        cut = int(trim * n)
        kept = data[cut : n - cut]
        if len(kept) < 2:
            return Estimate(statistics.fmean(kept), math.inf)
        winsorized = [data[cut]] * cut + kept + [data[n - cut - 1]] * cut
        h = len(kept)
        variance = (n - 1) * statistics.variance(winsorized) / (h * (h - 1))
        return Estimate(statistics.fmean(kept), math.sqrt(variance))

    @property
    def relative_stderr(self) -> float:
        return self.stderr / abs(self.value) if self.value else math.inf


@dataclass(frozen=True)
class Timing:
    """The timed steps of one method, in the order they ran (warm-up excluded).

    ``samples`` are seconds on the protocol's clock (see the module docstring),
    ``wall`` the same steps on the wall clock. ``ratios`` has one entry per round
    the method was timed in: the step's time over the mean of the reference steps
    that ran just before and just after it (all ones for the reference itself).
    """

    samples: tuple[float, ...]
    wall: tuple[float, ...]
    clock: str  # "cpu" or "wall"
    ratios: tuple[float, ...]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.samples)

    @property
    def ratio(self) -> Estimate:
        """This method's latency relative to the reference's: trimmed mean over rounds, with its standard error."""
        return Estimate.trimmed_mean(self.ratios)

    @property
    def ratio_spread(self) -> Spread:
        """The median and interquartile range of the per-round ratios."""
        return Spread.of(self.ratios)


@dataclass(frozen=True)
class Rounds:
    """How many rounds :func:`interleaved_timings` runs.

    ``warmup`` rounds thrown away, then at least ``repeats`` timed rounds, then
    more (up to ``max_repeats``; ``None``: :data:`DEFAULT_MAX_REPEATS`, or
    ``repeats`` if larger) for the methods whose latency ratio's relative standard
    error is still above ``precision``.
    """

    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    max_repeats: int | None = None
    precision: float = DEFAULT_PRECISION

    def __post_init__(self) -> None:
        if self.max_repeats is None:  # frozen: the default is resolved once, here
            object.__setattr__(self, "max_repeats", max(self.repeats, DEFAULT_MAX_REPEATS))
        if self.repeats <= 0 or self.warmup < 0 or self.max_repeats < self.repeats:
            raise ValueError(
                "repeats must be positive, warmup non-negative and max_repeats at least repeats, "
                f"got {self.repeats}, {self.warmup} and {self.max_repeats}"
            )
        if self.precision <= 0:
            raise ValueError(f"precision must be positive, got {self.precision}")


#: the protocol's rounds unless told otherwise
DEFAULT_ROUNDS = Rounds()


def interleaved_timings(
    steps: Mapping[str, Step],
    reference: str,
    rounds: Rounds = DEFAULT_ROUNDS,
    seed: int = DEFAULT_SEED,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Timing]:
    """Time every step against ``reference`` over the ``rounds`` asked for.

    A round runs the reference, then each other method followed by the reference
    again (R A R B R C R), the methods in an order that rotates from round to round;
    each method is timed between two reference steps, A B A B as closely as it gets.
    After ``rounds.repeats`` timed rounds, further rounds time only the methods
    whose ratio's relative standard error is still above ``rounds.precision``,
    until none is or ``rounds.max_repeats`` rounds have run: a noisy machine gets
    the rounds it needs to give ratios that repeat, a quiet one stops early.
    """
    if reference not in steps:
        raise ValueError(f"the reference {reference!r} is not among the steps timed")
    others = [name for name in steps if name != reference]
    cpu = torch.get_num_threads() == 1
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}  # (clock, wall) per step
    ratios: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in itertools.count():
        timed = round_ - rounds.warmup  # rounds timed before this one
        if timed >= rounds.max_repeats:
            break
        pending = others
        if timed >= rounds.repeats:
            pending = [n for n in others if Estimate.trimmed_mean(ratios[n]).relative_stderr > rounds.precision]
            if not pending:
                break
        shift = round_ % max(1, len(pending))
        before = _timed(steps[reference], seed, cpu)
        references = [before]
        for name in pending[shift:] + pending[:shift]:
            seconds = _timed(steps[name], seed, cpu)
            after = _timed(steps[reference], seed, cpu)
            references.append(after)
            if timed >= 0:
                runs[name].append(seconds)
                ratios[name].append(seconds[0] / ((before[0] + after[0]) / 2))
            before = after
        if timed >= 0:
            runs[reference] += references
            ratios[reference].append(1.0)
        if progress is not None:
            progress(_round_label(timed, rounds, len(pending), len(others)))
    return {
        name: Timing(
            tuple(c for c, _ in runs[name]),
            tuple(w for _, w in runs[name]),
            "cpu" if cpu else "wall",
            tuple(ratios[name]),
        )
        for name in steps
    }


def _round_label(timed: int, rounds: Rounds, pending: int, others: int) -> str:
    if timed < 0:
        return f"warm-up round {timed + rounds.warmup + 1}/{rounds.warmup} done"
    if timed < rounds.repeats:
        return f"round {timed + 1}/{rounds.repeats} done"
    return (
        f"extra round {timed + 1}/{rounds.max_repeats} done: "
        f"{pending}/{others} methods were above {rounds.precision:.1%} standard error"
    )


def _timed(step: Step, seed: int, cpu: bool) -> tuple[float, float]:
    """Seconds of one step on the protocol's clock (CPU time if ``cpu``, else wall time), and wall seconds."""
    gc.collect()
    torch.manual_seed(seed)
    gc.disable()
    try:
        wall, used = time.perf_counter(), time.process_time()
        step(nullcontext())
        wall, used = time.perf_counter() - wall, time.process_time() - used
        return (used if cpu else wall), wall
    finally:
        gc.enable()
