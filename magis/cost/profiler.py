"""Measure operator latencies on this machine, once, and keep them on disk (MAGIS §5).

The simulator sums per-operator costs. On the local device magis measures each
distinct operator application — op overload, input shapes, dtypes and strides,
constant arguments, output shapes — and caches its time in a JSON file, so a later
run (or another process on the same machine) measures nothing.

On a CPU an operator is timed *in its step* (:func:`measure_in_step`): the runtime
runs the whole graph on random inputs of the recorded shapes and times each
instruction where it stands, with the caches full of its neighbours' data and
paying for the values it frees. Timed alone, the same operator runs 10-20% faster
(convolutions, their backward, batch norm) and a ``getitem`` three times faster, so
a sum of isolated times underestimates a CPU step by 15-30%. Binding the step's
inputs (the module's parameters, once per step) is measured once per machine
(:func:`measure_runtime_costs`). On CUDA, and for any operator a step cannot run,
each operator is timed alone (:func:`measure_nodes`), in turns with its neighbours.
This module holds that machinery: op keys, input materialisation, timing, the disk
cache and a crude roofline of the local device for operators that cannot be measured.
:class:`magis.cost.latency.ProfiledCostModel` puts it together.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import operator
import os
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from magis.backend.runtime import bind, execute, lower
from magis.cost.device_profiles import PRECISION_OF_DTYPE, DeviceProfile
from magis.ir.graph import Graph, Node, Ref, Role, Signature, TensorMeta, is_view, map_refs

CACHE_FORMAT = 3
CACHE_DIR_ENV = "MAGIS_CACHE_DIR"
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
#: instructions of the program that measures the runtime's own costs, and how many
#: times it runs (the fastest run counts).
OVERHEAD_PROGRAM_OPS = 64
OVERHEAD_ROUNDS = 30

log = logging.getLogger(__name__)

#: strides of each output element of a node (``None`` for a missing optional output).
Strides = tuple[int, ...]
NodeStrides = tuple[Strides | None, ...]


# --------------------------------------------------------------------------- where
def device_tag(device: torch.device) -> str:
    """``cpu``, or ``cuda-<gpu model>``: measurements are only valid on the same kind of device."""
    if device.type == "cuda":
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return device.type


def default_cache_path(device: torch.device) -> Path:
    """``$MAGIS_CACHE_DIR`` (default ``~/.cache/magis``) ``/latency-<device>-<torch>-<host hash>.json``."""
    base = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "magis")
    host = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
    return base / f"latency-{device_tag(device)}-{torch.__version__}-{host}.json"


class LatencyCache:
    """Seconds per op key timed alone (``ops``; ``None``: the op could not run) and
    timed in its step (``in_step``, :func:`in_step_key`), the device's crude roofline
    and the runtime's own costs (:class:`RuntimeCosts` as a dict, ``None`` until measured).

    Saving merges with what other processes wrote meanwhile and replaces the file
    atomically, so concurrent runs never corrupt it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ops, self.in_step, self.device_profile, self.runtime_costs = self._read()

    def _read(
        self,
    ) -> tuple[dict[str, float | None], dict[str, float], dict[str, Any] | None, dict[str, float] | None]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}, {}, None, None
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            return {}, {}, None, None
        ops, in_step = dict(data.get("ops", {})), dict(data.get("in_step", {}))
        return ops, in_step, data.get("device_profile"), data.get("runtime_costs")

    def save(self) -> None:
        ops, in_step, profile, runtime = self._read()
        ops.update(self.ops)
        in_step.update(self.in_step)
        self.ops, self.in_step = ops, in_step
        self.device_profile = self.device_profile or profile
        self.runtime_costs = self.runtime_costs or runtime
        data = {
            "format": CACHE_FORMAT,
            "torch": torch.__version__,
            "device_profile": self.device_profile,
            "runtime_costs": self.runtime_costs,
            "ops": ops,
            "in_step": in_step,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as tmp:
            json.dump(data, tmp, indent=0, sort_keys=True)
        os.replace(tmp.name, self.path)


# ------------------------------------------------------------------ what to run
def measurable(node: Node) -> bool:
    """An aten operator that can be run and timed on its own."""
    return isinstance(node.target, torch._ops.OpOverload)


def bind_arguments(node: Node, value: Callable[[str], Any], device: torch.device) -> tuple[tuple, dict[str, Any]]:
    """The node's ``args, kwargs`` with every :class:`Ref` replaced by ``value(name)``
    and every device argument (of factory ops) by ``device``."""

    def resolve(ref: Ref) -> Any:
        return value(ref.name)

    def place(x: Any) -> Any:  # aten schemas take a device only as a whole argument
        return device if isinstance(x, torch.device) else x

    args = tuple(place(a) for a in map_refs(node.args, resolve))
    kwargs = {k: place(v) for k, v in map_refs(node.kwargs_dict(), resolve).items()}
    return args, kwargs


def contiguous_strides(shape: tuple[int, ...]) -> Strides:
    """Row-major strides of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _is_contiguous(shape: tuple[int, ...], strides: Strides) -> bool:
    """Row-major, ignoring the stride of size-1 dimensions (it never matters)."""
    return all(s == c for size, s, c in zip(shape, strides, contiguous_strides(shape)) if size != 1)


def replay_strides(graph: Graph) -> dict[str, NodeStrides]:
    """The strides of every output element, replaying the graph's views on meta tensors.

    The IR records shapes only, but strides decide how fast an op runs (a transposed
    operand, a broadcast with stride 0). Views and ``getitem`` are replayed on meta
    tensors (cheap: their meta kernels are native); every other operator is taken to
    write contiguous outputs, as nearly all aten kernels do on contiguous inputs
    (running them on meta would go through Python decompositions, ~1 ms each).
    """
    meta = torch.device("meta")
    values: dict[str, Any] = {}
    strides: dict[str, NodeStrides] = {}
    for node in graph.nodes:
        value = None
        if node.target is operator.getitem or (measurable(node) and is_view(node)):
            try:
                args, kwargs = bind_arguments(node, values.__getitem__, meta)
                value = node.target(*args, **kwargs)
            except Exception:  # a view without a meta kernel: assume contiguous
                value = None
        elements = list(value) if isinstance(value, (tuple, list)) else [value]
        if len(elements) != len(node.outputs) or not all(
            isinstance(v, torch.Tensor) and tuple(v.shape) == m.shape
            for v, m in zip(elements, node.outputs)
            if m is not None
        ):
            elements = [None if m is None else torch.empty(m.shape, dtype=m.dtype, device=meta) for m in node.outputs]
        values[node.name] = tuple(elements) if node.tuple_output else elements[0]
        strides[node.name] = tuple(None if v is None else tuple(v.stride()) for v in elements)
    return strides


def op_key(graph: Graph, name: str, strides: Mapping[str, NodeStrides]) -> str:
    """A stable text key for one operator application: what decides its latency.

    Op overload, each input's shape, dtype and (when not contiguous) strides, the
    constant arguments, and the output shapes; never node names.
    """
    node = graph[name]

    def describe(input_name: str) -> str:
        parts = []
        for meta, stride in zip(graph[input_name].outputs, strides[input_name]):
            if meta is None:
                parts.append("None")
                continue
            layout = "" if _is_contiguous(meta.shape, stride) else f"@{list(stride)}"
            parts.append(f"{str(meta.dtype).removeprefix('torch.')}{list(meta.shape)}{layout}")
        return "T(" + ",".join(parts) + ")"

    args, kwargs = bind_arguments(node, describe, torch.device("cpu"))
    outputs = [None if m is None else (str(m.dtype).removeprefix("torch."), list(m.shape)) for m in node.outputs]
    return f"{node.op_name}{args!r}{sorted(kwargs.items())!r}->{outputs!r}"


def step_context(signature: Signature) -> str:
    """Which model a step trains, as a short digest of its parameters' and buffers' names.

    An operator's time inside a step depends on the step around it (what its
    neighbours left in the caches): the same convolution timed inside U-Net++ and
    inside U-Net differs by 5-10% on a CPU. Every graph of one model (its captured
    step, fission variants, rewrites) shares the context; other models have their own.
    """
    names = "\n".join(sorted((*signature.parameters.values(), *signature.buffers.values())))
    return hashlib.sha1(names.encode()).hexdigest()[:12]


def node_key(graph: Graph, name: str, keys: Mapping[str, str]) -> str | None:
    """A node's key in any step: its op key (``keys``), or for a ``getitem`` the element
    it picks of an operator with an op key; ``None`` for anything else."""
    node = graph[name]
    if node.target is operator.getitem and node.inputs and node.inputs[0] in keys:
        return f"getitem{list(node.args[1:])!r} of {keys[node.inputs[0]]}"
    return keys.get(name)


def in_step_key(graph: Graph, name: str, keys: Mapping[str, str], context: str) -> str | None:
    """The key of a node's time in its step: :func:`node_key` inside the model ``context``
    (:func:`step_context`)."""
    key = node_key(graph, name, keys)
    return None if key is None else f"{context}: {key}"


_INTEGER = re.compile(r"\d+")


@dataclass
class KinTimes:
    """Node times of the graphs a cost model priced, to estimate operators never timed
    from their kin: the same operator on other shapes.

    Two node keys (:func:`node_key`) are kin when they differ only in their integers
    (shapes, sizes, constant arguments). The nearest kin differs in the fewest of them
    (one part of a fissioned step differs from the whole step in its batch dimension
    alone), ties broken by the closest analytic time; its measured time is scaled by
    the ratio of the two operators' analytic times (the roofline of this device). An
    operator without kin gets its analytic time scaled by the median ratio of measured
    to analytic time over everything seen. Measuring a graph on a CPU runs the whole step
    ten times, seconds per graph; an estimate takes microseconds, which is what lets a
    search with a time budget try fissioned graphs at all (:class:`magis.cost.latency.ProfiledCostModel`).
    """

    #: key skeleton (integers replaced) -> {integers of the key: (analytic s, measured s)}
    by_skeleton: dict[str, dict[tuple[int, ...], tuple[float, float]]] = field(default_factory=dict)
    #: measured / analytic time of each operator seen with a positive analytic time
    ratios: list[float] = field(default_factory=list)
    #: estimates made, by key (a graph and its variants share most keys)
    estimates: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_skeleton)

    def add(self, key: str, analytic_s: float, seconds: float) -> None:
        """Remember that the operator of ``key`` took ``seconds`` (its analytic time ``analytic_s``)."""
        known = self.by_skeleton.setdefault(_INTEGER.sub("#", key), {})
        integers = tuple(int(i) for i in _INTEGER.findall(key))
        if integers not in known:
            known[integers] = (analytic_s, seconds)
            if analytic_s > 0:
                self.ratios.append(seconds / analytic_s)
            self.estimates.clear()  # an estimate may have a nearer kin now

    def estimate(self, key: str, analytic_s: float) -> float:
        """Seconds the operator of ``key`` likely takes (class docstring)."""
        if key in self.estimates:
            return self.estimates[key]
        integers = tuple(int(i) for i in _INTEGER.findall(key))
        kin = self.by_skeleton.get(_INTEGER.sub("#", key), {})

        def distance(other: tuple[int, ...]) -> tuple[int, float]:
            differing = sum(a != b for a, b in zip(integers, other))
            kin_analytic = kin[other][0]
            closeness = abs(math.log(analytic_s / kin_analytic)) if analytic_s > 0 and kin_analytic > 0 else 0.0
            return differing, closeness

        if kin:
            kin_analytic, kin_seconds = kin[min(kin, key=distance)]
            seconds = kin_seconds * (analytic_s / kin_analytic if analytic_s > 0 and kin_analytic > 0 else 1.0)
        else:
            seconds = analytic_s * (statistics.median(self.ratios) if self.ratios else 1.0)
        self.estimates[key] = seconds
        return seconds


# ----------------------------------------------------------------- how to run
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


def _synchronizer(device: torch.device) -> Callable[[], None]:
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
    sync = _synchronizer(device)
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


def _prepared_call(graph: Graph, name: str, strides: Mapping[str, NodeStrides], device: torch.device) -> Callable:
    """Node ``name`` on random inputs of its recorded shapes on ``device``, called once (warm-up).

    The call resolves its :class:`Ref` arguments as the runtime's interpreter does
    (:func:`magis.ir.graph.map_refs` over the arguments), so the time includes that
    per-instruction cost, whose price depends on the operator's arguments.
    """
    node = graph[name]
    inputs: dict[str, Any] = {}
    for ref in node.inputs:
        source = graph[ref]
        elements = [
            None if meta is None else random_tensor(meta, stride, device)
            for meta, stride in zip(source.outputs, strides[ref])
        ]
        inputs[ref] = tuple(elements) if source.tuple_output else elements[0]
    args, kwargs = bind_arguments(node, Ref, device)  # constants bound now, references at each call

    def value(ref: Ref) -> Any:
        return inputs[ref.name]

    def call() -> Any:
        return node.target(*map_refs(args, value), **map_refs(kwargs, value))

    call()
    _synchronizer(device)()
    return call


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
                    calls[name] = _prepared_call(graph, name, strides, device)
                except Exception as err:  # any op that cannot run here is priced analytically
                    log.warning("could not time %s (%s): using the analytic estimate", graph[name].op_name, err)
            times = dict(zip(calls, time_calls(list(calls.values()), device, repeats)))
            del calls
            for name in window:
                yield name, times.get(name)


def measure_in_step(
    graph: Graph,
    strides: Mapping[str, NodeStrides],
    device: torch.device,
    runs: int,
    on_run: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Seconds of each instruction of ``graph`` timed where it stands in its step.

    The runtime (:func:`magis.backend.runtime.execute`) runs the graph in its node
    order on random inputs of the recorded shapes and strides (:func:`random_tensor`),
    once to warm up, then at least ``runs`` times and for at least
    :data:`IN_STEP_MIN_SECONDS`; each instruction's time covers mapping its arguments,
    the call and freeing the values that died. Only the middle half of the runs by
    their total time count, as a median step time would: on a shared machine a
    neighbour can slow the core down for tens of milliseconds, and the fastest runs
    are the lucky ones. Each instruction gets :func:`_typical_seconds` of its samples
    in those runs. Raises what the step raises when it cannot run. The random number
    generators are left as they were. ``on_run`` is called after each run (a progress bar).
    """
    program = lower(graph)
    timed: list[list[float]] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        inputs = {
            node.name: None if meta is None else random_tensor(meta, strides[node.name][0], device)
            for node in graph.nodes
            if node.is_input
            for meta in node.outputs[:1]
        }
        execute(program, dict(inputs))  # warm-up
        plain: list[float] = []
        started = time.perf_counter()
        while len(timed) < runs or time.perf_counter() - started < IN_STEP_MIN_SECONDS:
            seconds: list[float] = []
            execute(program, dict(inputs), seconds)
            timed.append(seconds)
            start = time.perf_counter()
            execute(program, dict(inputs))
            plain.append(time.perf_counter() - start)
            if on_run is not None:
                on_run()
    by_total = sorted(timed, key=sum)
    kept = by_total[len(by_total) // 4 : len(by_total) - len(by_total) // 4]  # the middle half
    typical = [_typical_seconds([run[i] for run in kept]) for i in range(len(program.instructions))]
    # What the loop spends between the timed instructions, less what timing them costs,
    # shared among the instructions: the instructions then add up to a plain run.
    between = (statistics.median(plain) - sum(typical)) / max(1, len(typical))
    return {ins.node: max(0.0, t + between) for ins, t in zip(program.instructions, typical)}


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


@dataclass(frozen=True)
class RuntimeCosts:
    """What the magis runtime (:func:`magis.backend.runtime.execute`) spends beyond the
    operators' profiled times: ``instruction_s`` per instruction (its loop, storing the
    result, freeing the values that died), ``getitem_s`` per ``getitem`` instruction
    (mapping its argument and picking the element, which no profile times),
    and what binding the step's inputs costs (:func:`magis.backend.runtime.bind`):
    ``lookup_s`` per submodule on the way to a parameter or buffer, ``input_s`` per
    input bound (:func:`binding_seconds`)."""

    instruction_s: float
    getitem_s: float
    lookup_s: float
    input_s: float


def lookup_steps(signature: Signature) -> int:
    """How many submodules binding looks up to find the step's parameters and buffers
    (:func:`magis.backend.runtime.module_tensors`): every module path that leads to
    one of them, the root (which needs no lookup) left out."""
    paths: set[str] = set()
    for name in (*signature.parameters.values(), *signature.buffers.values()):
        parts = name.split(".")[:-1]
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return len(paths)


def binding_seconds(graph: Graph, costs: RuntimeCosts) -> float:
    """Seconds a step spends binding ``graph``'s inputs to the module's tensors and the user's inputs."""
    inputs = sum(1 for node in graph.nodes if node.is_input)
    return costs.lookup_s * lookup_steps(graph.signature) + costs.input_s * inputs


def _block_seconds(fn: Callable[[], Any], device: torch.device, rounds: int) -> float:
    """Fastest of ``rounds`` timed runs of ``fn`` (after one warm-up run)."""
    sync = _synchronizer(device)
    fn()
    runs = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - start)
    return min(runs)


def measure_runtime_costs(device: torch.device, rounds: int = OVERHEAD_ROUNDS) -> RuntimeCosts:
    """The runtime's own costs on ``device``, measured in a few milliseconds.

    A program of :data:`OVERHEAD_PROGRAM_OPS` ``neg`` instructions on one element, each
    result freed by the next, runs through the runtime; the same calls, arguments
    mapped as the profiler maps them, run in a plain loop; the difference per
    instruction (never below zero) is ``instruction_s``. A plain loop of ``getitem``
    calls with mapped arguments gives ``getitem_s``. Binding ``n`` parameters one
    submodule deep, then two deep, gives ``lookup_s`` and ``input_s`` (two equations,
    two unknowns). Each is the fastest of ``rounds`` runs: a busy
    moment only slows some runs down.
    """
    n = OVERHEAD_PROGRAM_OPS
    one = TensorMeta((1,), torch.float32, 4)
    nodes = [Node("x", None, outputs=(one,), aliases=(None,), role=Role.INPUT)]
    for i in range(n):
        previous = Ref(nodes[-1].name)
        nodes.append(Node(f"neg{i}", torch.ops.aten.neg.default, (previous,), outputs=(one,), aliases=(None,)))
    program = lower(Graph(tuple(nodes), outputs=(nodes[-1].name,)))
    env: dict[str, Any] = {"x": torch.ones(1, device=device), "pair": (None, None)}

    neg_args, getitem_args = (Ref("x"),), (Ref("pair"), 1)  # built once, as the runtime's instructions are

    def value(ref: Ref) -> Any:
        return env[ref.name]

    def calls() -> None:
        for _ in range(n):
            torch.ops.aten.neg.default(*map_refs(neg_args, value))

    def getitems() -> None:
        for _ in range(n):
            operator.getitem(*map_refs(getitem_args, value))

    def binding(depth: int) -> Callable[[], Any]:
        """Binding ``n`` parameters, each held ``depth`` submodules deep."""
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # initialising draws
            layers: list[torch.nn.Module] = [torch.nn.Linear(1, 1, bias=False, device=device) for _ in range(n)]
        for _ in range(depth - 1):
            layers = [torch.nn.Sequential(layer) for layer in layers]
        holder = torch.nn.Sequential(*layers)
        names = [name for name, _ in holder.named_parameters()]
        weights = tuple(Node(f"p{i}", None, outputs=(one,), aliases=(None,), role=Role.INPUT) for i in range(n))
        graph = Graph(weights, outputs=(), signature=Signature(parameters={w.name: p for w, p in zip(weights, names)}))
        return lambda: bind(graph, holder, ())

    with torch.no_grad():
        runtime_s = _block_seconds(lambda: execute(program, {"x": env["x"]}), device, rounds)
        calls_s = _block_seconds(calls, device, rounds)
        getitem_s = _block_seconds(getitems, device, rounds)
        one_deep_s = _block_seconds(binding(depth=1), device, rounds)
        two_deep_s = _block_seconds(binding(depth=2), device, rounds)
    lookup_s = max(0.0, (two_deep_s - one_deep_s) / n)
    return RuntimeCosts(
        instruction_s=max(0.0, (runtime_s - calls_s) / n),
        getitem_s=getitem_s / n,
        lookup_s=lookup_s,
        input_s=max(0.0, one_deep_s / n - lookup_s),
    )


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_device_profile(device: torch.device, repeats: int = 5) -> DeviceProfile:
    """A crude roofline of ``device``, for the operators the profiler cannot run.

    Peak FLOP/s per precision from a 256x256 matmul, bandwidth from copying 32 MiB,
    launch overhead from adding two one-element tensors. The figures are achieved
    rates, so the efficiencies are 1.
    """
    n = 256
    peak_flops = {}
    for dtype, precision in PRECISION_OF_DTYPE.items():
        a = torch.rand(n, n, device=device).to(dtype)
        peak_flops[precision] = 2 * n**3 / time_call(functools.partial(torch.mm, a, a), device, repeats)
    peak_flops["tf32"] = peak_flops["fp32"]
    block, target = torch.rand(8 * 2**20, device=device), torch.empty(8 * 2**20, device=device)
    bandwidth = 2 * block.nbytes / time_call(functools.partial(target.copy_, block), device, repeats)
    one = torch.ones(1, device=device)
    launch = time_call(functools.partial(torch.add, one, one), device, repeats)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        pinned = torch.empty(block.shape, pin_memory=True)
        host_link = block.nbytes / time_call(functools.partial(pinned.copy_, block), device, repeats)
    else:
        memory = host_memory_bytes()
        host_link = bandwidth
    return DeviceProfile(
        name=device_tag(device),
        peak_flops=peak_flops,
        memory_bandwidth=bandwidth,
        launch_overhead_s=launch,
        host_link_bandwidth=host_link,
        memory_bytes=memory,
        compute_efficiency=1.0,
        bandwidth_efficiency=1.0,
        host_link_efficiency=1.0,
    )
