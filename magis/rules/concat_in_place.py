"""A concatenation assembled in place: each part copied into its slice of the result as soon as
it exists, and freed.

``cat(x_1..x_k)`` needs every part alive at once, beside the result: twice the result's
bytes at its step. Frameworks that plan memory for inference build the result in place
instead (each producer writing into its slice; TensorFlow Lite's arena planner, Serenity's
§3.3 motivation): the result is allocated, each part is copied into its slice when it has
been computed, and a part nothing else reads is freed right after its copy. The peak then
holds the result and one part, and the parts (tiles of a band-wise tiled convolution,
:mod:`magis.rules.tiling`; the states a NAS cell concatenates) need not all live at once.
The copies move the bytes the concatenation moved: bit for bit the same values, about the
same time.

In the IR the result is an empty tensor laid out as the concatenation's, and each copy
``copy_(slice(result), x_i)`` writes into it; the next slice is taken from a view of the whole
result made from the copy's output (``as_strided`` over the same storage), so every copy
and the final reader follow the writes before them by data edges, as in-place operators do
(:func:`magis.ir.graph.writes`).
"""

from __future__ import annotations

import torch

from magis.ir.graph import Graph, Node, Ref, TensorMeta
from magis.rules.in_place import storage_readers
from magis.rules.rewrite import Rewrite

aten = torch.ops.aten


def _parts(node: Node) -> tuple[list[Ref], int] | None:
    values = dict(zip(("tensors", "dim"), node.args)) | node.kwargs_dict()
    tensors = values["tensors"]
    if not all(isinstance(t, Ref) for t in tensors):
        return None
    return list(tensors), int(values.get("dim", 0)) % len(node.meta.shape)


def find_concats_in_place(graph: Graph) -> list[str]:
    """Every concatenation of ``graph`` that some part's storage is read by alone (copied into
    place, that part is freed early), of parts that are not resident."""
    readers = storage_readers(graph)
    found = []
    for node in graph.nodes:
        if node.target is not aten.cat.default:
            continue
        parsed = _parts(node)
        if parsed is None or len(parsed[0]) < 2:
            continue
        parts = [ref.name for ref in parsed[0]]
        if any(graph[p].is_input or p in graph.persistent for p in parts):
            continue
        rank, dtype = len(node.meta.shape), node.meta.dtype
        if any(len(graph[p].meta.shape) != rank or graph[p].meta.dtype != dtype for p in parts):
            continue  # an empty 1-D part (``cat`` skips those) or a part the concatenation casts
        if any(_freed_by_copy(graph, p, node.name, readers) for p in parts):
            found.append(node.name)
    return found


def _freed_by_copy(graph: Graph, part: str, concat: str, readers: dict[tuple[str, int], set[str]]) -> bool:
    """Whether ``part`` is a whole storage (or a tuple's element) that ``concat`` alone reads."""
    key = graph.storages[part][0]
    return key is not None and graph.storage_bytes[key] == graph[part].meta.nbytes and readers.get(key) == {concat}


def concat_in_place(graph: Graph, name: str) -> Graph:
    """``graph`` with the concatenation ``name`` assembled in place (module docstring); the
    last view of the result takes the concatenation's readers."""
    node = graph[name]
    parsed = _parts(node)
    assert parsed is not None
    refs, dim = parsed
    meta = node.meta
    size = list(meta.shape)
    # a layout a rule left unknown: contiguous (the values are the same in any layout)
    stride = list(meta.strides or torch.empty(size, device="meta").stride())
    buffer = Node(
        graph.fresh_name(f"{name}_buffer"),
        aten.new_empty_strided.default,
        (refs[0], size, stride),
        outputs=(meta,),
        aliases=(None,),
        role=node.role,
    )
    added, whole, start = [buffer], Ref(buffer.name), 0
    for i, part in enumerate(refs):
        length = graph[part.name].meta.shape[dim]
        part_meta = graph[part.name].meta
        view_meta = TensorMeta(part_meta.shape, meta.dtype, part_meta.nbytes, tuple(stride))
        view = Node(
            graph.fresh_name(f"{name}_slot{i}"),
            aten.slice.Tensor,
            (whole, dim, start, start + length),
            outputs=(view_meta,),
            aliases=((0, 0),),
            role=node.role,
        )
        copied = Node(
            graph.fresh_name(f"{name}_copy{i}"),
            aten.copy_.default,
            (Ref(view.name), part),
            outputs=(view_meta,),
            aliases=((0, 0),),
            role=node.role,
        )
        full = Node(
            graph.fresh_name(f"{name}_filled{i}"),
            aten.as_strided.default,
            (Ref(copied.name), size, stride, 0),
            outputs=(meta,),
            aliases=((0, 0),),
            role=node.role,
        )
        added += [view, copied, full]
        whole, start = Ref(full.name), start + length
    return graph.replace(remove=[name], add=added, rename={name: whole.name})


def concat_in_place_rewrites(graph: Graph) -> list[Rewrite]:
    """Every concatenation assembled in place, one rewrite each (an M-Rule)."""
    return [
        Rewrite(concat_in_place(graph, name), f"assemble {name} in place: each part copied into its slice")
        for name in find_concats_in_place(graph)
    ]
