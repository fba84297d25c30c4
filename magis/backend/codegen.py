"""A lowered program as generated Python: the plan's step without an interpreter (issue #30).

:func:`generate` writes a :class:`~magis.backend.program.Program` (one schedule of a
graph, its frees and its transfers' waits) as the source of one straight-line Python
function, compiles it once and returns it as a :class:`GeneratedStep`. Each instruction
is one call with its arguments spelled out (``mm_3 = aten.mm.default(view_2, t_1)``);
each free is a ``del`` right after the last reader, so the memory follows the
simulator's timeline as the interpreter's does (:func:`magis.backend.interpreter.execute`);
a fissioned region (a :class:`PartLoop` target, MAGIS §4.2) becomes a ``for`` loop over
its parts, each part's body inlined, its results allocated when the first part makes
them and every part's piece written into place (or added in) as soon as it is made.

What the interpreter pays per instruction (mapping the arguments' references through
a dict, a generic call, a loop over the frees) is gone; what remains is the Python call
of each aten op, as in an eager forward. The interpreter stays for what needs a clock
around every instruction (:func:`magis.cost.op_timing.measure_in_step`).

The generated step reads its inputs from ``env`` and writes the graph's outputs into
it, like :func:`~magis.backend.interpreter.execute`; ``streams`` is the side stream of a
program that swaps on CUDA (:class:`~magis.backend.transfer.TransferStreams`), or None.
"""

from __future__ import annotations

import builtins
import keyword
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from magis.backend.interpreter import transfer_streams
from magis.backend.kernels import runtime_kernel
from magis.backend.program import Instruction, Program
from magis.backend.transfer import Load, Store
from magis.ir.graph import Ref, op_name

if TYPE_CHECKING:  # a segment is a Segment here; only the whole-step trial's type is compiled's
    from magis.backend.compiled import Trial


@runtime_checkable
class PartLoop(Protocol):
    """A target that runs one part's program ``parts`` times (a fissioned region,
    :class:`magis.rules.fission.FissionRegion`): inputs cut along ``slice_dims``, the
    part's outputs (``part_outputs``) written into their slice of a result along
    ``concat_dims``, or summed where that is None."""

    parts: int
    slice_dims: tuple[int | None, ...]
    concat_dims: tuple[int | None, ...]

    @property
    def part_program(self) -> Program: ...  # one part, its results dying at their last use

    @property
    def part_outputs(self) -> tuple[str, ...]: ...

    def result_strides(self, inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...], ...]: ...

    def empty_result(self, index: int, strides: tuple[tuple[int, ...], ...], like: torch.Tensor) -> torch.Tensor: ...


class Segment(Protocol):
    """Instructions ``start..stop`` of a program run as one call (a compiled segment,
    :class:`magis.backend.compiled.CompiledSegment`): called with the list of its
    ``inputs``, which it empties as it reads them, it returns its ``outputs``; ``dying``
    are the inputs whose last reader is inside it."""

    start: int
    stop: int
    inputs: tuple[str, ...]
    dying: tuple[str, ...]
    outputs: tuple[str, ...]

    def __call__(self, args: list[Any]) -> tuple[Any, ...]: ...


#: the segments of a program (the step's, or one part's of a region), each ending at the latest
#: at any of the named values (a part's outputs, put in place as soon as they are made)
SegmentsOf = Callable[[Program, frozenset[str]], Sequence[Segment]]


@dataclass(frozen=True)
class GeneratedStep:
    """A program's generated function; ``source`` is its Python text (readable, one line per op)."""

    program: Program = field(repr=False)
    source: str = field(repr=False)
    function: Callable[[dict[str, Any], Any], None] = field(repr=False)
    segments: tuple[Segment, ...] = ()  # called in place of their instructions, the regions' parts' included
    #: a compiled step timed whole against the step without its segments (``magis.plan.generated_step``)
    whole_trial: Trial | None = None

    def __call__(self, env: dict[str, Any]) -> dict[str, Any]:
        """Run the step on the bound inputs in ``env``; the graph's outputs are added to it."""
        streams = transfer_streams(self.program, env)
        with torch.no_grad():
            self.function(env, streams)
        return env


def runs_compiled_code(runtime: object) -> bool:
    """Whether ``runtime`` (a step runner, or a runtime's name) is generated code with compiled
    segments: code whose buffers only its allocator's meter sees (:mod:`magis.backend.meter`)."""
    return isinstance(runtime, GeneratedStep) and bool(runtime.segments)


def generate(program: Program, name: str = "step", segments: SegmentsOf | None = None) -> GeneratedStep:
    """The program as one compiled Python function (module docstring); ``segments`` gives the
    segments (:mod:`magis.backend.compiled`) of the step's program and of each region's part,
    each called in place of its instructions."""
    writer = _Writer(segments_of=segments)
    graph = program.graph
    body = _Block(writer, indent=1)
    local = {n: writer.variable(n) for n in graph.inputs}
    for n in graph.inputs:
        body.line(f"{local[n]} = env[{n!r}]")
    body.instructions(program.instructions, local, segments=writer.segments(program, frozenset()))
    for n in graph.outputs:
        if n not in graph.inputs:
            body.line(f"env[{n!r}] = {local[n]}")
    if program.swaps:
        body.line("if streams is not None:")
        body.line("    streams.finish()")
    source = f"def {name}(env, streams):\n" + "\n".join(body.lines) + "\n"
    namespace = dict(writer.globals)
    exec(compile(source, f"<magis generated {name}>", "exec"), namespace)
    return GeneratedStep(program, source, namespace[name], tuple(writer.made_segments))


@dataclass
class _Writer:
    """The names the generated source uses: one Python variable per value (unique across
    the nested parts of regions) and the globals it reads (ops, constants, regions)."""

    segments_of: SegmentsOf | None = None
    globals: dict[str, Any] = field(default_factory=lambda: {"aten": torch.ops.aten, "torch": torch})
    taken: set[str] = field(default_factory=lambda: {"env", "streams", "aten", "torch", *dir(builtins)})
    made_segments: list[Segment] = field(default_factory=list)
    _global_ids: dict[int, str] = field(default_factory=dict)

    def segments(self, program: Program, ends: frozenset[str]) -> dict[int, Segment]:
        """``program``'s segments by their first instruction (none without :attr:`segments_of`)."""
        found = self.segments_of(program, ends) if self.segments_of is not None else ()
        self.made_segments += found
        return {s.start: s for s in found}

    def variable(self, node: str) -> str:
        """A fresh variable named after ``node`` where its name is a Python identifier."""
        base = node if node.isidentifier() and not keyword.iskeyword(node) and not node.startswith("_") else "v"
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def constant(self, value: Any, prefix: str = "_k") -> str:
        """A global holding ``value`` (one per object)."""
        if id(value) not in self._global_ids:
            name = f"{prefix}{len(self._global_ids)}"
            self.globals[name] = value
            self._global_ids[id(value)] = name
        return self._global_ids[id(value)]

    def function(self, fn: Any) -> str:
        """How the source calls ``fn``: ``aten.op.overload`` for an aten op, else a global (eager's
        kernel where the op has a faster one on the device: :func:`~magis.backend.kernels.runtime_kernel`)."""
        fn = runtime_kernel(fn)
        if isinstance(fn, torch._ops.OpOverload) and str(fn).startswith("aten."):
            return str(fn)
        return self.constant(fn, "_f")

    def literal(self, value: Any, local: dict[str, str]) -> str:
        """Python text for an argument: references by variable, literals as themselves."""
        if isinstance(value, Ref):
            return local[value.name]
        if isinstance(value, tuple):
            items = [self.literal(v, local) for v in value]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if isinstance(value, list):
            return f"[{', '.join(self.literal(v, local) for v in value)}]"
        if value is None or isinstance(value, (bool, int, str)):
            return repr(value)
        if isinstance(value, float) and math.isfinite(value):
            return repr(value)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return str(value)  # torch.float32, torch.strided, torch.contiguous_format
        return self.constant(value)


@dataclass
class _Block:
    """Lines of source at one indentation."""

    writer: _Writer
    indent: int
    lines: list[str] = field(default_factory=list)

    def line(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def instructions(
        self,
        instructions: Sequence[Instruction],
        local: dict[str, str],
        merge: Any = None,
        segments: dict[int, Segment] | None = None,
    ) -> None:
        """Each instruction as a call (a region as a loop), then its ``del``; ``merge(name, var)``
        writes the lines that put a part's output in place as soon as it is made; a segment
        (by its first instruction) is one call in place of its instructions."""
        w = self.writer
        skip_to = 0
        for i, ins in enumerate(instructions):
            if i < skip_to:
                continue
            if segments and i in segments:
                skip_to = segments[i].stop
                self.segment(segments[i], local, instructions[i:skip_to], merge)
                continue
            var = local[ins.node] = w.variable(ins.node)
            if isinstance(ins.fn, PartLoop):
                self.part_loop(ins, var, local)
            elif isinstance(ins.fn, (Store, Load)):
                self.line(f"{var} = _transfer(streams, {ins.node!r}, {w.function(ins.fn)}, {local[ins.args[0].name]})")
                w.globals["_transfer"] = _transfer
            else:
                if ins.waits:
                    self.line(f"if streams is not None: streams.wait_for({ins.waits!r})")
                self.line(f"{var} = {self.call(ins, local)}")
            if merge is not None:
                merge(ins.node, var)
            if ins.free:
                self.line(f"del {', '.join(local.pop(n) for n in ins.free)}")

    def segment(self, segment: Segment, local: dict[str, str], body: Sequence[Instruction], merge: Any) -> None:
        """``outputs = segment([inputs])`` in place of the instructions ``body``, the inputs that die
        inside it dropped before the call; on CUDA the compute stream first waits for the copies
        of the Loads its ops read: their kernels run inside the compiled call, where no
        instruction waits. A part's output leaves the segment that makes it last (its
        ``ends``), is put in place by ``merge``, and dies there if it was to die inside."""
        w = self.writer
        waits = _waits(body)
        if waits:
            self.line(f"if streams is not None: streams.wait_for({waits!r})")
        args = w.variable("args")
        self.line(f"{args} = [{', '.join(local[n] for n in segment.inputs)}]")
        if segment.dying:
            self.line(f"del {', '.join(local.pop(n) for n in segment.dying)}")
        outputs = [local.setdefault(n, w.variable(n)) for n in segment.outputs]
        call = f"{w.constant(segment, '_segment')}({args})"
        self.line(f"({', '.join(outputs)},) = {call}" if outputs else call)
        self.line(f"del {args}")
        if merge is not None:
            for name in segment.outputs:
                merge(name, local[name])
        dying = [name for ins in body for name in ins.free if name in segment.outputs]
        if dying:
            self.line(f"del {', '.join(local.pop(n) for n in dying)}")

    def call(self, ins: Instruction, local: dict[str, str]) -> str:
        w = self.writer
        if op_name(ins.fn) == "getitem" and len(ins.args) == 2 and not ins.kwargs:
            return f"{w.literal(ins.args[0], local)}[{w.literal(ins.args[1], local)}]"
        args = [w.literal(a, local) for a in ins.args]
        named = {k: w.literal(v, local) for k, v in ins.kwargs.items()}
        if all(k.isidentifier() and not keyword.iskeyword(k) for k in named):
            args += [f"{k}={v}" for k, v in named.items()]
        elif named:  # a keyword Python reserves
            args.append("**{" + ", ".join(f"{k!r}: {v}" for k, v in named.items()) + "}")
        return f"{w.function(ins.fn)}({', '.join(args)})"

    def part_loop(self, ins: Instruction, var: str, local: dict[str, str]) -> None:
        """A fissioned region as ``for k in range(parts)``: slice the inputs, run the part's
        instructions, merge each output as it is made, drop the part's views at the end."""
        w, region = self.writer, ins.fn
        program = region.part_program
        handle = w.constant(region, "_region")
        w.globals["_part_of"] = part_of
        inputs = [w.literal(a, local) for a in ins.args]
        strides, k = w.variable("strides"), w.variable("k")
        results = [w.variable(f"{var}_result") for _ in region.part_outputs]
        self.line(f"# {op_name(region)}")
        self.line(f"{strides} = {handle}.result_strides(({', '.join(inputs)},))")
        self.line(f"for {k} in range({region.parts}):")
        part = _Block(w, self.indent + 1)
        inner = {}
        for name, outer, dim in zip(program.graph.inputs, inputs, region.slice_dims):
            inner[name] = w.variable(name)
            piece = outer if dim is None else f"_part_of({outer}, {dim}, {k}, {region.parts})"
            part.line(f"{inner[name]} = {piece}")
        slots: dict[str, list[int]] = {}
        for i, name in enumerate(region.part_outputs):
            slots.setdefault(name, []).append(i)

        def merge(name: str, value: str) -> None:
            for i in slots.get(name, ()):
                result, dim = results[i], region.concat_dims[i]
                part.line(f"if {k} == 0:")
                part.line(f"    {result} = {handle}.empty_result({i}, {strides}, {value})")
                if dim is not None:
                    part.line(f"_part_of({result}, {dim}, {k}, {region.parts}).copy_({value})")
                else:
                    part.line(f"{result}.copy_({value}) if {k} == 0 else {result}.add_({value})")

        for name in program.graph.inputs:  # an input passed through as an output
            merge(name, inner[name])
        part.instructions(program.instructions, inner, merge, w.segments(program, frozenset(region.part_outputs)))
        part.line(f"del {', '.join(inner[n] for n in program.graph.inputs)}")  # the part's views die here
        self.lines += part.lines
        self.line(f"{var} = ({', '.join(results)},)")
        self.line(f"del {strides}, {k}, {', '.join(results)}")


def _waits(instructions: Sequence[Instruction]) -> tuple[str, ...]:
    """The Loads any of ``instructions`` waits for, each once, in order."""
    return tuple(dict.fromkeys(load for ins in instructions for load in ins.waits))


def _transfer(streams: Any, name: str, transfer: Store | Load, value: torch.Tensor) -> torch.Tensor:
    """A swap's copy: on the side stream of a CUDA program, in place on a CPU."""
    return transfer(value) if streams is None else streams.run(name, transfer, value)


def part_of(tensor: torch.Tensor, dim: int | None, k: int, parts: int) -> torch.Tensor:
    """Part ``k`` of ``parts`` of ``tensor`` along ``dim`` (a view), or the whole tensor."""
    if dim is None:
        return tensor
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, k * size, size)
