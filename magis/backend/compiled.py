"""Compiled plans (issue #30): the generated step with its maximal segments of aten ops compiled by Inductor.

A plan decides where memory goes: which tensors are freed when, which are recomputed
(copies of their ops placed late), which go to host memory and back (Store and Load),
which sub-graphs run part by part (regions). :func:`compiled_segments` finds the runs
of consecutive instructions that a compiler may fuse without undoing those decisions:

- only functional aten ops (and ``getitem``) join a segment; a region, a transfer, an
  optimizer's update, an op that writes in place or draws random numbers (its mask must
  be eager's) ends it and runs as generated code;
- a segment ends where the plan's memory peaks (:data:`PEAK_SHARE`): Inductor orders
  the kernels of a segment itself, and a peak is where an order change costs memory;
- a recomputed copy of an op starts a new segment: Inductor would merge it with the
  original (common subexpressions) and keep the tensor the plan recomputes to free;
- a segment of fewer than :data:`MIN_SEGMENT_OPS` ops is not worth a compiled call.

Each :class:`CompiledSegment` is an fx graph of its ops (inputs: the values made
before it; outputs: the values read after it), compiled with
``torch._inductor.compile`` on its first call (the plan's shapes are static), with
``fallback_random`` so any random op kept inside draws as eager does. It takes its
inputs as one list, which the compiled code empties and then frees each input after
its last reader (Inductor's boxed calling convention, asked for by the fx graph's one
boxed placeholder, :func:`magis.ir.fx.fx_module`), so a value whose last use is inside
the segment dies there, as the plan has it. The generated step (:mod:`magis.backend.codegen`) calls it in place of
its instructions.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from magis.backend.program import Instruction, Program
from magis.ir.fx import fx_module
from magis.ir.graph import Graph, Ref

#: a segment ends after an instruction where the plan's live memory is within this share of its peak
PEAK_SHARE = 0.97
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
    module: torch.fx.GraphModule = field(repr=False)
    #: per output, None for a tensor, else the elements of a tuple-valued op: the index of each
    #: in the module's flat outputs, None for a missing optional one (Inductor returns tensors)
    layout: tuple[tuple[int | None, ...] | None, ...] = ()
    compiled: Any = field(default=None, repr=False)
    #: why Inductor could not compile it (it then runs its ops as they are), or None
    fallback: str | None = None

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

    @cached_property
    def _positions(self) -> tuple[int, ...]:
        """Where each output starts in the module's flat outputs."""
        starts, at = [], 0
        for elements in self.layout:
            starts.append(at)
            at += 1 if elements is None else sum(i is not None for i in elements)
        return tuple(starts)


def compiled_segments(program: Program, live: Sequence[int]) -> tuple[CompiledSegment, ...]:
    """The program's maximal compilable runs (module docstring), each as an fx graph not yet
    compiled; ``live`` is the simulated live memory after each node of ``program.order``
    (:func:`magis.cost.memory.simulate_memory`'s timeline)."""
    segments = []
    for begin, end in _runs(program, live):
        body = program.instructions[begin:end]
        if sum(ins.fn is not operator.getitem for ins in body) >= MIN_SEGMENT_OPS:
            segments.append(_segment(program.graph, body, begin, end))
    return tuple(segments)


def _runs(program: Program, live: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of compilable instructions, cut at the peaks and before a
    recomputed copy of an op of the same run (module docstring)."""
    position = {name: i for i, name in enumerate(program.order)}
    peak = max(live, default=0)
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
        if not compilable(ins):
            close(i)
            continue
        call = repr((ins.fn, ins.args, ins.kwargs))
        if call in seen:  # a recomputed copy of an op of this run: Inductor would merge the two
            close(i)
        start = i if start is None else start
        seen.add(call)
        if live[position[ins.node]] >= PEAK_SHARE * peak:
            close(i + 1)  # the peak instruction ends its segment
    close(len(program.instructions))
    return runs


def _segment(graph: Graph, body: Sequence[Instruction], begin: int, end: int) -> CompiledSegment:
    """Instructions ``begin..end`` (``body``) as one segment: what it reads from before it, which
    of those die inside, what it makes that lives on; a tuple-valued output leaves the fx graph
    element by element (Inductor returns tensors) and is put back together by :attr:`layout`."""
    made = {ins.node for ins in body}
    freed = {name for ins in body for name in ins.free}  # what dies inside (program.lower's frees)
    inputs = tuple(dict.fromkeys(r for ins in body for r in graph[ins.node].inputs if r not in made))
    dying = tuple(name for name in inputs if name in freed)
    outputs = tuple(ins.node for ins in body if ins.node not in freed)
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
    return CompiledSegment(begin, end, inputs, dying, outputs, module, tuple(layout))


def _inductor_compile(module: torch.fx.GraphModule, example: list[Any]) -> Any:
    """``module`` compiled by Inductor for inputs like ``example``; random ops as eager draws them."""
    import torch._inductor  # imported on first use: loading Inductor takes seconds

    return torch._inductor.compile(module, [list(example)], options={"fallback_random": True})
