"""Algebraic rewrites in the spirit of TASO/MetaFlow: merge matmuls that share an operand, and split them back.

MAGIS (§7.1) runs TASO's A-Trans rules before its search, "which merge operations
like the QKV-projections in a transformer-block into a single operation and split
the result later"; MetaFlow (MLSys'19, §3) keeps such substitutions and their
inverses in one relaxed search, since a merge that costs memory here may pay off in
time, or enable another rewrite.

In a training step the three projections of an attention block read one hidden
state, and so do their three weight gradients: ``dW_i = mm(t(dY_i), x)``. Matmuls
``mm(A_i, B)`` that read the same right operand ``B`` (the same value, reached
through the same views) are one matmul of the stacked left operands,

    ``mm(A_i, B) = mm(cat(A_1..A_k, 0), B)[r_i : r_i + rows(A_i)]``,

one larger kernel instead of ``k`` (:func:`merge_shared_matmuls`). The row slices of
a row-major result are laid out exactly as the separate results were, so every
reader sees the same strides; the stacked operand and the shared result are new
memory, which the search weighs against the time saved. :func:`split_stacked_matmuls`
is the inverse: a matmul of a row-wise ``cat`` read only through row slices matching
the pieces becomes one matmul per piece. Both are exact (each output element is
the same dot product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from magis.ir.graph import Graph, Ref, map_refs
from magis.rules.builder import NodeBuilder
from magis.rules.rewrite import Rewrite

aten = torch.ops.aten

#: the most matmuls merged into one (attention has three projections; an MLP gate two).
MAX_GROUP = 4


@dataclass(frozen=True)
class SharedMatmuls:
    """Matmuls ``mm(A_i, B)`` reading one right operand ``B`` (up to views), in graph order."""

    matmuls: tuple[str, ...]
    right: str  # the right operand of the first one


@dataclass(frozen=True)
class StackedMatmul:
    """``mm(cat(A_1..A_k, 0), B)`` read only through row slices, one per piece it names."""

    matmul: str
    stack: str
    pieces: tuple[str, ...]  # A_i
    slices: tuple[tuple[str, ...], ...]  # per piece, the slices that read its rows


def value_key(graph: Graph, name: str) -> str:
    """What identifies the value of node ``name`` through views: a view of a value is
    the same tensor as an equal view of the same value (capture gives each linear
    layer its own ``view`` of a shared hidden state)."""
    node = graph[name]
    if node.is_input or node.tuple_output or node.aliases[0] is None or node.target is None:
        return name
    return repr((node.op_name, map_refs((node.args, node.kwargs), lambda r: value_key(graph, r.name)), node.outputs))


def find_shared_matmuls(graph: Graph) -> list[SharedMatmuls]:
    """Groups of at least two ``mm`` nodes reading the same right operand, none depending
    on another's result (the stacked operand needs every left operand first) nor written in
    place afterwards (merged, the results share one storage: a write into one would be
    ordered after every reader of the others, a cycle where those read what the write makes)."""
    groups: dict[tuple, list[str]] = {}
    written = graph.writers
    for node in graph.nodes:
        if node.target is not aten.mm.default or not all(isinstance(a, Ref) for a in node.args):
            continue
        if (node.name, 0) in written:
            continue
        left = graph[node.args[0].name].meta
        key = (value_key(graph, node.args[1].name), left.dtype, left.shape[1])
        groups.setdefault(key, []).append(node.name)
    found = []
    for members in groups.values():
        group: list[str] = []
        for name in members:
            if len(group) < MAX_GROUP and all(_independent(graph, name, other) for other in group):
                group.append(name)
        if len(group) >= 2:
            found.append(SharedMatmuls(tuple(group), graph[group[0]].args[1].name))
    return found


def _independent(graph: Graph, a: str, b: str) -> bool:
    """Neither matmul reads (through any path) the other's result."""
    return a not in graph.ancestors(b) and b not in graph.ancestors(a)


def merge_shared_matmuls(graph: Graph, match: SharedMatmuls) -> Graph:
    """One ``mm`` of the row-stacked left operands; each old result becomes a row slice of it."""
    build = NodeBuilder(graph, match.matmuls[0])
    lefts = [graph[m].args[0] for m in match.matmuls]
    stacked = build.add("stack", aten.cat.default, (lefts, 0))
    product = build.add("merged", aten.mm.default, (stacked, Ref(match.right)))
    rename = {}
    start = 0
    for name, left in zip(match.matmuls, lefts):
        rows = graph[left.name].meta.shape[0]
        piece = build.add("rows", aten.slice.Tensor, (product, 0, start, start + rows), role=graph[name].role)
        rename[name] = piece.name
        start += rows
    return graph.replace(remove=match.matmuls, add=build.nodes, rename=rename)


def find_stacked_matmuls(graph: Graph) -> list[StackedMatmul]:
    """Every ``mm(cat(A_1..A_k, 0), B)`` whose stack only it reads and whose result is read
    only through row slices, each covering exactly one piece (what the merge makes)."""
    outputs = set(graph.outputs)
    found = []
    for node in graph.nodes:
        if node.target is not aten.mm.default or node.name in outputs or not isinstance(node.args[0], Ref):
            continue
        stack = graph[node.args[0].name]
        if stack.target is not aten.cat.default or stack.name in outputs or graph.consumers[stack.name] != (node.name,):
            continue
        pieces, dim = stack.args[0], stack.args[1] if len(stack.args) > 1 else 0
        if dim != 0 or len(pieces) < 2 or not all(isinstance(p, Ref) for p in pieces):
            continue
        bounds, start = {}, 0
        for i, piece in enumerate(pieces):
            rows = graph[piece.name].meta.shape[0]
            bounds[(start, start + rows)] = i
            start += rows
        slices: list[list[str]] = [[] for _ in pieces]
        for reader in graph.consumers[node.name]:
            i = bounds.get(_row_range(graph, reader, node.name, start))
            if i is None:
                break
            slices[i].append(reader)
        else:
            names = tuple(p.name for p in pieces)
            found.append(StackedMatmul(node.name, stack.name, names, tuple(tuple(s) for s in slices)))
    return found


def _row_range(graph: Graph, name: str, source: str, rows: int) -> tuple[int, int] | None:
    """``(start, stop)`` when node ``name`` is ``slice(source, 0, start, stop)`` with step 1."""
    node = graph[name]
    if node.target is not aten.slice.Tensor or node.kwargs or node.args[0] != Ref(source):
        return None
    dim, start, stop, step = (*node.args[1:], *(0, None, None, 1)[len(node.args) - 1 :])
    if dim != 0 or step != 1:
        return None
    start = 0 if start is None else start
    stop = rows if stop is None else min(stop, rows)
    return (start, stop)


def split_stacked_matmul(graph: Graph, match: StackedMatmul) -> Graph:
    """One ``mm`` per piece of the stack; each slice becomes the matmul of its piece."""
    build = NodeBuilder(graph, match.matmul)
    right = graph[match.matmul].args[1]
    rename = {}
    for piece, readers in zip(match.pieces, match.slices):
        if readers:
            product = build.add("part", aten.mm.default, (Ref(piece), right), role=graph[readers[0]].role)
            rename.update(dict.fromkeys(readers, product.name))
    remove = [match.stack, match.matmul, *rename]
    return graph.replace(remove=remove, add=build.nodes, rename=rename)


def merge_rewrites(graph: Graph) -> list[Rewrite]:
    """Every :func:`merge_shared_matmuls` the graph offers (an M-Rule)."""
    found = []
    for m in find_shared_matmuls(graph):
        description = f"merge {len(m.matmuls)} matmuls reading {m.right}: {', '.join(m.matmuls)}"
        found.append(Rewrite(merge_shared_matmuls(graph, m), description))
    return found


def split_rewrites(graph: Graph) -> list[Rewrite]:
    """Every :func:`split_stacked_matmul` the graph offers (an M-Rule, the merge's inverse)."""
    return [
        Rewrite(split_stacked_matmul(graph, m), f"split {m.matmul} into {len(m.pieces)} matmuls")
        for m in find_stacked_matmuls(graph)
    ]
