"""The measurement protocol every benchmark of magis uses: peak memory and latency of training steps.

Peak: the project's :class:`~magis.backend.meter.LiveTensorMeter`, the live tensor
bytes after every aten op (MAGIS §2.1's M_i), with the resident tensors (parameters,
buffers, inputs) counted from the start, as ``torch.cuda.max_memory_allocated``
would. One metered step per method: on CPU the figure is deterministic.

Latency: the methods being compared run interleaved, in rounds that bracket every
method between two steps of the reference (eager PyTorch): R A R B R C R, the
order of A, B, C rotating from round to round, after warm-up rounds that are
thrown away. Every step starts from the same RNG seed, with the garbage collector
run before it and disabled during it, and with one fixed number of intra-op
threads. A machine shared with other work slows whole stretches of time, so each
ratio is taken between neighbours — a step's time over the mean of the two
reference steps around it — and summarised by the median over rounds with its
interquartile range: steps that ran within seconds of each other share the
noise, and it cancels.

The clock: with one intra-op thread (the benchmarks' default) a step's latency is
the CPU time the process spends on it (user + system, ``time.process_time``):
on a shared machine its wall time also counts the time it waited for a core,
which is other work's noise, not the method's cost. With several threads CPU time
adds the threads up, so wall time is used. Both are recorded.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from magis.backend.meter import LiveTensorMeter
from magis.backend.runtime import StepResult

#: One training step of a method, run for real. It wraps ``scope`` around the tensor
#: work it does (the whole step, or each compiled graph of it; it may enter it more
#: than once) and returns the loss and gradients.
Step = Callable[[AbstractContextManager], StepResult]

DEFAULT_REPEATS = 7
DEFAULT_WARMUP = 1
DEFAULT_SEED = 0


def set_threads(threads: int | None) -> int:
    """Fix torch's intra-op thread count for the whole run (``None``: keep torch's); returns it."""
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def measure_peak(step: Step, resident: Iterable[torch.Tensor], seed: int = DEFAULT_SEED) -> tuple[int, StepResult]:
    """Peak live tensor bytes of one ``step`` (resident tensors counted), and what it returned."""
    gc.collect()
    meter = LiveTensorMeter(resident)
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
class Timing:
    """The timed steps of one method, in the order they ran (warm-up excluded).

    ``samples`` are seconds on the protocol's clock (see the module docstring),
    ``wall`` the same steps on the wall clock. ``ratios`` has one entry per round:
    the step's time over the mean of the reference steps that ran just before and
    just after it (all ones for the reference itself).
    """

    samples: tuple[float, ...]
    wall: tuple[float, ...]
    clock: str  # "cpu" or "wall"
    ratios: tuple[float, ...]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.samples)

    @property
    def ratio(self) -> Spread:
        """This method's latency relative to the reference's: median and IQR over rounds."""
        return Spread.of(self.ratios)


def interleaved_timings(
    steps: Mapping[str, Step],
    reference: str,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    seed: int = DEFAULT_SEED,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Timing]:
    """Time every step against ``reference``: ``warmup`` rounds thrown away, then ``repeats`` rounds.

    A round runs the reference, then each other method followed by the reference
    again (R A R B R C R), the methods in an order that rotates from round to round;
    each method is timed between two reference steps, A B A B as closely as it gets.
    """
    if repeats <= 0 or warmup < 0:
        raise ValueError(f"repeats must be positive and warmup non-negative, got {repeats} and {warmup}")
    if reference not in steps:
        raise ValueError(f"the reference {reference!r} is not among the steps timed")
    others = [name for name in steps if name != reference]
    cpu = torch.get_num_threads() == 1
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}  # (clock, wall) per step
    ratios: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + repeats):
        shift = round_ % max(1, len(others))
        before = _timed(steps[reference], seed, cpu)
        timed = [before]
        for name in others[shift:] + others[:shift]:
            seconds = _timed(steps[name], seed, cpu)
            after = _timed(steps[reference], seed, cpu)
            timed.append(after)
            if round_ >= warmup:
                runs[name].append(seconds)
                ratios[name].append(seconds[0] / ((before[0] + after[0]) / 2))
            before = after
        if round_ >= warmup:
            runs[reference] += timed
            ratios[reference].append(1.0)
        if progress is not None:
            label = (
                f"warm-up round {round_ + 1}/{warmup}" if round_ < warmup else f"round {round_ - warmup + 1}/{repeats}"
            )
            progress(f"{label} done")
    return {
        name: Timing(
            tuple(c for c, _ in runs[name]),
            tuple(w for _, w in runs[name]),
            "cpu" if cpu else "wall",
            tuple(ratios[name]),
        )
        for name in steps
    }


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
