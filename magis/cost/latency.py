"""Latency of a schedule, from a per-operator cost model (MAGIS §5, "Simulator").

MAGIS scores every candidate (graph, schedule) by simulating it: the memory
timeline (:mod:`magis.cost.memory`) and the latency, the sum of the operators' run
times on one stream. Operator times come from a :class:`CostModel`:

- :class:`ProfiledCostModel` measures each distinct operator application once on
  this machine's CPU or GPU (:mod:`magis.cost.op_timing`) and caches the result on
  disk (:mod:`magis.cost.timing_cache`);
- :class:`AnalyticCostModel` prices it from a named device's figures
  (:mod:`magis.cost.device_profiles`) with the kernel model of
  :mod:`magis.cost.kernel_model` (a roofline for large kernels; tiles and waves for
  GEMM-like kernels, a bandwidth ramp and a minimum time for small ones), to plan
  for a GPU one does not have.

Graph inputs cost nothing; so do ``getitem`` in the analytic model, while the profiled
model charges it the runtime's work (its argument mapping and call, measured once).
A node whose target knows its own cost
(a fissioned region runs its parts one after another) provides
``estimate_seconds(cost_model)`` and is asked for it; a swap's Store or Load takes
its bytes over the host link (:mod:`magis.cost.host_link`).
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol
from weakref import WeakKeyDictionary

import torch
from torch.utils.flop_counter import flop_registry
from tqdm import tqdm

from magis.backend.runtime import bind_arguments
from magis.backend.transfer import Load, Store
from magis.cost.device_profiles import DEVICE_PROFILES, DeviceProfile
from magis.cost.host_link import transfer_seconds
from magis.cost.kernel_model import Gemm, gemm_seconds, kernel_seconds, stream_seconds
from magis.cost.kin import KinTimes
from magis.cost.local_device import host_memory_bytes, measure_device_profile
from magis.cost.memory import peak_memory
from magis.cost.op_keys import NodeStrides, in_step_key, measurable, node_key, op_key, replay_strides, step_context
from magis.cost.op_timing import StepsTimed, measure_in_step, measure_nodes, measure_steps
from magis.cost.runtime_costs import RuntimeCosts, binding_seconds, measure_runtime_costs
from magis.cost.timing_cache import LatencyCache, default_cache_path
from magis.ir.graph import Graph, Node, Role, is_view

log = logging.getLogger(__name__)
aten = torch.ops.aten

#: kernels torch's flop counter has no formula for, and the registered kernel whose FLOPs they
#: do: CPU kernels of CUDA ones (a graph captured on CPU may be priced for a GPU), in-place twins.
_FLOP_ALIASES = {
    aten.addmm_: aten.addmm,  # a matrix product accumulated in place (magis.rules.multiply_add)
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}

#: measuring at least this many operators shows a progress bar.
PROGRESS_MIN_OPS = 10
#: a CPU step is timed in place only if its peak takes at most this share of the machine's memory.
IN_STEP_MEMORY_SHARE = 0.25
#: an operator estimated from its kin at more than this is timed alone, and so is its kin
#: (:meth:`ProfiledCostModel._checked_estimates`)
CHECK_ESTIMATE_S = 1e-3
#: nodes whose op keys a profiled cost model keeps (:meth:`ProfiledCostModel._keys`): some tens of
#: graphs at paper size (Echo's NMT: 13,526 nodes), the nodes of most of them shared
OP_KEYS_HELD = 200_000


class CostModel(Protocol):
    """Seconds one node of a graph takes to run."""

    def node_seconds(self, graph: Graph, name: str) -> float: ...


@dataclass(frozen=True)
class LatencyProfile:
    """The simulated timeline of one schedule.

    Compute steps run one after another on stream 0; swap transfers on stream 1
    overlap with them. The fields are per step, aligned with ``order``.
    """

    order: tuple[str, ...]
    per_node_s: tuple[float, ...]
    start_s: tuple[float, ...]
    streams: tuple[int, ...]
    total_s: float


def estimate_latency(graph: Graph, order: Sequence[str], model: CostModel) -> LatencyProfile:
    """Simulate running ``graph`` in ``order``, each step starting when the previous one ends.

    Swap transfers (targets with ``stream = 1``, MAGIS §5.2 Store/Load) run on a second
    stream: each starts once the compute issued before it and the previous transfer are
    done, a compute step that reads a transfer's result waits for it, and the step takes
    as long as both streams together (what compute does not hide is paid).
    """
    graph.check_schedule(order)
    per_node = tuple(model.node_seconds(graph, name) for name in order)
    streams = tuple(int(getattr(graph[name].target, "stream", 0)) for name in order)
    if not any(streams):
        start = tuple(itertools.accumulate(per_node, initial=0.0))
        return LatencyProfile(tuple(order), per_node, start[:-1], streams, start[-1])
    free = [0.0, 0.0]  # when each stream runs out of work
    end: dict[str, float] = {}
    starts = []
    for name, seconds, stream in zip(order, per_node, streams):
        ready = max((end[p] for p in graph.predecessors[name]), default=0.0)
        begin = max(free[stream], ready, free[0])
        end[name] = free[stream] = begin + seconds
        starts.append(begin)
    return LatencyProfile(tuple(order), per_node, tuple(starts), streams, max(free))


# -------------------------------------------------------------- node work
#: operators that only allocate: their result's contents are undefined, so no kernel writes it
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)


def is_free(node: Node) -> bool:
    """Graph inputs, ``getitem`` of a tuple and bare allocations (``empty``): nothing runs."""
    return node.is_input or node.target is operator.getitem or node.target in _ALLOCATIONS


def _in_place(node: Node) -> bool:
    """An operator that writes into its argument (``add_``, as gradient accumulation adds
    into ``.grad``): its result aliases an input, yet a kernel reads and writes it all."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _delegated_seconds(graph: Graph, node: Node, model: CostModel) -> float | None:
    """The time of a swap's transfer over the host link, or the cost a self-describing
    target (a fissioned region) reports, else ``None``."""
    if isinstance(node.target, (Store, Load)):
        return transfer_seconds(node.target.nbytes, model)
    estimate = getattr(node.target, "estimate_seconds", None)
    if callable(estimate):
        return float(estimate(model))
    kernels = getattr(node.target, "kernel_bytes", None)
    return None if kernels is None else _streaming_seconds(kernels(graph, node), model)


def _streaming_seconds(kernel_bytes: Sequence[int], model: CostModel) -> float:
    """Seconds of bandwidth-bound kernels moving ``kernel_bytes`` each (an optimizer's update:
    :class:`magis.frontend.optimizer.ParameterUpdate` says what its kernels move)."""
    profile = getattr(model, "fallback", model).profile
    return sum(kernel_seconds(profile, 0.0, stream_seconds(profile, n)) for n in kernel_bytes)


def _shape_value(graph: Graph, name: str) -> Any:
    """A node's value as the flop formulas want it: a shape, or a tuple of shapes."""
    node = graph[name]
    shapes = tuple(None if m is None else m.shape for m in node.outputs)
    return shapes if node.tuple_output else shapes[0]


def node_flops(graph: Graph, name: str) -> int:
    """Floating point operations of a matmul, convolution or attention node (forward or backward).

    Uses the formulas of :mod:`torch.utils.flop_counter`, which count a multiply-add
    as two FLOPs; any other operator counts as zero (it is bandwidth bound).
    """
    node = graph[name]
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(_FLOP_ALIASES.get(packet, packet))
    if formula is None:
        return 0
    # The registry wraps each formula to turn tensors into shapes (slowly, with pytree);
    # the IR already holds shapes, so call the formula underneath.
    formula = getattr(formula, "__wrapped__", formula)
    args, kwargs = bind_arguments(node, lambda ref: _shape_value(graph, ref), torch.device("cpu"))
    try:
        return int(formula(*args, out_shape=_shape_value(graph, name), **kwargs))
    except Exception as err:  # shapes the formula rejects (a hand-built graph): price the node by its bytes
        log.warning("cannot count the FLOPs of %s (%s): counting none", name, err)
        return 0


def _gemm_of(shape: tuple[int, ...], layout: str, flops: float) -> Gemm:
    """The GEMM that writes an output of ``shape`` with ``flops`` FLOPs of math.

    ``layout`` says how the output maps onto the GEMM's ``m x n`` result:
    ``"matrix"`` (``[..., m, n]``, leading dimensions batched: mm, bmm, attention),
    ``"activation"`` (``[batch, n, *spatial]``: an implicit-GEMM convolution or its
    input gradient, ``m`` = batch x spatial positions, ``n`` = channels), or
    ``"weight"`` (``[m, *rest]``: a convolution's weight gradient, ``m`` = output
    channels, ``n`` = input channels / groups x kernel positions). ``k`` follows from
    the FLOPs, so it is whatever the flop formula counts (``C_in / groups x kernel``
    for a convolution, twice the key length for attention).
    """
    if layout == "matrix":
        batch, m, n = math.prod(shape[:-2]), shape[-2], shape[-1]
    elif layout == "activation":
        batch, m, n = 1, shape[0] * math.prod(shape[2:]), shape[1]
    else:
        batch, m, n = 1, shape[0], math.prod(shape[1:])
    size = batch * m * n
    return Gemm(batch, m, n, flops / (2 * size) if size else 0.0)


def node_gemms(graph: Graph, name: str) -> tuple[Gemm, ...]:
    """The GEMM-like kernels of a matmul, convolution or attention node; ``()`` for any other.

    A convolution's backward runs one implicit GEMM per gradient it computes (input
    and weight, as many FLOPs each as the forward; its bias gradient is a reduction);
    every other node runs one GEMM shaped by its first output.
    """
    flops = node_flops(graph, name)
    if not flops:
        return ()
    node = graph[name]
    if "convolution_backward" in node.op_name:
        grads = [(meta, layout) for meta, layout in zip(node.outputs[:2], ("activation", "weight")) if meta is not None]
        return tuple(_gemm_of(meta.shape, layout, flops / len(grads)) for meta, layout in grads)
    layout = "activation" if "convolution" in node.op_name else "matrix"
    return (_gemm_of(node.outputs[0].shape, layout, flops),)


def node_bytes(graph: Graph, name: str) -> int:
    """Bytes a node moves through device memory: what it reads plus the storages it writes.

    Each input is read once: its logical size for a slice of a larger storage, the
    storage size for a broadcast (a stride-0 view reads each element once).
    """
    node = graph[name]
    return sum(_read_bytes(graph, ref) for ref in node.inputs) + node.fresh_bytes


def _read_bytes(graph: Graph, ref: str) -> int:
    """Bytes a kernel reads of the value ``ref`` (:func:`node_bytes`)."""
    sizes = graph.storage_bytes
    return sum(
        min(meta.numel * meta.dtype.itemsize, sizes[storage])
        for meta, storage in zip(graph[ref].outputs, graph.storages[ref])
        if meta is not None and storage is not None
    )


def fusible(node: Node) -> bool:
    """A pointwise operator (``torch.Tag.pointwise``) that draws no random numbers: Inductor
    computes it inside the kernel of its pointwise neighbours instead of launching its own."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags and not node.random


def fused_with(producer: Node, reader: Node) -> bool:
    """``reader`` computes ``producer``'s value inside its own kernel: both pointwise and in the
    same pass (a value the forward makes and the backward reads is saved, not fused)."""
    forward = (Role.ACTIVATION, Role.LOSS)
    return fusible(producer) and fusible(reader) and (producer.role in forward) == (reader.role in forward)


def fused_bytes(graph: Graph, name: str) -> tuple[int, bool]:
    """What a pointwise node moves when its chain is one fused kernel (issue #30's fusion
    model), and whether it opens that kernel: it reads only the inputs not computed in the
    same kernel (:func:`fused_with`), and writes its result only where a reader is outside
    it (or the step returns it); it opens a kernel when no input is computed in it."""
    node = graph[name]
    inside = [ref for ref in node.inputs if fused_with(graph[ref], node)]
    read = sum(_read_bytes(graph, ref) for ref in node.inputs if ref not in inside)
    readers = graph.consumers[name]
    kept = name in graph.outputs or not readers or any(not fused_with(node, graph[r]) for r in readers)
    return read + (node.fresh_bytes if kept else 0), not inside


def _compute_dtype(graph: Graph, node: Node) -> torch.dtype:
    """The dtype an operator computes in: that of its first tensor input (else its output)."""
    for ref in node.inputs:
        for meta in graph[ref].outputs:
            if meta is not None:
                return meta.dtype
    return next((m.dtype for m in node.outputs if m is not None), torch.float32)


# -------------------------------------------------------------- the models
@dataclass(frozen=True)
class AnalyticCostModel:
    """Cost of each operator on a named device (MAGIS §5 cost model).

    The math of its GEMM-like kernels (:func:`node_gemms`, in tiles and waves on a
    GPU) against the bytes it moves, composed with the launch cost as
    :func:`magis.cost.kernel_model.kernel_seconds` says; for large kernels this is the
    roofline ``max(flops / achievable FLOP/s, bytes / achievable bandwidth)``. Inputs,
    ``getitem`` and views cost nothing. ``tf32_matmul`` and ``tf32_conv``
    say whether fp32 matmuls and convolutions use TF32 tensor cores; the defaults are
    PyTorch's (``torch.backends.cuda.matmul.allow_tf32=False``, ``torch.backends.cudnn.allow_tf32=True``).
    """

    profile: DeviceProfile
    tf32_matmul: bool = False
    tf32_conv: bool = True
    #: price the step as compiled (``optimize(compile=True)``): chains of pointwise ops as one
    #: kernel each (:func:`fused_bytes`), so recomputing a pointwise op costs little
    fused: bool = False

    def node_seconds(self, graph: Graph, name: str) -> float:
        node = graph[name]
        delegated = _delegated_seconds(graph, node, self)
        if delegated is not None:
            return delegated
        if is_free(node) or (is_view(node) and not _in_place(node)):
            return 0.0
        profile = self.profile
        if self.fused and fusible(node):
            nbytes, opens = fused_bytes(graph, name)
            if opens:
                return kernel_seconds(profile, 0.0, stream_seconds(profile, nbytes))
            return nbytes / profile.bytes_per_second  # inside a kernel already launched
        passes = profile.batch_norm_passes if "batch_norm" in node.op_name else 1.0
        memory_s = stream_seconds(profile, int(passes * node_bytes(graph, name)))
        compute_s = 0.0
        gemms = node_gemms(graph, name)
        if gemms:
            conv = "conv" in node.op_name
            rate = profile.flops_per_second(_compute_dtype(graph, node), self.tf32_conv if conv else self.tf32_matmul)
            rate *= profile.conv_efficiency if conv else 1.0
            compute_s = sum(gemm_seconds(profile, gemm, rate) for gemm in gemms)
        return kernel_seconds(profile, compute_s, memory_s)


class CannotTime(Exception):
    """A step that cannot be timed whole here (:meth:`ProfiledCostModel.time_steps` says why)."""


class ProfiledCostModel:
    """Operator times measured on this machine (MAGIS §5: the simulator's per-op profile).

    The first time a graph is priced, every distinct operator application it holds
    that is not in the cache yet is timed on random inputs of its recorded shapes,
    dtypes and strides; the times go to a JSON cache on disk (``cache_path``, by
    default under ``$MAGIS_CACHE_DIR`` or ``~/.cache/magis``), so a second run
    measures nothing. On CPU the whole step runs in place and each instruction is
    timed where it stands (:func:`~magis.cost.op_timing.measure_in_step`: at least
    ``2 x repeats`` runs after a warm-up; ``getitem`` s, views and the runtime's loop
    included), which is what the runtime pays: isolated operators run 10-20% faster
    than inside a step. Each step also binds its inputs (:attr:`runtime_costs`,
    measured once and kept in the same cache; the binding is spread over the input
    nodes). An operator the step could not time is
    timed alone (fastest of ``repeats`` samples after a warm-up, in turns with its
    neighbours), plus the runtime's own work around the call. On CUDA the operators
    are timed alone; the host's work runs while earlier kernels execute, and is not
    added. An
    operator that cannot be run (an abstract target, or one that fails) is priced by
    an :class:`AnalyticCostModel` over a crude roofline of this device, itself
    measured once and cached.

    With ``estimate_unseen``, a graph holding operators never timed is priced without
    timing anything once this instance has priced one graph: each such operator is
    estimated from its kin (:class:`~magis.cost.kin.KinTimes`: the same operator
    on other shapes in a graph priced before, its time scaled by the roofline). This is
    what a search with a time budget wants on a CPU, where timing a graph runs the
    whole step ten times: the parts of a fissioned step differ from the captured step
    only in their batch dimension, and cost a few microseconds to price instead of
    seconds (:attr:`estimated` counts the operators priced so). The first graph (the
    captured step) is always timed.
    """

    def __init__(
        self,
        device: str = "cpu",
        cache_path: Path | None = None,
        repeats: int = 5,
        progress: bool = True,
        estimate_unseen: bool = False,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"can only profile on cpu or cuda, not {device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"CUDA is not available here: use a device profile ({', '.join(DEVICE_PROFILES)})")
        self.cache = LatencyCache(cache_path or default_cache_path(self.device))
        self.repeats = repeats
        #: runs of a step timed in place: twice the samples of an operator timed alone, whose
        #: fastest sample counts, since the mean of an instruction's samples is the figure here
        self.in_step_runs = 2 * repeats
        self.progress = progress
        self.estimate_unseen = estimate_unseen
        #: the node times of every graph this instance measured (or read from the cache)
        self.kin = KinTimes()
        #: operators this instance timed (not counting the roofline benchmark).
        self.measurements = 0
        #: operators this instance estimated from their kin instead of timing them
        self.estimated = 0
        #: where each kin was timed (its graph, node and replayed strides), to time it alone
        self._kin_sources: dict[str, tuple[Graph, str, dict[str, NodeStrides]]] = {}
        self._graph_seconds: WeakKeyDictionary[Graph, dict[str, float]] = WeakKeyDictionary()
        self._fallback: AnalyticCostModel | None = None
        #: id(node) -> (node, its inputs' nodes and layouts, its op key): the graphs a search
        #: prices share almost all their nodes, and a node's key depends on these alone
        self._op_keys: dict[int, tuple[Node, tuple[tuple[Node, NodeStrides], ...], str]] = {}

    def node_seconds(self, graph: Graph, name: str) -> float:
        seconds = self._graph_seconds.get(graph)
        if seconds is None:
            seconds = self._graph_seconds[graph] = self._price(graph)
        return seconds[name]

    @property
    def fallback(self) -> AnalyticCostModel:
        """The analytic model for operators that cannot be measured."""
        if self._fallback is None:
            stored = self.cache.device_profile
            if stored is None:
                profile = measure_device_profile(self.device, self.repeats)
                self.cache.device_profile = asdict(profile)
                self.cache.save()
            else:
                profile = DeviceProfile(**stored)
            self._fallback = AnalyticCostModel(profile)
        return self._fallback

    @property
    def runtime_costs(self) -> RuntimeCosts:
        """The runtime's own costs: measured on CPU once
        (:func:`magis.cost.runtime_costs.measure_runtime_costs`) and cached; none on CUDA."""
        if self.device.type != "cpu":
            return RuntimeCosts(instruction_s=0.0, getitem_s=0.0, lookup_s=0.0, input_s=0.0)
        if self.cache.runtime_costs is None:
            self.cache.runtime_costs = asdict(measure_runtime_costs(self.device))
            self.cache.save()
        return RuntimeCosts(**self.cache.runtime_costs)

    def time_steps(self, steps: Sequence[tuple[Graph, Sequence[str]]], max_seconds: float) -> StepsTimed:
        """Seconds each of ``steps`` (a graph, the order it runs in) takes as a plan runs it,
        binding its inputs included, the steps timed in turns at this moment
        (:func:`~magis.cost.op_timing.measure_steps`, for at most about ``max_seconds``).

        Raises :class:`CannotTime` on CUDA (operators are timed alone there), for a step
        whose peak is above :data:`IN_STEP_MEMORY_SHARE` of this machine's memory, or one
        that fails to run on random inputs.
        """
        if self.device.type != "cpu":
            raise CannotTime(f"steps are timed whole on a CPU only, not on {self.device.type}")
        memory = host_memory_bytes()
        if any(peak_memory(graph, order) > IN_STEP_MEMORY_SHARE * memory for graph, order in steps):
            raise CannotTime("a step needs too much of this machine's memory to be timed here")
        replayed = [(graph, order, replay_strides(graph)) for graph, order in steps]
        try:
            timed = measure_steps(replayed, self.device, self.in_step_runs, max_seconds)
        except Exception as err:  # any step that cannot run here is left to its estimate
            raise CannotTime(f"a step could not run on random inputs ({err})") from err
        binding = [binding_seconds(graph, self.runtime_costs) for graph, _ in steps]

        def bound(times: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(t + b for t, b in zip(times, binding))

        return replace(timed, seconds=bound(timed.seconds), samples=tuple(map(bound, timed.samples)))

    def _price(self, graph: Graph) -> dict[str, float]:
        """Seconds of every node of ``graph``: the operators not cached yet are timed
        (in their step, then alone), or estimated from their kin (class docstring)."""
        strides = replay_strides(graph)
        keys = self._keys(graph, strides)
        step_keys = self._step_keys(graph, keys)
        unseen = {
            name
            for name in keys.keys() | step_keys.keys()
            if step_keys.get(name) not in self.cache.in_step and keys.get(name) not in self.cache.ops
        }
        estimates: dict[str, float] = {}
        if unseen and self.estimate_unseen and self.kin:
            estimates = {name: self._kin_estimate(graph, name, keys) for name in unseen}
            estimates.update(self._checked_estimates(graph, keys, strides, estimates))
        else:
            self._measure_in_step(graph, step_keys, strides)
            alone = {name: key for name, key in keys.items() if step_keys.get(name) not in self.cache.in_step}
            self._measure(graph, alone, strides)
        seconds = self._node_times(graph, keys, step_keys, estimates)
        if self.estimate_unseen and not estimates:  # only measured times are kin, never estimates
            for name in keys.keys() | step_keys.keys():
                kin_key = node_key(graph, name, keys)
                if kin_key is not None:
                    self.kin.add(kin_key, self.fallback.node_seconds(graph, name), seconds[name])
                    self._kin_sources.setdefault(kin_key, (graph, name, strides))
        return seconds

    def _keys(self, graph: Graph, strides: dict[str, NodeStrides]) -> dict[str, str]:
        """:func:`~magis.cost.op_keys.op_key` of every measurable node of ``graph``, each made
        once per node and layout of its inputs (on a GRU unrolled to 5,000 nodes, making them
        anew took half of the search's pricing). The memory of them is forgotten past
        :data:`OP_KEYS_HELD` nodes, so that a long search holds no more."""
        if len(self._op_keys) > OP_KEYS_HELD:
            self._op_keys.clear()
        keys: dict[str, str] = {}
        for node in graph.nodes:
            if not measurable(node):
                continue
            inputs = tuple((graph[name], strides[name]) for name in node.inputs)
            known = self._op_keys.get(id(node))
            if (
                known is not None
                and known[0] is node
                and all(a is b and a_strides == b_strides for (a, a_strides), (b, b_strides) in zip(known[1], inputs))
            ):
                keys[node.name] = known[2]
                continue
            keys[node.name] = op_key(graph, node.name, strides)
            self._op_keys[id(node)] = (node, inputs, keys[node.name])
        return keys

    def _checked_estimates(
        self, graph: Graph, keys: dict[str, str], strides: dict[str, NodeStrides], estimates: dict[str, float]
    ) -> dict[str, float]:
        """The estimates above :data:`CHECK_ESTIMATE_S` made again: the kin's time in its step
        scaled by the ratio of the two operators timed alone, instead of by the roofline. A
        roofline keeps the efficiency of a kernel whatever its shape, but half a matrix product
        on a CPU runs below the whole's flop rate (GPT-Neo small's vocabulary head split in two
        rows: 8-12% slower per flop), and an operator whose nearest kin has another layout or
        access pattern (an embedding of half the rows) can be off several times. Timing both
        alone takes a few runs of each distinct shape (a step repeats its layers' shapes), not
        ten runs of the step."""
        checked: dict[str, float] = {}
        kinless: list[tuple[str, str, float]] = []
        measured_before = self.measurements
        for name, estimate in estimates.items():
            key = keys.get(name)
            if key is None:
                continue
            analytic = self.fallback.node_seconds(graph, name)
            kin = self.kin.nearest(key, analytic)
            if kin is None:
                kinless.append((name, key, analytic))
                continue
            source = self._kin_sources.get(kin)
            if estimate < CHECK_ESTIMATE_S or source is None:
                continue
            alone, kin_alone = self._time_alone(key, graph, name, strides), self._time_alone(kin, *source)
            if alone and kin_alone:
                checked[name] = self.kin.estimates[key] = self.kin.seconds(kin) * alone / kin_alone
        # an operator of a form never timed (a rewrite's in-place relu_, a 1x1 convolution's mm):
        # the roofline at the median ratio of measured to analytic times can be far off (SwiftNet's
        # every-free-rewrite plan, 0.62 of eager's forward, was priced 1.43), so it is timed alone,
        # as an operator a step cannot time is, and becomes the kin of its other shapes
        for name, key, _ in kinless:
            alone = self._time_alone(key, graph, name, strides)
            if alone is not None:
                checked[name] = alone + self.runtime_costs.instruction_s
        for name, key, analytic in kinless:
            if name in checked:
                self.kin.add(key, analytic, checked[name])
        if self.measurements > measured_before:
            self.cache.save()
        return checked

    def _time_alone(self, key: str, graph: Graph, name: str, strides: dict[str, NodeStrides]) -> float | None:
        """Seconds node ``name`` of ``graph`` (operator ``key``) takes alone, timed once per key
        on this machine (the cache's ``alone`` times, :class:`~magis.cost.timing_cache.LatencyCache`)."""
        cached = self.cache.ops.get(key)
        if cached is not None:
            return cached
        if key not in self.cache.alone:
            self.cache.alone[key] = next(measure_nodes(graph, [name], strides, self.device, self.repeats))[1]
            self.measurements += 1
        return self.cache.alone[key]

    def _step_keys(self, graph: Graph, keys: dict[str, str]) -> dict[str, str]:
        """On CPU, the key of each node's time in its step (:func:`~magis.cost.op_keys.in_step_key`),
        for the nodes that have one; none on CUDA, where operators are timed alone."""
        if self.device.type != "cpu":
            return {}
        context = step_context(graph.signature)
        step_keys: dict[str, str] = {}
        for node in graph.nodes:
            key = None if node.is_input else in_step_key(graph, node.name, keys, context)
            if key is not None:
                step_keys[node.name] = key
        return step_keys

    def _kin_estimate(self, graph: Graph, name: str, keys: dict[str, str]) -> float:
        """The seconds of node ``name``, never timed, from its kin (:class:`~magis.cost.kin.KinTimes`)."""
        kin_key = node_key(graph, name, keys)
        assert kin_key is not None  # every unseen node has a key
        self.estimated += 1
        return self.kin.estimate(kin_key, self.fallback.node_seconds(graph, name))

    def _node_times(
        self, graph: Graph, keys: dict[str, str], step_keys: dict[str, str], estimates: dict[str, float]
    ) -> dict[str, float]:
        """Seconds of every node, the runtime's work included, from the cache and ``estimates``:
        an input its share of binding the step, a node timed in its step that time (the loop
        around it included), any other node its time alone plus the runtime's per instruction."""
        runtime = self.runtime_costs
        in_step = {name: self.cache.in_step[key] for name, key in step_keys.items() if key in self.cache.in_step}
        inputs = sum(1 for node in graph.nodes if node.is_input)
        input_share = binding_seconds(graph, runtime) / inputs if inputs else 0.0
        seconds = {}
        for node in graph.nodes:
            if node.is_input:
                seconds[node.name] = input_share
            elif node.name in estimates:
                seconds[node.name] = estimates[node.name]
            elif node.name in in_step and _delegated_seconds(graph, node, self) is None:
                seconds[node.name] = in_step[node.name]
            elif node.target is operator.getitem:
                seconds[node.name] = runtime.getitem_s + runtime.instruction_s
            else:
                seconds[node.name] = self._seconds(graph, node, keys.get(node.name)) + runtime.instruction_s
        return seconds

    def _seconds(self, graph: Graph, node: Node, key: str | None) -> float:
        """An operator's (or a region's) own work timed alone, without the runtime's cost per instruction."""
        delegated = _delegated_seconds(graph, node, self)
        if delegated is not None:
            return delegated
        measured = self.cache.ops.get(key) if key is not None else None
        return measured if measured is not None else self.fallback.node_seconds(graph, node.name)

    def _measure_in_step(self, graph: Graph, step_keys: dict[str, str], strides: dict[str, NodeStrides]) -> None:
        """Time the step in place (:func:`~magis.cost.op_timing.measure_in_step`) when it
        holds a key not cached yet; a key's time is the mean over the nodes that share it.

        A step that cannot run here (an operator that fails on random inputs, a peak
        above :data:`IN_STEP_MEMORY_SHARE` of this machine's memory) is left to the
        operators' isolated times.
        """
        if all(key in self.cache.in_step for key in step_keys.values()):
            return
        order = [node.name for node in graph.nodes]
        if peak_memory(graph, order) > IN_STEP_MEMORY_SHARE * host_memory_bytes():
            log.info("the step needs too much memory to run here: timing its operators alone")
            return
        bar = tqdm(
            total=self.in_step_runs,
            desc=f"magis: timing the step's {len(graph)} nodes in place",
            unit="run",
            leave=False,
            disable=not self.progress or len(step_keys) < PROGRESS_MIN_OPS,
        )
        try:
            times = measure_in_step(graph, strides, self.device, self.in_step_runs, on_run=bar.update)
        except Exception as err:  # any step that cannot run here is priced by its operators timed alone
            log.info("could not run the step in place (%s): timing its operators alone", err)
            return
        finally:
            bar.close()
        by_key: dict[str, list[float]] = {}
        for name, key in step_keys.items():
            if key not in self.cache.in_step:
                by_key.setdefault(key, []).append(times.seconds[name])
        self.cache.in_step.update((key, sum(ts) / len(ts)) for key, ts in by_key.items())
        if not times.quiet:  # priced by them in this process, timed again by the next
            self.cache.unsaved.update(by_key)
            warnings.warn(
                f"magis: other processes kept this machine's cores busy while the step's {len(graph)} nodes were "
                "timed in place, so its latency estimates may be far off (torch's threads wait on each other's "
                "turns): these times are used now and not kept; optimize on a quiet machine for a faithful plan",
                stacklevel=2,
            )
        self.measurements += len(by_key)
        self.cache.save()

    def _measure(self, graph: Graph, keys: dict[str, str], strides: dict[str, NodeStrides]) -> None:
        """Time every operator of ``keys`` whose key is not cached yet, then save the cache."""
        todo = {key: name for name, key in keys.items() if key not in self.cache.ops}
        if not todo:
            return
        bar = tqdm(
            total=len(todo),
            desc=f"magis: timing operators on {self.device}",
            unit="op",
            leave=False,
            disable=not self.progress or len(todo) < PROGRESS_MIN_OPS,
        )
        try:
            for name, seconds in measure_nodes(graph, list(todo.values()), strides, self.device, self.repeats):
                self.cache.ops[keys[name]] = seconds
                self.measurements += 1
                bar.update()
        finally:
            bar.close()
            self.cache.save()


class RewriteFamilyCostModel:
    """``model``'s node times remembered per :class:`~magis.ir.graph.Node` object, for a
    family of graphs rewritten from one another by rules that add nodes under fresh names
    and rewire readers, but never change what a name holds (recomputation and swapping:
    :mod:`magis.search.rule_front`). There a node object costs the same in every graph of
    the family: its inputs, read by name, keep their shapes and storages. A fissioned graph
    reuses names at other shapes: price it with ``model`` itself.

    The greedy that owns one prices thousands of nodes per candidate, almost all of them
    the same objects as in the candidate before; this is what keeps a round at paper size fast.
    """

    def __init__(self, model: CostModel) -> None:
        self.model = model
        #: id(node) -> (node, seconds): the node is held so that its id stays its own
        self._seconds: dict[int, tuple[Node, float]] = {}

    def node_seconds(self, graph: Graph, name: str) -> float:
        node = graph[name]
        known = self._seconds.get(id(node))
        if known is not None and known[0] is node:
            return known[1]
        seconds = self.model.node_seconds(graph, name)
        self._seconds[id(node)] = (node, seconds)
        return seconds


def has_device_memory(model: CostModel) -> bool:
    """Whether ``model`` prices a device whose memory is not host memory (a GPU, measured
    or profiled): only there does swapping to host memory free anything."""
    if isinstance(model, ProfiledCostModel):
        return model.device.type == "cuda"
    return isinstance(model, AnalyticCostModel) and model.profile.sm_count > 0


def cost_model(
    device: str | None = None, estimate_unseen: bool = False, progress: bool = True, fused: bool = False
) -> CostModel:
    """The cost model for ``device``: ``"cpu"``/``"cuda"`` are profiled on this machine,
    a :data:`DEVICE_PROFILES` name (``"h200"``, ``"a100"``...) is analytic; ``None`` is ``"cpu"``.
    ``estimate_unseen``: a profiled model prices operators it has not timed from their kin
    once it has timed a graph (:class:`ProfiledCostModel`; what a search with a time budget
    wants). ``progress``: a profiled model shows a bar while it times operators. ``fused``:
    an analytic model prices chains of pointwise ops as the fused kernels a compiled step
    runs (:attr:`AnalyticCostModel.fused`); a profiled one prices each operator as timed (on
    this CPU Inductor's fused pointwise chains run about as fast as eager's ops: docs/design.md).

    An analytic model uses TF32 for fp32 matmuls and convolutions as this process's
    PyTorch settings say (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``).
    """
    name = (device or "cpu").lower()
    if name in ("cpu", "cuda"):
        return ProfiledCostModel(name, progress=progress, estimate_unseen=estimate_unseen)
    if name in DEVICE_PROFILES:
        return AnalyticCostModel(
            DEVICE_PROFILES[name],
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_conv=torch.backends.cudnn.allow_tf32,
            fused=fused,
        )
    raise ValueError(f"unknown device {device!r}: use one of {', '.join(['cpu', 'cuda', *DEVICE_PROFILES])}")
