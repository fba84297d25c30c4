"""A tied weight's gradient summed in place, its embedding term made a vocabulary slice at a time.

A language model whose head is its embedding (GPT-2, GPT-Neo, BTLM: weight tying) gets that
weight's gradient as the sum of two vocabulary-sized matrices: the head's (a matmul, made at
the start of the backward) and the embedding's (``embedding_dense_backward``, made at its end).
The captured step holds both terms and their sum at once at the end of the backward; on
GPT-Neo and BTLM at the small preset that moment is the step's peak, two vocabulary matrices
above the weights and gradients (eager holds one: autograd adds the second term into ``.grad``).

The rule writes the sum into the head's term where nothing else reads it (as MONeT's in-place
operators, :mod:`magis.rules.in_place`) and makes the embedding's term a slice of rows at a
time (as Echo's and MAGIS' fission make a large operator in parts): each slice is
``embedding_dense_backward`` of the same output gradient with every index outside the slice,
and the padding index, sent to one extra row that the kernel skips as padding. Each row of a
slice adds the same token gradients in the same order as the whole kernel (which adds a row's
tokens in their order), and the sum adds each element once: the gradient is eager's bit for
bit, while one slice, not two matrices, is held above the gradients. A weight tied three ways
(T5's shared embedding: encoder, decoder, head) sums twice; the second sum is written into the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from magis.ir.graph import Graph, Node, Ref, is_view, map_refs
from magis.rules.in_place import output_storages, overwritable, storage_readers
from magis.rules.rewrite import Rewrite, prune_dead

aten = torch.ops.aten

#: slices of the vocabulary the embedding's term is made in (one eighth of a matrix held at once)
PIECES = 8


@dataclass(frozen=True)
class EmbeddingGradientInto:
    """``into + embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale)``
    written into ``into``, ``pieces`` slices of rows at a time (module docstring)."""

    pieces: int

    @property
    def __name__(self) -> str:  # read by Node.op_name
        return "embedding_gradient_into"

    def writes(self, node: Node) -> tuple[str, ...]:
        """The sum's first term, written in place (:func:`magis.ir.graph.writes`)."""
        return (node.args[0].name,)

    def bounds(self, num_weights: int) -> list[tuple[int, int]]:
        """The rows ``[lo, hi)`` of each slice, as :func:`torch.chunk` cuts them."""
        rows = -(-num_weights // self.pieces)
        return [(lo, min(lo + rows, num_weights)) for lo in range(0, num_weights, rows)]

    def workspace(self, graph: Graph, node: Node) -> int:
        """Bytes one slice holds while it runs: its rows and the spare one, the shifted indices
        and the bool temporaries that find the indices outside it."""
        into, _, indices = (graph[ref.name].meta for ref in node.args[:3])
        num_weights, _, scale_grad_by_freq = node.args[3:]
        rows = self.bounds(num_weights)[0][1] + 1
        part = rows * (into.nbytes // into.shape[0]) + (rows * 8 if scale_grad_by_freq else 0)
        return indices.nbytes + max(3 * indices.numel, part)

    def kernel_bytes(self, graph: Graph, node: Node) -> tuple[int, ...]:
        """Bytes each kernel moves, per slice: the index arithmetic, the slice zeroed, its
        tokens' gradient rows added, and the slice added into ``into``'s rows (the latency
        model prices them, :mod:`magis.cost.latency`)."""
        into, grad_output, indices = (graph[ref.name].meta for ref in node.args[:3])
        row = into.nbytes // into.shape[0]
        kernels = []
        for lo, hi in self.bounds(node.args[3]):
            rows = hi - lo
            kernels += [2 * indices.nbytes] * 3 + [(rows + 1) * row, grad_output.nbytes // self.pieces, 3 * rows * row]
        return tuple(kernels)

    def __call__(
        self,
        into: torch.Tensor,
        grad_output: torch.Tensor,
        indices: torch.Tensor,
        num_weights: int,
        padding_idx: int,
        scale_grad_by_freq: bool,
    ) -> torch.Tensor:
        for lo, hi in self.bounds(num_weights):
            rows = hi - lo
            local = indices - lo
            outside = (local < 0) | (local >= rows)
            if 0 <= padding_idx - lo < rows:
                outside |= local == padding_idx - lo
            local.masked_fill_(outside, rows)  # the spare row, which the kernel skips as padding
            del outside
            part = aten.embedding_dense_backward(grad_output, local, rows + 1, rows, scale_grad_by_freq)
            into[lo:hi].add_(part[:rows])
        return into


def tied_sums(graph: Graph) -> list[tuple[str, str, str]]:
    """``(sum, other term, embedding term)`` for each sum of ``graph`` that adds an embedding's
    gradient to a tensor it may overwrite: of the same shape, dtype and layout as the sum,
    owning a whole storage that nothing else reads and that is neither resident nor an output
    (:func:`magis.rules.in_place.overwritable`); the embedding's gradient is read by the sum alone."""
    readers, held = storage_readers(graph), output_storages(graph)
    found = []
    for node in graph.nodes:
        if node.target is not aten.add.Tensor or node.kwargs_dict().get("alpha", 1) != 1:
            continue
        if len(node.args) != 2 or not all(isinstance(a, Ref) for a in node.args):
            continue
        first, second = (a.name for a in node.args)
        for term, embedding in ((first, second), (second, first)):
            gradient = graph[embedding]
            if (
                gradient.target is aten.embedding_dense_backward.default
                and term != embedding
                and readers.get((embedding, 0)) == {node.name}
                and (embedding, 0) not in held
                and gradient.meta == node.meta
                and overwritable(graph, term, node, readers, held)
            ):
                found.append((node.name, term, embedding))
                break
    return found


def _views_between(graph: Graph, term: str) -> list[str]:
    """The views from ``term`` back to the node owning its storage (``term`` first)."""
    chain = []
    while is_view(graph[term]) and graph[term].inputs:
        chain.append(term)
        term = graph[term].inputs[0]
    return chain


def _through_views(graph: Graph, term: str) -> str:
    """The node owning ``term``'s storage where it is laid out as ``term`` (a matmul's result
    seen through two transposes): written there, the sum is a whole tensor, which becomes
    ``.grad`` as it is, not a view that the plan would copy."""
    owner, element = graph.storages[term][0]
    return owner if element == 0 and graph[owner].outputs == (graph[term].meta,) else term


def tied_gradient_rewrites(graph: Graph, order: Sequence[str] | None = None) -> list[Rewrite]:
    """The M-Rule: every tied weight's gradient sum made in place, its embedding term a slice at a
    time (module docstring), in one rewrite whose order is ``order`` (default: the node order)
    with each sum's node in its place; ``[]`` where the step has none."""
    found = tied_sums(graph)
    if not found:
        return []
    added, rename = [], {}
    for total, term, embedding in found:
        grad_output, indices, num_weights, padding_idx, scale = graph[embedding].args
        target = EmbeddingGradientInto(min(PIECES, num_weights))
        args = (Ref(_through_views(graph, term)), grad_output, indices, num_weights, padding_idx, scale)
        draft = Node(graph.fresh_name(f"{total}_into"), target, args, outputs=(graph[total].meta,))
        added.append(
            replace(draft, aliases=((0, 0),), role=graph[total].role, workspace=target.workspace(graph, draft))
        )
        rename[total] = draft.name
    # a weight tied three ways (T5: encoder, decoder, head) sums twice; the second sum writes into the first
    added = [replace(node, args=map_refs(node.args, lambda ref: Ref(rename.get(ref.name, ref.name)))) for node in added]
    gone = {embedding for _, _, embedding in found}
    views = [name for _, term, _ in found for name in _views_between(graph, term)]
    result = prune_dead(graph.replace(remove=[*gone, *rename], add=added, rename=rename), views)
    gone |= set(views) - set(result.index)
    order = order if order is not None else [n.name for n in graph.nodes]
    placed = tuple(rename.get(name, name) for name in order if name not in gone)
    touched = frozenset(gone | set(rename) | set(rename.values()))
    shown = ", ".join(rename)
    return [Rewrite(result, f"tied gradient summed in place, its embedding term in slices: {shown}", placed, touched)]
