"""Timing operators on this machine (MAGIS §5: the simulator's per-op profile).

On a CPU an operator is timed *in its step* (:func:`measure_in_step`): the runtime
runs the whole graph on random inputs of the recorded shapes and times each
instruction where it stands, with the caches full of its neighbours' data and
paying for the values it frees. Timed alone, the same operator runs 10-20% faster
(convolutions, their backward, batch norm) and a ``getitem`` three times faster, so
a sum of isolated times underestimates a CPU step by 15-30%. On CUDA, and for any
operator a step cannot run, each operator is timed alone (:func:`measure_nodes`), in
turns with its neighbours. :class:`magis.cost.latency.ProfiledCostModel` keeps the
times (:mod:`magis.cost.timing_cache`).
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from magis.backend.codegen import generate
from magis.backend.interpreter import execute
from magis.backend.kernels import runtime_kernel
from magis.backend.program import lower
from magis.backend.runtime import bind_arguments
from magis.cost.op_keys import NodeStrides, Strides, contiguous_strides
from magis.ir.graph import Graph, Node, Ref, TensorMeta, is_view, map_refs

#: on CUDA, each timing sample is a burst of calls lasting about this long.
CUDA_SAMPLE_S = 1e-3
#: operators are timed in turns, in windows of at most this many operators whose
#: inputs take at most this many bytes.
WINDOW_OPS = 32
WINDOW_BYTES = 512 * 2**20
#: a step timed in place runs at least this long (and at least the runs asked for), so that
#: a neighbour slowing the core for a few milliseconds spoils only some of its runs
IN_STEP_MIN_SECONDS = 0.25
#: an instruction timed in its step that takes more than this many times its median
#: was interrupted (another process took the core): the sample is dropped.
OUTLIER_FACTOR = 3.0
#: a run of a step in which this process's main thread ran for less of the wall time shared
#: the cores with another process: on a CPU whose cores are all busy, torch's intra-op
#: threads wait on each other's turns (a 4.7 ms forward took 540 ms beside two busy loops on
#: two cores). Such runs are not counted while others are found.
QUIET_SHARE = 0.9
#: a step timed in place runs at most this many times its runs asked for, looking for quiet runs
IN_STEP_MAX_FACTOR = 3

log = logging.getLogger(__name__)


def random_tensor(meta: TensorMeta, strides: Strides | None, device: torch.device) -> torch.Tensor:
    """A tensor of ``meta``'s shape and dtype laid out with ``strides``.

    Floating point values are uniform in [0, 1) (no NaN from log/sqrt/rsqrt), integer
    tensors are zeros so they are valid indices, bool tensors are random.
    """
    strides = strides if strides is not None else contiguous_strides(meta.shape)
    span = 1 + sum((s - 1) * st for s, st in zip(meta.shape, strides)) if all(meta.shape) else 0
    if meta.dtype.is_floating_point:
        base = torch.rand(span, device=device).to(meta.dtype)
    elif meta.dtype == torch.bool:
        base = torch.randint(0, 2, (span,), device=device, dtype=torch.bool)
    else:
        base = torch.zeros(span, dtype=meta.dtype, device=device)
    return base.as_strided(meta.shape, strides)


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def time_calls(fns: Sequence[Callable[[], Any]], device: torch.device, repeats: int) -> list[float]:
    """Fastest seconds per call of each of ``fns`` (already warmed up), over ``repeats`` rounds.

    Each round times every function once, in turn, so between two calls of one
    operator all the others run: as in a training step, an operator finds the caches
    full of other operators' code and data. (Timed back to back, small CPU operators
    run several times faster than they do inside a step.) On CPU a sample is one
    call and the fastest sample is kept: another process can only slow a call down
    (with two threads on a shared machine, by tens of milliseconds), so the minimum
    is the figure that repeats, and a noisy moment does not poison the cache. On CUDA a
    sample is a burst of back-to-back calls lasting about a millisecond between two
    synchronisations, divided by its length: the throughput of a busy stream, where
    launch overhead and kernel time overlap as they do in a real step.
    """
    sync = synchronizer(device)
    bursts = [1] * len(fns)
    if device.type == "cuda":
        for i, fn in enumerate(fns):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            bursts[i] = max(1, min(1000, int(CUDA_SAMPLE_S / max(time.perf_counter() - start, 1e-9))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, calls, times in zip(fns, bursts, samples):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times.append((time.perf_counter() - start) / calls)
    return [min(times) for times in samples]


def time_call(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Fastest seconds per call of ``fn`` alone, after a warm-up call (see :func:`time_calls`)."""
    fn()
    return time_calls([fn], device, repeats)[0]


def prepared_call(graph: Graph, name: str, strides: Mapping[str, NodeStrides], device: torch.device) -> Callable:
    """Node ``name`` on random inputs of its recorded shapes on ``device``, called once (warm-up).

    The call resolves its :class:`Ref` arguments as the runtime's interpreter does
    (:func:`magis.ir.graph.map_refs` over the arguments), so the time includes that
    per-instruction cost, whose price depends on the operator's arguments.
    """
    node = graph[name]
    inputs: dict[str, Any] = {}
    on_host = host_arguments(node)
    for ref in node.inputs:
        source = graph[ref]
        place = torch.device("cpu") if ref in on_host else device
        elements = [
            None if meta is None else random_tensor(meta, stride, place)
            for meta, stride in zip(source.outputs, strides[ref])
        ]
        inputs[ref] = tuple(elements) if source.tuple_output else elements[0]
    args, kwargs = bind_arguments(node, Ref, device)  # constants bound now, references at each call
    kernel = runtime_kernel(node.target)  # what the runtime runs (eager's kernel where faster)

    def value(ref: Ref) -> Any:
        return inputs[ref.name]

    def call() -> Any:
        return kernel(*map_refs(args, value), **map_refs(kwargs, value))

    call()
    synchronizer(device)()
    return call


def host_arguments(node: Node) -> set[str]:
    """The inputs of ``node`` that live on the host whatever the device: the random seed and
    offset an attention kernel's backward reads (eager makes them CPU scalars outside a CUDA
    graph capture; on the device, the kernel reads a device pointer as a host one and crashes)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set()
    return {
        value.name
        for argument, value in zip(schema.arguments, node.args)
        if argument.name.startswith("philox_") and isinstance(value, Ref)
    }


def _windows(graph: Graph, names: Sequence[str]) -> Iterator[list[str]]:
    """``names`` in runs of at most :data:`WINDOW_OPS` nodes whose inputs take at most
    :data:`WINDOW_BYTES` (a larger node gets a window of its own)."""
    window: list[str] = []
    size = 0
    for name in names:
        need = sum(m.nbytes for ref in graph[name].inputs for m in graph[ref].outputs if m is not None)
        if window and (len(window) == WINDOW_OPS or size + need > WINDOW_BYTES):
            yield window
            window, size = [], 0
        window.append(name)
        size += need
    if window:
        yield window


def measure_nodes(
    graph: Graph, names: Sequence[str], strides: Mapping[str, NodeStrides], device: torch.device, repeats: int
) -> Iterator[tuple[str, float | None]]:
    """Seconds one run of each node of ``names`` takes on ``device``; ``None`` when it cannot run.

    Nodes run on random inputs of their recorded shapes, without autograd as in the
    runtime, timed in turns (:func:`time_calls`) in windows of a few dozen nodes;
    results are yielded as each window completes. The random number generators are
    left as they were: timing dropout must not shift the user's RNG stream.
    """
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for window in _windows(graph, names):
            calls: dict[str, Callable] = {}
            for name in window:
                try:
                    calls[name] = prepared_call(graph, name, strides, device)
                except Exception as err:  # any op that cannot run here is priced analytically
                    # a view into more than its input spans (a concatenation written in place reads
                    # its parts as as_strided views of the whole) cannot run on a random input of
                    # its own; a view costs a dispatch, which the estimate has: no news for a user
                    level = logging.DEBUG if is_view(graph[name]) else logging.WARNING
                    log.log(level, "could not time %s (%s): using the analytic estimate", graph[name].op_name, err)
            times = dict(zip(calls, time_calls(list(calls.values()), device, repeats)))
            del calls
            for name in window:
                yield name, times.get(name)


@dataclass(frozen=True)
class StepTimes:
    """What :func:`measure_in_step` found: the ``seconds`` of each instruction, and whether
    they come from ``quiet`` runs (the machine's cores were this process's, :data:`QUIET_SHARE`)."""

    seconds: dict[str, float]
    quiet: bool


def measure_in_step(
    graph: Graph,
    strides: Mapping[str, NodeStrides],
    device: torch.device,
    runs: int,
    on_run: Callable[[], Any] | None = None,
) -> StepTimes:
    """Seconds of each instruction of ``graph`` timed where it stands in its step.

    The interpreter (:func:`magis.backend.interpreter.execute`) runs the graph in its node
    order on random inputs of the recorded shapes and strides (:func:`random_tensor`),
    once to warm up, then at least ``runs`` times and for at least
    :data:`IN_STEP_MIN_SECONDS`, each run followed by a plain run of the generated step
    (:mod:`magis.backend.codegen`, what a plan runs); each instruction's time covers
    mapping its arguments, the call and freeing the values that died, and the times are
    then moved by one shared amount so that they add up to the generated step's time
    (which maps nothing: on a CPU a few microseconds less per instruction). Only the middle half of the runs by
    their total time count, as a median step time would: on a shared machine a
    neighbour can slow the core down for tens of milliseconds, and the fastest runs
    are the lucky ones. Each instruction gets :func:`_typical_seconds` of its samples
    in those runs. Only quiet runs count (:data:`QUIET_SHARE`: the main thread ran nearly
    all the time), and the step runs again, up to :data:`IN_STEP_MAX_FACTOR` times the runs
    asked for, until enough are; where too few are, every run counts and the times are
    not ``quiet``. Raises what the step raises when it cannot run. The random number
    generators are left as they were. ``on_run`` is called after each run (a progress bar).
    """
    program = lower(graph)
    generated = generate(program)
    timed: list[list[float]] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        inputs = {  # an input without a tensor (the optimizer's handle) is None: its updates use their own options
            node.name: None if meta is None else random_tensor(meta, strides[node.name][0], device)
            for node in graph.nodes
            if node.is_input
            for meta in (node.outputs[:1] or (None,))
        }
        execute(program, dict(inputs))  # warm-up
        plain: list[float] = []
        quiet_timed: list[list[float]] = []
        quiet_plain: list[float] = []
        started = time.perf_counter()
        while len(quiet_timed) < runs or time.perf_counter() - started < IN_STEP_MIN_SECONDS:
            if len(timed) >= IN_STEP_MAX_FACTOR * runs and time.perf_counter() - started >= IN_STEP_MIN_SECONDS:
                break
            seconds: list[float] = []
            with _Share() as interpreted:
                execute(program, dict(inputs), seconds)
            with _Share() as run:
                generated(dict(inputs))
            timed.append(seconds)
            plain.append(run.wall)
            if interpreted.quiet and run.quiet:
                quiet_timed.append(seconds)
                quiet_plain.append(run.wall)
            if on_run is not None:
                on_run()
    quiet = len(quiet_timed) >= runs
    if quiet:
        timed, plain = quiet_timed, quiet_plain
    by_total = sorted(timed, key=sum)
    kept = by_total[len(by_total) // 4 : len(by_total) - len(by_total) // 4]  # the middle half
    typical = [_typical_seconds([run[i] for run in kept]) for i in range(len(program.instructions))]
    # What a plain run of the generated step spends beyond the timed instructions (less: it
    # neither maps arguments nor reads a clock), shared among the instructions: they then add
    # up to a plain run.
    between = (statistics.median(plain) - sum(typical)) / max(1, len(typical))
    return StepTimes({ins.node: max(0.0, t + between) for ins, t in zip(program.instructions, typical)}, quiet)


@dataclass(frozen=True)
class StepsTimed:
    """What :func:`time_in_turns` found: the median ``seconds`` of each call over the ``rounds``
    that counted, and whether those were ``quiet`` (every call in them, :data:`QUIET_SHARE`);
    ``samples`` are the counted rounds' seconds, one tuple of every call's per round."""

    seconds: tuple[float, ...]
    rounds: int
    quiet: bool
    samples: tuple[tuple[float, ...], ...] = ()

    def ratio(self, call: int, reference: int) -> tuple[float, float]:
        """The mean over the counted rounds of ``call``'s seconds over ``reference``'s in the
        same round, and its standard error (infinite from one round): paired, so a moment that
        slows the machine for a round moves both calls of it."""
        ratios = [times[call] / times[reference] for times in self.samples]
        if len(ratios) < 2:
            return statistics.fmean(ratios), math.inf
        return statistics.fmean(ratios), statistics.stdev(ratios) / math.sqrt(len(ratios))


def time_in_turns(
    calls: Sequence[Callable[[], Any]], device: torch.device, runs: int, max_seconds: float
) -> StepsTimed:
    """Seconds of each of ``calls`` (whole steps, already warmed up), timed in turns.

    A round runs every call once, in turn, so that all of them meet the same moment of the
    machine (on a CPU at batch 1, a forward pass of a few milliseconds takes 2.5 ms in one
    process and 4.4 in the next), each round starting one call further on, so that no call
    always follows the same one (or runs first, after the gap between rounds). Rounds go on
    until ``runs`` are quiet, up to :data:`IN_STEP_MAX_FACTOR` times ``runs`` rounds or
    ``max_seconds``, whichever comes first (one round at least); the median of the quiet
    rounds counts where there are at least three, else of every round (not ``quiet``).
    """
    sync = synchronizer(device)
    started = time.perf_counter()
    rounds: list[list[float]] = []
    quiet: list[list[float]] = []
    while len(quiet) < runs and len(rounds) < IN_STEP_MAX_FACTOR * runs:
        if rounds and time.perf_counter() - started > max_seconds:
            break
        times, all_quiet = [0.0] * len(calls), True
        first = len(rounds) % len(calls)
        for i in [*range(first, len(calls)), *range(first)]:
            with _Share() as run:
                calls[i]()
                sync()
            times[i] = run.wall
            all_quiet = all_quiet and run.quiet
        rounds.append(times)
        if all_quiet:
            quiet.append(times)
    counted = quiet if len(quiet) >= 3 else rounds
    seconds = tuple(statistics.median(r[i] for r in counted) for i in range(len(calls)))
    return StepsTimed(seconds, len(counted), counted is quiet, tuple(map(tuple, counted)))


def measure_steps(
    steps: Sequence[tuple[Graph, Sequence[str], Mapping[str, NodeStrides]]],
    device: torch.device,
    runs: int,
    max_seconds: float,
) -> StepsTimed:
    """Seconds of each of ``steps`` (a graph, the order it runs in, its replayed strides), run
    as a plan runs it (the generated step, :mod:`magis.backend.codegen`), timed in turns
    (:func:`time_in_turns`) after a warm-up.

    The steps read random inputs of their recorded shapes, one tensor per input name and
    layout however many steps read it. Raises what a step raises when it cannot run; the
    random number generators are left as they were.
    """
    started = time.perf_counter()
    shared: dict[tuple[str, TensorMeta | None, Strides | None], torch.Tensor | None] = {}
    calls: list[Callable[[], Any]] = []
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for graph, order, strides in steps:
            inputs: dict[str, Any] = {}
            for node in graph.nodes:
                if node.is_input:  # an input without a tensor (the optimizer's handle) is None
                    meta, stride = (node.outputs[0], strides[node.name][0]) if node.outputs else (None, None)
                    key = (node.name, meta, stride)
                    if key not in shared:
                        shared[key] = None if meta is None else random_tensor(meta, stride, device)
                    inputs[node.name] = shared[key]
            step = generate(lower(graph, order))
            step(dict(inputs))  # warm-up
            calls.append(functools.partial(_run_step, step, inputs))
        return time_in_turns(calls, device, runs, max_seconds - (time.perf_counter() - started))


def _run_step(step: Callable[[dict], Any], inputs: dict[str, Any]) -> None:
    step(dict(inputs))  # the step frees what it reads from its own copy of the inputs


class _Share:
    """The wall time of a ``with`` block, and whether this thread ran for
    :data:`QUIET_SHARE` of it (its CPU time, the kernel's work for it included)."""

    def __enter__(self) -> _Share:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.quiet = time.thread_time() - self._cpu >= QUIET_SHARE * self.wall


def _typical_seconds(samples: Sequence[float]) -> float:
    """The mean of ``samples`` without those above :data:`OUTLIER_FACTOR` x their median.

    The mean, not the median: an instruction's time is skewed to the right (a cache
    miss, a page of the allocator), and a step's time is the sum of its instructions,
    whose typical value is the sum of their means; a sum of medians comes out 2-5%
    short. The outliers dropped are the moments another process held the core.
    """
    median = statistics.median(samples)
    kept = [t for t in samples if t <= OUTLIER_FACTOR * median]
    return sum(kept) / len(kept)
