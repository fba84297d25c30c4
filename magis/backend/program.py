"""A graph lowered for one schedule: the instructions both runtimes run.

:func:`lower` turns a graph and a schedule into a :class:`Program`: one
:class:`Instruction` per node that computes something, in the schedule's order, each
naming the values whose last reader it is (freed right after it, so memory follows
the simulator's timeline, :mod:`magis.cost.memory`) and, where swaps run on CUDA, the
Loads whose copies it waits for. The generated code (:mod:`magis.backend.codegen`) and
the interpreter (:mod:`magis.backend.interpreter`) run a program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from magis.backend.transfer import Load, Store
from magis.ir.graph import Graph, is_view


@dataclass(frozen=True)
class Instruction:
    """One step: run ``node`` then forget the values in ``free``; on CUDA, first wait for
    the copies of the Loads in ``waits`` (whose tensors the node reads)."""

    node: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    free: tuple[str, ...]
    waits: tuple[str, ...] = ()


@dataclass(frozen=True)
class Program:
    """A graph lowered to a straight-line list of instructions for one schedule."""

    graph: Graph
    order: tuple[str, ...]
    instructions: tuple[Instruction, ...]

    @cached_property
    def swaps(self) -> bool:
        """Whether the program moves tensors to and from host memory (asked at every run)."""
        return any(isinstance(ins.fn, (Store, Load)) for ins in self.instructions)


def lower(graph: Graph, order: Sequence[str] | None = None) -> Program:
    """Lower ``graph`` in ``order`` (default: its node order) to a :class:`Program`."""
    order = tuple(order) if order is not None else tuple(n.name for n in graph.nodes)
    graph.check_schedule(order)
    pos = {name: i for i, name in enumerate(order)}
    keep = set(graph.outputs) | set(graph.inputs)
    last_use: dict[str, int] = {}
    for name in order:
        for p in graph[name].inputs:
            last_use[p] = max(last_use.get(p, -1), pos[name])
    frees: dict[int, list[str]] = {}
    for name in order:
        if name in keep:
            continue
        frees.setdefault(last_use.get(name, pos[name]), []).append(name)
    loads = {n.name for n in graph.nodes if isinstance(n.target, Load)}
    instructions = []
    for i, name in enumerate(order):
        node = graph[name]
        if node.is_input:
            continue
        waits = ()
        if loads and not is_view(node):  # a view launches nothing: its readers wait instead
            waits = tuple(sorted({k[0] for p in node.inputs for k in graph.storages[p] if k and k[0] in loads}))
        fn = _owning_its_result(node.target) if node.target in _REDUCED_IN_PLACE else node.target
        instructions.append(Instruction(name, fn, node.args, dict(node.kwargs), tuple(frees.get(i, ())), waits))
    return Program(graph, order, tuple(instructions))


#: Loss kernels whose reduced result keeps the storage of the elementwise loss they reduced in
#: place: on CPU (torch 2.13) ``mse_loss`` of two 128x64 float64 tensors returns a 0-dim tensor
#: on 65,536 bytes, held as long as the loss is. The simulator counts the result's own bytes.
_REDUCED_IN_PLACE = frozenset(
    {
        torch.ops.aten.mse_loss.default,
        torch.ops.aten.smooth_l1_loss.default,
        torch.ops.aten.binary_cross_entropy.default,
        torch.ops.aten.soft_margin_loss.default,
    }
)


def _owning_its_result(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel``, its result copied out of a storage larger than itself (the copy is a few
    bytes; the storage it frees is the size of the loss's input)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out = kernel(*args, **kwargs)
        return out.clone() if out.untyped_storage().nbytes() > out.nbytes else out

    return run
