"""Compiled plans (issue #30): the generated step with its maximal segments of aten ops compiled by Inductor.

A plan decides where memory goes: which tensors are freed when, which are recomputed
(copies of their ops placed late), which go to host memory and back (Store and Load),
which sub-graphs run part by part (regions). :func:`compiled_segments` finds the runs
of consecutive instructions that a compiler may fuse without undoing those decisions:

- only functional aten ops (and ``getitem``) join a segment; a region, a transfer, an
  optimizer's update, an op that writes in place or draws random numbers (its mask must
  be eager's) ends it and runs as generated code; a region's loop stays a loop, and the
  program of one part has segments of its own, called once per part (the parts have one
  shape), each ending at a part's output, which is put in place as soon as it is made;
- the instructions where the plan's memory is near its peak (:data:`PEAK_SHARE`) join
  no segment that is not tried first: Inductor orders the kernels of a segment itself and
  may hold a result a little longer than the plan's ops do (tiny U-Net on CPU: 4.6% of the
  peak, at a chain of convolution backwards), and near a peak that is over the limit. A
  trial meters both ways as the allocator counts (Inductor's buffers included) and keeps
  the compiled code only where it holds no more, so segments that are tried may run
  through the peak (``near_peak``); where one loses, the runs between its near-peak
  instructions are tried instead (:func:`magis.plan.generated_step`);
- a recomputed copy of an op starts a new segment: Inductor would merge it with the
  original (common subexpressions) and keep the tensor the plan recomputes to free;
- a segment of fewer than :data:`MIN_SEGMENT_OPS` ops is not worth a compiled call.

Each :class:`CompiledSegment` is an fx graph of its ops (inputs: the values made
before it; outputs: the values read after it), compiled with
``torch._inductor.compile`` on its first call (the plan's shapes are static), with
``fallback_random`` so any random op kept inside draws as eager does, and without
Inductor's layout optimization: that lays convolutions out channels-last inside the
segment (copies the simulator does not count) and hands their results on so, to ops
timed on eager's layouts (on this CPU, with it, ResNet-50 small's compiled backward ran
11% slower than its ops as they are; without it, 3% faster). A segment may first be
tried (:meth:`CompiledSegment.faster_compiled`, a :class:`Trial`) and kept compiled only
where it wins on time without holding more memory. It takes its
inputs as one list, which the compiled code empties and then frees each input after
its last reader (Inductor's boxed calling convention, asked for by the fx graph's one
boxed placeholder, :func:`magis.ir.fx.fx_module`), so a value whose last use is inside
the segment dies there, as the plan has it. The generated step (:mod:`magis.backend.codegen`) calls it in place of
its instructions.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from magis.backend.meter import allocator_meter
from magis.backend.program import Instruction, Program
from magis.ir.fx import fx_module
from magis.ir.graph import Graph, Ref

#: an instruction after which the plan's live memory is at least this share of its peak joins no segment
PEAK_SHARE = 0.9
#: bytes a compiled segment may allocate above its ops' peak while it runs: its kernels' own
#: scratch, which the allocator's meter counts (4 KiB in BERT small's segments on a CPU)
KERNEL_SCRATCH = 64 * 1024
#: a whole compiled step may allocate at most this share of its generated code's peak above its
#: inputs more (and no more than :data:`KERNEL_SCRATCH`): on a tiny plan 64 KiB is several percent
#: of its peak (tiny U-Net's at 0.8, all seven segments compiled: 32 KiB, 1.7%)
STEP_SCRATCH_SHARE = 0.01
#: fewest aten ops worth a compiled call
MIN_SEGMENT_OPS = 3
_VIEW_AS_RESHAPE = {torch.ops.aten.view.default: torch.ops.aten.reshape.default}


def compilable(ins: Instruction) -> bool:
    """A functional aten op (or the ``getitem`` of one's results) that draws no random numbers."""
    if ins.fn is operator.getitem:
        return True
    if not isinstance(ins.fn, torch._ops.OpOverload) or ins.fn.namespace not in ("aten", "prims"):
        return False
    schema = ins.fn._schema
    return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in ins.fn.tags


#: times functions in turns: the fastest seconds of each (:func:`magis.cost.op_timing.time_calls`)
Timer = Callable[[Sequence[Callable[[], Any]]], Sequence[float]]


@dataclass(frozen=True)
class Trial:
    """A segment run compiled and as its ops on the same inputs: the fastest seconds of each,
    timed in turns by a :data:`Timer`, and the peak bytes each allocates above its
    inputs, as the allocator counts them (:class:`~magis.backend.meter.CpuAllocatorMeter`,
    :class:`~magis.backend.meter.CudaPeakMeter`: Inductor's own buffers included), and
    the bytes its outputs hold once it returns.

    A whole step is timed otherwise (:func:`magis.plan.generated_step`): in paired rounds,
    ``compiled_s`` and ``ops_s`` the medians, ``ratio`` the mean of the rounds' compiled / ops
    and ``ratio_error`` its standard error. A step of seconds moves by a few percent from one
    run to the next on a CPU, more than its compiled segments save on a convolutional network,
    so the fastest of a few runs is a coin toss there: U-Net small's plan at 0.8, compiled,
    won its trial by 4% that way, and ran 3% slower than as generated code in the yardstick's
    rounds (2026-11-29)."""

    compiled_s: float
    ops_s: float
    compiled_peak: int
    ops_peak: int
    compiled_held: int  # bytes of the storages its outputs keep (a view keeps its whole buffer)
    ops_held: int
    #: whether its outputs come out laid out as its ops lay them out: the ops after it were timed
    #: on those (Inductor's layout optimization hands convolutions' results on channels-last)
    same_layouts: bool = True
    ratio: float | None = None  # timed in paired rounds (a whole step): compiled / ops, their mean
    ratio_error: float = 0.0
    scratch: int = KERNEL_SCRATCH  # bytes the compiled run may allocate above the ops' peak

    @property
    def compiled_wins(self) -> bool:
        """Faster compiled (timed in rounds: by more than the rounds' standard error), holding
        no more memory while it runs (but its :attr:`scratch`) nor after, its results laid
        out as the ops lay them out."""
        return self.why_not_compiled is None

    @property
    def why_not_compiled(self) -> str | None:
        """Why the ops run as they are (the first of :attr:`compiled_wins`' conditions that
        fails, in words), or None where the compiled code wins."""
        if not self.same_layouts:
            return "its results come out in other layouts than its ops give them"
        if self.ratio is None and self.compiled_s >= self.ops_s:
            return f"not faster ({self.compiled_s:.3g} s compiled, {self.ops_s:.3g} s as its ops)"
        if self.ratio is not None and self.ratio + self.ratio_error >= 1:
            return f"not clearly faster ({self.ratio:.3f} +- {self.ratio_error:.3f} of its time as its ops)"
        if self.compiled_peak > self.ops_peak + self.scratch:
            more = self.compiled_peak - self.ops_peak
            return f"it allocates {more} bytes more than its ops at its peak ({self.scratch} allowed)"
        if self.compiled_held > self.ops_held:
            return f"its results hold {self.compiled_held - self.ops_held} bytes more than its ops' results"
        return None

    @staticmethod
    def of(
        compiled: Callable[[list[Any]], Any], ops: Callable[[list[Any]], Any], args: Sequence[Any], timer: Timer
    ) -> Trial:
        """The trial of ``compiled`` against ``ops`` on ``args``, timed by ``timer``."""
        compiled_s, ops_s = timer([lambda: compiled(list(args)), lambda: ops(list(args))])
        return Trial.metered(compiled, ops, args, compiled_s, ops_s)

    @staticmethod
    def metered(
        compiled: Callable[[list[Any]], Any],
        ops: Callable[[list[Any]], Any],
        args: Sequence[Any],
        compiled_s: float,
        ops_s: float,
        ratio: float | None = None,
        ratio_error: float = 0.0,
        scratch_share: float | None = None,
    ) -> Trial:
        """The trial of ``compiled`` against ``ops`` timed as given: each run once more on
        ``args``, metered, for its peak, the bytes its outputs hold and their layouts; with
        ``scratch_share``, the compiled run may allocate at most that share of the ops' peak
        more (:data:`KERNEL_SCRATCH` at most)."""
        # a whole step's args are one mapping of its inputs: the device is read from the leaves (read
        # from ``args`` alone, a CUDA step was metered by the CPU's allocator, which saw none of it)
        device = next((a.device for a in tree_leaves(list(args)) if isinstance(a, torch.Tensor) and a.is_cuda), None)
        peaks, held, layouts = {}, {}, {}
        for run in (compiled, ops):
            with allocator_meter(device) as meter:
                outputs = run(list(args))
            peaks[run] = meter.peak_bytes
            tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
            storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
            held[run] = int(sum(storages.values()))
            layouts[run] = [t.stride() for t in tensors]
            del outputs, tensors
        return Trial(
            compiled_s,
            ops_s,
            peaks[compiled],
            peaks[ops],
            held[compiled],
            held[ops],
            layouts[compiled] == layouts[ops],
            ratio,
            ratio_error,
            KERNEL_SCRATCH if scratch_share is None else min(KERNEL_SCRATCH, int(scratch_share * peaks[ops])),
        )


@dataclass(eq=False)
class CompiledSegment:
    """Instructions ``start..stop`` of a program as one compiled call (module docstring).

    ``inputs`` are the values it reads that were made before it, ``dying`` those of them
    whose last reader is inside it, ``outputs`` the values it makes that are read after
    it (or are the graph's outputs)."""

    start: int
    stop: int
    inputs: tuple[str, ...]
    dying: tuple[str, ...]
    outputs: tuple[str, ...]
    first_op: str  # the node of its first instruction (where a report points)
    module: torch.fx.GraphModule = field(repr=False)
    #: per output, None for a tensor, else the elements of a tuple-valued op: the index of each
    #: in the module's flat outputs, None for a missing optional one (Inductor returns tensors)
    layout: tuple[tuple[int | None, ...] | None, ...] = ()
    compiled: Any = field(default=None, repr=False)
    #: why Inductor could not compile it (it then runs its ops as they are), or None
    fallback: str | None = None
    #: how it ran compiled and as its ops, where :meth:`faster_compiled` tried it
    trial: Trial | None = None

    @property
    def ops(self) -> int:
        return self.stop - self.start

    def __call__(self, args: list[Any]) -> tuple[Any, ...]:
        """The segment's outputs; ``args`` (its inputs, in order) is emptied as they are read."""
        if self.compiled is None:
            try:
                self.compiled = _inductor_compile(self.module, args)
            except Exception as err:  # any compiler failure: the ops run as they are
                self.fallback = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                self.compiled = self.module
        flat = self.compiled(args)
        return tuple(
            flat[at] if elements is None else tuple(None if i is None else flat[i] for i in elements)
            for at, elements in zip(self._positions, self.layout)
        )

    def faster_compiled(self, args: Sequence[Any], timer: Timer) -> bool:
        """Whether the segment, compiled, runs faster than its ops run as they are and holds no
        more memory than they do (:class:`Trial`, on ``args``: inputs like its own, left as
        they are); one Inductor cannot compile is not. The trial is compiled for ``args``'
        layouts; the segment itself still compiles on its first call, for its inputs'
        (Inductor's cache makes that quick where they agree). Inside a profiler the caller runs,
        a CPU trial cannot meter (its meter reads the profiler): the ops run as they are."""
        on_cpu = not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if on_cpu and torch.autograd.profiler._is_profiler_enabled:
            return False
        try:
            compiled = _inductor_compile(self.module, list(args))
        except Exception:  # as __call__ would fall back: the ops run as they are
            return False
        self.trial = Trial.of(compiled, self.module, args, timer)
        return self.trial.compiled_wins

    @cached_property
    def _positions(self) -> tuple[int, ...]:
        """Where each output starts in the module's flat outputs."""
        starts, at = [], 0
        for elements in self.layout:
            starts.append(at)
            at += 1 if elements is None else sum(i is not None for i in elements)
        return tuple(starts)


def compiled_segments(
    program: Program, live: Sequence[int], ends: Collection[str] = frozenset(), near_peak: bool = False
) -> tuple[CompiledSegment, ...]:
    """The program's maximal compilable runs (module docstring), each as an fx graph not yet
    compiled; ``live`` is the simulated live memory after each node of ``program.order``
    (:func:`magis.cost.memory.simulate_memory`'s timeline); a run ends at each of ``ends`` (a
    region part's outputs), which it returns whether or not anything reads them later. With
    ``near_peak`` the instructions near the peak join runs too: for segments that a trial
    meters before they are kept (:meth:`CompiledSegment.faster_compiled`)."""
    segments = []
    for begin, end in _runs(program, live, ends, near_peak):
        body = program.instructions[begin:end]
        if sum(ins.fn is not operator.getitem for ins in body) >= MIN_SEGMENT_OPS:
            segments.append(_segment(program.graph, body, begin, end, ends))
    return tuple(segments)


def _runs(program: Program, live: Sequence[int], ends: Collection[str], near_peak: bool) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of compilable instructions (away from the peaks unless
    ``near_peak``), cut after each of ``ends`` and before a recomputed copy of an op of the
    same run (module docstring)."""
    position = {name: i for i, name in enumerate(program.order)}
    peak = math.inf if near_peak else max(live, default=0)
    runs: list[tuple[int, int]] = []
    start: int | None = None
    seen: set[str] = set()  # the calls of the open run

    def close(end: int) -> None:
        nonlocal start
        if start is not None:
            runs.append((start, end))
        start = None
        seen.clear()

    for i, ins in enumerate(program.instructions):
        if not compilable(ins) or live[position[ins.node]] >= PEAK_SHARE * peak:
            close(i)  # runs as generated code
            continue
        call = repr((ins.fn, ins.args, ins.kwargs))
        if call in seen:  # a recomputed copy of an op of this run: Inductor would merge the two
            close(i)
        start = i if start is None else start
        seen.add(call)
        if ins.node in ends:
            close(i + 1)  # a part's output ends its segment
    close(len(program.instructions))
    return runs


def _segment(graph: Graph, body: Sequence[Instruction], begin: int, end: int, ends: Collection[str]) -> CompiledSegment:
    """Instructions ``begin..end`` (``body``) as one segment: what it reads from before it, which
    of those die inside, what it makes that lives on or is one of ``ends``; a tuple-valued output
    leaves the fx graph element by element (Inductor returns tensors) and is put back together
    by :attr:`layout`."""
    made = {ins.node for ins in body}
    freed = {name for ins in body for name in ins.free}  # what dies inside (program.lower's frees)
    inputs = tuple(dict.fromkeys(r for ins in body for r in graph[ins.node].inputs if r not in made))
    dying = tuple(name for name in inputs if name in freed)
    outputs = tuple(ins.node for ins in body if ins.node not in freed or ins.node in ends)
    # Inductor's decompositions may lay an intermediate out otherwise than eager did, where a
    # view of it fails: a reshape is that view wherever the view is valid, a copy elsewhere
    calls = [(ins.node, _VIEW_AS_RESHAPE.get(ins.fn, ins.fn), ins.args, ins.kwargs) for ins in body]
    flat: list[str] = []
    layout: list[tuple[int | None, ...] | None] = []
    for name in outputs:
        if not graph[name].tuple_output:
            layout.append(None)
            flat.append(name)
            continue
        elements: list[int | None] = []
        for j, meta in enumerate(graph[name].outputs):
            elements.append(None if meta is None else len(flat))
            if meta is not None:
                calls.append((f"{name}__{j}", operator.getitem, (Ref(name), j), {}))
                flat.append(f"{name}__{j}")
        layout.append(tuple(elements))
    module = fx_module(calls, inputs, flat, boxed=True)
    return CompiledSegment(begin, end, inputs, dying, outputs, body[0].node, module, tuple(layout))


def _inductor_compile(module: torch.fx.GraphModule, example: list[Any]) -> Any:
    """``module`` compiled by Inductor for inputs like ``example``; random ops as eager draws them."""
    import torch._inductor  # imported on first use: loading Inductor takes seconds

    return torch._inductor.compile(
        module, [list(example)], options={"fallback_random": True, "layout_optimization": False}
    )
