"""Dimension rules of the operators that move data rather than compute it (MAGIS §4.1):
reshapes, ``expand``, permutations, ``cat`` and ``stack``, slices, ``unbind`` and their
backward, ``gather``, padding, and the factories that make a tensor of a given size.

Reshapes link dimension ``i`` of the input to dimension ``j`` of the output when
both start at the same flat offset (the product of the dimensions before them is
equal) and both are longer than 1: cutting either into ``n`` contiguous chunks
then cuts the same elements, as long as ``n`` divides both lengths. That covers
``[B, S, H*D] -> [B, S, H, D]`` (``H*D`` to ``H``, an outer split) and
``[B, S, H] -> [B*S, H]`` (``B`` to ``B*S``), and leaves ``D`` and ``S`` unlinked.
A size argument (``view``'s, ``expand``'s, a factory's) holds an axis' length, which
a part of a fissioned region divides (:func:`magis.analysis.axes.scale_sizes`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from magis.analysis.axes import Axis, OpCall, OpDims, Rule, Shape, identity, right_aligned

aten = torch.ops.aten


def _reshape(call: OpCall) -> OpDims:
    """``view``/``reshape``/``_unsafe_view`` (and squeeze/unsqueeze): dimensions starting at
    the same flat offset link (module docstring); the other output dimensions are no axis
    (their elements come from inside a merged input dimension). The size argument is
    rewritten per part."""
    links = reshape_links(call.shape("self"), call.out)
    linked = set(links.values())
    inputs = tuple(links.get(d) for d in range(call.ndim("self")))
    outputs = tuple(j + 1 if j + 1 in linked else None for j in range(len(call.out)))
    size_arg = "size" if "size" in call.args else "shape"
    size = call.args.get(size_arg)
    sizes = []
    if isinstance(size, (list, tuple)):
        sizes = [((size_arg, j), j + 1) for j, s in enumerate(size) if s != -1 and j + 1 in linked]
    return call.dims({"self": inputs}, [outputs], sizes=sizes)


def reshape_links(src: Shape, dst: Shape) -> dict[int, Axis]:
    """Input dimension -> output axis for a row-major reshape from ``src`` to ``dst``."""
    start_src = {math.prod(src[:d]): d for d in range(len(src)) if src[d] > 1}
    return {
        start_src[offset]: j + 1 for j in range(len(dst)) if dst[j] > 1 and (offset := math.prod(dst[:j])) in start_src
    }


def _expand(call: OpCall) -> OpDims:
    """``expand``: broadcasting; every output dimension is an axis with its size in ``size``."""
    axes = right_aligned(call.shape("self"), call.out)
    sizes = [(("size", j), j + 1) for j, s in enumerate(call.args["size"]) if s != -1]
    return call.dims({"self": axes}, sizes=sizes)


def _permute(call: OpCall) -> OpDims:
    """``permute``/``transpose``/``t``: output dimension ``i`` reads input dimension ``perm[i]``."""
    ndim = call.ndim("self")
    perm = _permutation(call)
    inputs = [0] * ndim
    for i, d in enumerate(perm):
        inputs[d] = i + 1
    return call.dims({"self": tuple(inputs)})


def _permutation(call: OpCall) -> list[int]:
    ndim = call.ndim("self")
    if "dims" in call.args:
        return [d % ndim for d in call.args["dims"]]
    perm = list(range(ndim))
    if ndim == 2 and "dim0" not in call.args:  # t
        return perm[::-1]
    a, b = call.args["dim0"] % ndim, call.args["dim1"] % ndim
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _cat(call: OpCall) -> OpDims:
    """``cat`` along ``dim``: every other dimension links (``dim`` is unlinked)."""
    ndim = len(call.out)
    dim = call.args["dim"] % ndim
    axes = identity(ndim, skip=(dim,))
    # legacy empty inputs (shape [0]) take no part in the result
    per = [axes if len(call.shapes[t.name]) == ndim else (None,) for t in call.args["tensors"]]
    return call.dims({"tensors": per}, [axes])


def _stack(call: OpCall) -> OpDims:
    """``stack`` along ``dim``: input dimension ``d`` is output dimension ``d``, or ``d + 1``
    from ``dim`` on. The new dimension is a concatenation of whole inputs (one index per
    input), so like ``cat``'s dimension it is no axis: a part cannot take half of a list."""
    ndim = len(call.out)
    dim = call.args["dim"] % ndim
    per_input = tuple(d + 1 if d < dim else d + 2 for d in range(ndim - 1))
    return call.dims({"tensors": [per_input] * len(call.args["tensors"])}, [identity(ndim, skip=(dim,))])


def _slice(call: OpCall) -> OpDims:
    """``slice``/``select``, ``split`` pieces and ``unbind`` pieces: every dimension but the
    cut one links (``select`` and ``unbind`` drop it, so the later ones move down by one)."""
    ndim = call.ndim("self")
    dim = call.args["dim"] % ndim
    out_ndim = len(call.out)
    if out_ndim == ndim:  # slice / split keep the dimension
        axes = identity(ndim, skip=(dim,))
        return call.dims({"self": axes}, [axes] * len(call.node.outputs))
    inputs = tuple(None if d == dim else (d + 1 if d < dim else d) for d in range(ndim))
    return call.dims({"self": inputs}, [identity(out_ndim)] * len(call.node.outputs))


def _slice_backward(call: OpCall) -> OpDims:
    """``slice_backward``/``select_backward``: the gradient is padded back to ``input_sizes``."""
    out_ndim = len(call.out)
    dim = call.args["dim"] % out_ndim
    kept = [d for d in range(out_ndim) if d != dim]
    sliced = call.ndim("grad_output") == out_ndim  # slice_backward; select_backward drops ``dim``
    grad = identity(out_ndim, skip=(dim,)) if sliced else tuple(d + 1 for d in kept)
    sizes = [(("input_sizes", d), d + 1) for d in kept]
    return call.dims({"grad_output": grad}, [identity(out_ndim, skip=(dim,))], sizes=sizes)


def _gather(call: OpCall) -> OpDims:
    """``out[..., i, ...] = self[..., index[..., i, ...], ...]`` along ``dim``: output and index
    share their axes; ``self`` links where it is as long as the index (elsewhere a part
    would need the first rows of ``self``, not a slice of it, so that axis is dropped)."""
    ndim = len(call.out)
    dim = call.args["dim"] % ndim
    own = call.shape("self")
    axes = tuple(d + 1 if d == dim or own[d] == call.out[d] else None for d in range(ndim))
    src = tuple(None if d == dim else a for d, a in enumerate(axes))
    return call.dims({"self": src, "index": axes}, [axes])


def _pad(call: OpCall) -> OpDims:
    """``constant_pad_nd``: the padded dimensions are no axis, the others link."""
    ndim = call.ndim("self")
    pad = call.args["pad"]
    padded = {ndim - 1 - i // 2 for i, p in enumerate(pad) if p}
    axes = identity(ndim, skip=padded)
    return call.dims({"self": axes}, [axes])


def _factory(call: OpCall) -> OpDims:
    """``zeros``/``full``/``new_zeros``...: the output is its ``size`` argument, rewritten per part."""
    ndim = len(call.out)
    return call.dims({}, sizes=[(("size", j), j + 1) for j in range(ndim)])


#: aten operator -> rule, for the operators that move data
LAYOUT_RULES: dict[Any, Rule] = {
    **dict.fromkeys(
        [
            aten.view.default,
            aten._unsafe_view.default,
            aten.reshape.default,
            aten.unsqueeze.default,
            aten.squeeze.dim,
            aten.squeeze.dims,
            aten.squeeze.default,
        ],
        _reshape,
    ),
    aten.expand.default: _expand,
    **dict.fromkeys([aten.permute.default, aten.transpose.int, aten.t.default], _permute),
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    **dict.fromkeys(
        [aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int],
        _slice,
    ),
    **dict.fromkeys([aten.slice_backward.default, aten.select_backward.default], _slice_backward),
    aten.gather.default: _gather,
    aten.constant_pad_nd.default: _pad,
    **dict.fromkeys(
        [
            aten.zeros.default,
            aten.ones.default,
            aten.empty.memory_format,
            aten.full.default,
            aten.new_zeros.default,
            aten.new_ones.default,
            aten.new_empty.default,
            aten.new_full.default,
            aten.scalar_tensor.default,
        ],
        _factory,
    ),
}
