"""Dimension rules: which axis of an operator each tensor dimension is (MAGIS §4.1).

The D-Graph (:mod:`magis.analysis.dgraph`) needs, for every operator, how its
output dimensions and reduce axes line up with its inputs' dimensions. This module
states that per aten operator, as an :class:`OpDims`:

- an operator's *axes* are the loops of its computation, numbered by the rule:
  positive axes appear as a dimension of some output element (for a single-output
  operator axis ``i`` is output dimension ``i - 1``); negative axes ``-1, -2, ...``
  are reduce axes that appear in no output (``k`` of a matmul);
- ``inputs[p][d]`` is the axis that dimension ``d`` of the ``p``-th tensor argument
  runs along (arguments in the order :func:`magis.ir.graph.iter_refs` visits them);
- ``outputs[e][d]`` is the axis of dimension ``d`` of output element ``e``;
- ``reductions[e]`` are the axes element ``e`` is a *sum* over: split the axis into
  parts, compute each part, add the results, and the element is exact (the weight
  gradient of a matmul over the batch, Figure 5 of the paper);
- ``sizes`` are the constant arguments that hold an axis' length (``view`` sizes,
  ``native_group_norm``'s ``N``): a part of a fissioned region divides them by ``n``.

``None`` means "no axis": that dimension is not linked to anything, so no fission
crosses it. An output dimension is an axis only when every input either runs along
it or does not depend on it (is broadcast along it and read whole by every part).
Every rule links only what is exact: the axis a softmax or a layer norm normalises
over, a sliding-window axis of a convolution (the paper's footnote 2), the batch
axis of a training-mode batch norm, the reduce axis of an ``addmm`` (its bias would
be added once per part) are all left unlinked. An operator without a rule gets
``None`` from :func:`op_dims` and is never fissioned.

Reshapes link dimension ``i`` of the input to dimension ``j`` of the output when
both start at the same flat offset (the product of the dimensions before them is
equal) and both are longer than 1: cutting either into ``n`` contiguous chunks
then cuts the same elements, as long as ``n`` divides both lengths. That covers
``[B, S, H*D] -> [B, S, H, D]`` (``H*D`` to ``H``, an outer split) and
``[B, S, H] -> [B*S, H]`` (``B`` to ``B*S``), and leaves ``D`` and ``S`` unlinked.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch

from magis.ir.graph import Graph, Node, Ref

Axis = int
Shape = tuple[int, ...]
AxisMap = tuple[Axis | None, ...]
#: where a size constant sits: (argument name, index in a list argument or ``None``).
SizePath = tuple[str, int | None]

aten = torch.ops.aten


@dataclass(frozen=True)
class OpDims:
    """How one operator's axes run through its tensors (see the module docstring)."""

    inputs: tuple[AxisMap, ...]
    outputs: tuple[AxisMap | None, ...]
    reductions: tuple[frozenset[Axis], ...]
    lengths: Mapping[Axis, int]
    sizes: tuple[tuple[SizePath, Axis], ...] = ()

    @property
    def axes(self) -> tuple[Axis, ...]:
        """Every axis of the operator: one D-Graph vertex each."""
        return tuple(sorted(self.lengths))

    def visible(self, element: int) -> AxisMap:
        """The axes a reader of output ``element`` can link to: its dimensions, then the
        axes it sums over (only ``getitem`` links those, to carry a partial sum on)."""
        dims = self.outputs[element] or ()
        return dims + tuple(sorted(self.reductions[element]))


# ------------------------------------------------------------------ rule input
@dataclass(frozen=True)
class OpCall:
    """What a rule sees: the node, its arguments bound by schema name, its inputs' shapes."""

    node: Node
    args: Mapping[str, Any]
    shapes: Mapping[str, Shape] = field(repr=False)

    def shape(self, arg: str) -> Shape:
        """Shape of the tensor argument ``arg``."""
        return self.shapes[self.args[arg].name]

    def ndim(self, arg: str) -> int:
        return len(self.shape(arg))

    @property
    def out(self) -> Shape:
        """Shape of output element 0."""
        meta = self.node.outputs[0]
        return () if meta is None else meta.shape

    def dims(
        self,
        inputs: Mapping[str, AxisMap | Sequence[AxisMap]],
        outputs: Sequence[AxisMap | None] | None = None,
        reductions: Sequence[frozenset[Axis]] = (),
        sizes: Sequence[tuple[SizePath, Axis]] = (),
    ) -> OpDims:
        """Build the :class:`OpDims`: ``inputs`` maps argument names to axes (a list of
        them for a list of tensors); arguments left out are unlinked. ``outputs``
        defaults to the identity over the single output."""
        per_ref = tuple(self._flatten(inputs))
        if outputs is None:
            outputs = (identity(len(self.out)),)
        outputs = tuple(None if m is None else axes for m, axes in zip(self.node.outputs, outputs, strict=True))
        reductions = tuple(reductions) or (frozenset(),) * len(outputs)
        lengths: dict[Axis, int] = {}
        for meta, axes in zip(self.node.outputs, outputs):
            if meta is not None and axes is not None:
                _collect_lengths(lengths, meta.shape, axes)
        for ref, axes in zip(self.node.refs, per_ref):
            _collect_lengths(lengths, self.shapes[ref.name], axes)
        for red in reductions:
            missing = red - lengths.keys()
            assert not missing, f"{self.node.op_name}: reduce axes {missing} appear in no input"
        return OpDims(per_ref, outputs, reductions, MappingProxyType(lengths), tuple(sizes))

    def _flatten(self, inputs: Mapping[str, AxisMap | Sequence[AxisMap]]) -> list[AxisMap]:
        """Per-argument axes in the order ``iter_refs`` visits the node's tensors."""
        out: list[AxisMap] = []
        names = _positional_names(self.node.target)
        given = [*zip(names, self.node.args), *self.node.kwargs]
        for name, value in given:
            axes = inputs.get(name)
            if isinstance(value, Ref):
                out.append(axes if axes is not None else (None,) * len(self.shapes[value.name]))
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Ref):
                        out.append(axes[i] if axes is not None else (None,) * len(self.shapes[item.name]))
        return out


def _collect_lengths(lengths: dict[Axis, int], shape: Shape, axes: AxisMap) -> None:
    assert len(shape) == len(axes), f"axes {axes} do not match shape {shape}"
    for size, axis in zip(shape, axes):
        if axis is not None:
            lengths.setdefault(axis, size)


def _positional_names(target: Any) -> list[str]:
    return [a.name for a in target._schema.arguments]


def bind(node: Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update(zip(_positional_names(node.target), node.args))
    bound.update(node.kwargs)
    return bound


def identity(ndim: int, skip: Sequence[int] = ()) -> AxisMap:
    """Dimension ``d`` on axis ``d + 1``, except the dimensions in ``skip`` (unlinked)."""
    return tuple(None if d in skip else d + 1 for d in range(ndim))


def right_aligned(shape: Shape, out: Shape) -> AxisMap:
    """Broadcasting: dimension ``d`` of ``shape`` lines up with output dimension
    ``d + len(out) - len(shape)``; it is linked unless it is broadcast (length 1 against more)."""
    offset = len(out) - len(shape)
    return tuple(offset + d + 1 if size == out[offset + d] else None for d, size in enumerate(shape))


def _norm_dims(dims: Any, ndim: int) -> set[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return {d % ndim for d in dims} if ndim else set()


# ------------------------------------------------------------------ rule families
def _pointwise(call: OpCall) -> OpDims:
    """Elementwise with broadcasting (``add``, ``gelu_backward``, ``native_dropout``, ``ones_like``...)."""
    out = call.out
    inputs = {
        name: right_aligned(call.shapes[value.name], out) for name, value in call.args.items() if isinstance(value, Ref)
    }
    return call.dims(inputs, [identity(len(out))] * len(call.node.outputs))


def _mm(call: OpCall) -> OpDims:
    """``c[m, n] = Σ_k a[m, k] b[k, n]``: the paper's example, ``k`` a summable reduce axis."""
    return call.dims({"self": (1, -1), "mat2": (-1, 2)}, reductions=[frozenset({-1})])


def _bmm(call: OpCall) -> OpDims:
    return call.dims({"self": (1, 2, -1), "mat2": (1, -1, 3)}, reductions=[frozenset({-1})])


def _addmm(call: OpCall) -> OpDims:
    """``beta * bias + alpha * a @ b``: ``k`` is unlinked, a part would add the bias again."""
    if call.args["self"] is None:
        return call.dims({"mat1": (1, None), "mat2": (None, 2)})
    return call.dims({"self": right_aligned(call.shape("self"), call.out), "mat1": (1, None), "mat2": (None, 2)})


def _baddbmm(call: OpCall) -> OpDims:
    return call.dims(
        {"self": right_aligned(call.shape("self"), call.out), "batch1": (1, 2, None), "batch2": (1, None, 3)}
    )


def _convolution(call: OpCall) -> OpDims:
    """``convolution``: batch (axis 1) and output channels (axis 2) link; input channels
    are a summable reduce axis (-1) when there is no bias; sliding windows never link."""
    spatial = (None,) * (call.ndim("input") - 2)
    plain = call.args["groups"] == 1
    cin = -1 if plain and call.args["bias"] is None else None
    cout = 2 if plain else None
    weight = (cin, cout) if call.args["transposed"] else (cout, cin)
    inputs = {"input": (1, cin, *spatial), "weight": (*weight, *spatial), "bias": (cout,)}
    outputs = [(1, cout, *spatial)]
    return call.dims(inputs, outputs, [frozenset({cin} - {None})])


def _convolution_backward(call: OpCall) -> OpDims:
    """``(grad_input, grad_weight, grad_bias)``: axes batch 1, input channels 2, output
    channels ``3 + spatial``. ``grad_input`` sums over output channels, the weight and
    bias gradients over the batch."""
    spatial = (None,) * (call.ndim("input") - 2)
    plain = call.args["groups"] == 1
    batch, cin, cout = 1, (2 if plain else None), (3 + len(spatial) if plain else None)
    weight = ((cin, cout) if call.args["transposed"] else (cout, cin)) + spatial
    inputs = {"grad_output": (batch, cout, *spatial), "input": (batch, cin, *spatial), "weight": weight}
    outputs = [(batch, cin, *spatial), weight, (cout,)]
    reductions = [frozenset({cout} - {None}), frozenset({batch}), frozenset({batch})]
    sizes = [(("bias_sizes", 0), cout)] if plain and call.args["bias_sizes"] else []
    return call.dims(inputs, outputs, reductions, sizes)


def _sum(call: OpCall) -> OpDims:
    """``sum`` over ``dim``: each summed dimension is a reduce axis."""
    return _reduce(call, summable=True)


def _reduce_unlinked(call: OpCall) -> OpDims:
    """``mean``, ``amax``...: the reduced dimensions are not summable, so they stay unlinked."""
    return _reduce(call, summable=False)


def _reduce(call: OpCall, summable: bool) -> OpDims:
    ndim = call.ndim("self")
    reduced = _norm_dims(call.args.get("dim"), ndim)
    keepdim = bool(call.args.get("keepdim", False))
    inputs: list[Axis | None] = []
    outputs: list[Axis | None] = []
    for d in range(ndim):
        if d in reduced:
            inputs.append(-(len([r for r in reduced if r <= d])) if summable else None)
            if keepdim:
                outputs.append(None)
        else:
            outputs.append(len(outputs) + 1)
            inputs.append(len(outputs))
    reductions = [frozenset(-(i + 1) for i in range(len(reduced))) if summable else frozenset()]
    return call.dims({"self": tuple(inputs)}, [tuple(outputs)], reductions)


def _along(dim_arg: str = "dim") -> Callable[[OpCall], OpDims]:
    """Ops that read a whole row along ``dim`` (softmax and its backward, cumsum):
    every tensor has the output's shape; every dimension but ``dim`` links."""

    def rule(call: OpCall) -> OpDims:
        ndim = len(call.out)
        axes = identity(ndim, skip=_norm_dims(call.args[dim_arg], ndim))
        inputs = {name: axes for name, value in call.args.items() if isinstance(value, Ref)}
        return call.dims(inputs, [axes] * len(call.node.outputs))

    return rule


def _layer_norm(call: OpCall) -> OpDims:
    """``native_layer_norm -> (out, mean, rstd)``: the leading dimensions link, the normalised ones do not."""
    lead = call.ndim("input") - len(call.args["normalized_shape"])
    axes = identity(call.ndim("input"), skip=range(lead, call.ndim("input")))
    return call.dims({"input": axes}, [axes] * 3)


def _layer_norm_backward(call: OpCall) -> OpDims:
    """``(grad_input, grad_weight, grad_bias)``: the affine gradients sum over the leading dimensions."""
    k = len(call.args["normalized_shape"])
    ndim = call.ndim("input")
    axes = identity(ndim, skip=range(ndim - k, ndim))
    lead = frozenset(range(1, ndim - k + 1))
    inputs = {"grad_out": axes, "input": axes, "mean": axes, "rstd": axes}
    return call.dims(inputs, [axes, (None,) * k, (None,) * k], [frozenset(), lead, lead])


def _batch_norm(call: OpCall) -> OpDims:
    """Batch norm forward (every variant): channels (dimension 1) link everything. In
    training the batch and spatial axes are normalised over and stay unlinked; in
    evaluation (running statistics) the op is elementwise in them."""
    x = _batch_norm_input(call, call.args.get("training", False))
    stats = ("weight", "bias", "running_mean", "running_var")
    inputs = {"input": x, **{name: _channel(call, call.shape(name)) for name in stats if call.args.get(name)}}
    return call.dims(inputs, [x] + [_channel(call, m.shape) for m in call.node.outputs[1:]])


def _batch_norm_backward(call: OpCall) -> OpDims:
    x = _batch_norm_input(call, call.args["train"])
    stats = ("weight", "running_mean", "running_var", "save_mean", "save_invstd")
    inputs = {
        "grad_out": x,
        "input": x,
        **{name: _channel(call, call.shape(name)) for name in stats if call.args.get(name)},
    }
    return call.dims(inputs, [x] + [_channel(call, m.shape) if m else None for m in call.node.outputs[1:]])


def _batch_norm_input(call: OpCall, training: bool) -> AxisMap:
    ndim = call.ndim("input")
    return (None, 2) + (None,) * (ndim - 2) if training else identity(ndim)


def _channel(call: OpCall, shape: Shape) -> AxisMap:
    """A per-channel statistic links to the channel axis (evaluation-mode ones may be empty)."""
    return (2,) if shape == (call.shape("input")[1],) else (None,) * len(shape)


def _group_norm(call: OpCall) -> OpDims:
    """``native_group_norm -> (out, mean[N, G], rstd[N, G])``: the batch links; ``N`` is a size."""
    x = identity(1) + (None,) * (call.ndim("input") - 1)
    return call.dims({"input": x}, [x, (1, None), (1, None)], sizes=[(("N", None), 1)])


def _group_norm_backward(call: OpCall) -> OpDims:
    x = identity(1) + (None,) * (call.ndim("input") - 1)
    stats = (1, None)
    inputs = {"grad_out": x, "input": x, "mean": stats, "rstd": stats}
    batch = frozenset({1})
    return call.dims(inputs, [x, (None,), (None,)], [frozenset(), batch, batch], sizes=[(("N", None), 1)])


def _embedding(call: OpCall) -> OpDims:
    """``weight[indices]``: the index dimensions and the feature dimension link; the vocabulary does not."""
    k = call.ndim("indices")
    return call.dims({"indices": identity(k), "weight": (None, k + 1)})


def _embedding_backward(call: OpCall) -> OpDims:
    """Scatter-add of ``grad_output`` rows into ``[num_weights, H]``: index dimensions are
    summable reduce axes (not when gradients are scaled by frequency: counts are global)."""
    k = call.ndim("indices")
    if call.args["scale_grad_by_freq"]:
        return call.dims({"grad_output": (*([None] * k), 2)}, [(None, 2)])
    reduce = tuple(-(i + 1) for i in range(k))
    return call.dims({"grad_output": (*reduce, 2), "indices": reduce}, [(None, 2)], [frozenset(reduce)])


_MEAN = 1
_SUM = 2


def _nll_loss(call: OpCall) -> OpDims:
    """``nll_loss_forward`` / ``nll_loss2d_forward -> (output, total_weight)``: per-sample
    with ``reduction='none'``, a summable reduce over samples with ``'sum'``; a mean is
    not a sum of part means, so ``'mean'`` links nothing."""
    ndim = call.ndim("self")
    sample = [0, *range(2, ndim)] if ndim > 1 else []
    reduction = call.args["reduction"]
    if reduction == _MEAN or not sample:
        return call.dims({}, [(), ()])
    if reduction == _SUM:
        axes = {d: -(i + 1) for i, d in enumerate(sample)}
        red = frozenset(axes.values())
        out: AxisMap = ()
    else:
        axes = {d: i + 1 for i, d in enumerate(sample)}
        red = frozenset()
        out = tuple(axes.values())
    x = tuple(axes.get(d) for d in range(ndim))
    target = tuple(axes[d] for d in sample)
    return call.dims({"self": x, "target": target}, [out, ()], [red, red])


def _nll_loss_backward(call: OpCall) -> OpDims:
    """Per-sample given ``total_weight`` (an input, computed over the whole batch), so the
    sample axes link for every reduction; the class axis does not."""
    ndim = call.ndim("self")
    x = identity(ndim, skip=(1,)) if ndim > 1 else (None,)
    target = tuple(a for a in x if a is not None)
    inputs = {"self": x, "target": target}
    if call.args["reduction"] not in (_MEAN, _SUM):
        inputs["grad_output"] = target
    return call.dims(inputs, [x])


def _pool(call: OpCall) -> OpDims:
    """Pooling and its backward (max pool's indices are flat offsets in the whole plane):
    batch and channels link, the window axes do not."""
    ndim = len(call.out)
    axes = identity(min(ndim, 2)) + (None,) * (ndim - 2)
    inputs = {name: axes for name, value in call.args.items() if isinstance(value, Ref)}
    return call.dims(inputs, [axes] * len(call.node.outputs))


def _sdpa(call: OpCall) -> OpDims:
    """Fused attention ``(out[B, H, L, E], logsumexp[B, H, L])``: batch and heads link;
    query rows link unless the mask is causal (a part would restart the diagonal). With
    dropout the op is random and has no rule."""
    if call.args["dropout_p"]:
        raise _NoRule
    rows = None if call.args["is_causal"] else 3
    q = (1, 2, rows, None)
    kv = (1, 2, None, None)
    inputs = {"query": q, "key": kv, "value": kv}
    if call.args.get("attn_mask") is not None:
        inputs["attn_mask"] = _mask_axes(call.shape("attn_mask"), call.out, rows)
    return call.dims(inputs, [q, q[:3]])


def _sdpa_backward(call: OpCall) -> OpDims:
    """``(grad_q, grad_k, grad_v)``: the key and value gradients sum over query rows."""
    if call.args["dropout_p"]:
        raise _NoRule
    rows = None if call.args["is_causal"] else 3
    q = (1, 2, rows, None)
    kv = (1, 2, None, None)
    inputs = {"grad_out": q, "query": q, "key": kv, "value": kv, "out": q, "logsumexp": q[:3]}
    if call.args.get("attn_mask") is not None:
        inputs["attn_mask"] = _mask_axes(call.shape("attn_mask"), call.out, rows)
    over_rows = frozenset({rows} - {None})
    return call.dims(inputs, [q, kv, kv], [frozenset(), over_rows, over_rows])


def _mask_axes(mask: Shape, out: Shape, rows: Axis | None) -> AxisMap:
    aligned = right_aligned(mask, (*out[:3], -1))  # the key axis never links
    return tuple(a if a in (1, 2, rows) else None for a in aligned)


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


def _slice(call: OpCall) -> OpDims:
    """``slice``/``select`` and ``split`` pieces: every dimension but the cut one links."""
    ndim = call.ndim("self")
    dim = call.args["dim"] % ndim
    out_ndim = len(call.out)
    if out_ndim == ndim:  # slice / split keep the dimension
        axes = identity(ndim, skip=(dim,))
        return call.dims({"self": axes}, [axes] * len(call.node.outputs))
    inputs = tuple(None if d == dim else (d + 1 if d < dim else d) for d in range(ndim))
    return call.dims({"self": inputs}, [identity(out_ndim)])


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


class _NoRule(Exception):
    """Raised by a rule for a configuration it cannot describe (e.g. attention with dropout)."""


Rule = Callable[[OpCall], OpDims]

#: aten operator -> rule. Any other operator tagged ``pointwise`` uses :func:`_pointwise`.
RULES: dict[Any, Rule] = {
    **dict.fromkeys(
        [
            aten.fill.Scalar,
            aten.ones_like.default,
            aten.zeros_like.default,
            aten.empty_like.default,
            aten.full_like.default,
            aten._to_copy.default,
            aten.copy.default,
            aten.detach.default,
            aten.alias.default,
            aten.lift_fresh_copy.default,
            aten.native_dropout.default,
        ],
        _pointwise,
    ),
    aten.mm.default: _mm,
    aten.bmm.default: _bmm,
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _baddbmm,
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    aten.sum.dim_IntList: _sum,
    aten.sum.default: _sum,
    **dict.fromkeys(
        [aten.mean.dim, aten.mean.default, aten.amax.default, aten.amin.default, aten.any.dim, aten.all.dim],
        _reduce_unlinked,
    ),
    **dict.fromkeys(
        [
            aten._softmax.default,
            aten._log_softmax.default,
            aten._safe_softmax.default,
            aten._softmax_backward_data.default,
            aten._log_softmax_backward_data.default,
            aten.cumsum.default,
        ],
        _along(),
    ),
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    **dict.fromkeys(
        [
            aten._native_batch_norm_legit_functional.default,
            aten._native_batch_norm_legit_no_training.default,
            aten.native_batch_norm.default,
        ],
        _batch_norm,
    ),
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten.native_group_norm.default: _group_norm,
    aten.native_group_norm_backward.default: _group_norm_backward,
    aten.embedding.default: _embedding,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss2d_forward.default: _nll_loss,
    aten.nll_loss_backward.default: _nll_loss_backward,
    aten.nll_loss2d_backward.default: _nll_loss_backward,
    **dict.fromkeys(
        [
            aten.max_pool2d_with_indices.default,
            aten.max_pool2d_with_indices_backward.default,
            aten.avg_pool2d.default,
            aten.avg_pool2d_backward.default,
            aten._adaptive_avg_pool2d.default,
            aten._adaptive_avg_pool2d_backward.default,
        ],
        _pool,
    ),
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_backward,
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
    **dict.fromkeys([aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default], _slice),
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


def rule_for(target: Any) -> Rule | None:
    """The rule of an aten operator, or ``None`` when it has none."""
    rule = RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _pointwise
    return rule


# ------------------------------------------------------------------ entry points
def op_dims(graph: Graph, name: str, source: OpDims | None = None) -> OpDims | None:
    """The :class:`OpDims` of node ``name``, or ``None`` when no rule describes it.

    Graph inputs have one axis per dimension. A ``getitem`` needs ``source``, the dims
    of the tuple it reads (:func:`getitem_dims`).
    """
    node = graph[name]
    meta = node.outputs[0] if node.outputs else None
    if node.is_input:
        ndim = len(meta.shape) if meta is not None else 0
        return OpDims((), (identity(ndim),), (frozenset(),), MappingProxyType(_lengths(meta.shape)))
    if node.target is operator.getitem:
        return None if source is None else getitem_dims(source, node.args[1], meta.shape)
    rule = rule_for(node.target)
    if rule is None:
        return None
    shapes = {ref.name: _shape_of(graph, ref.name) for ref in node.refs}
    try:
        return rule(OpCall(node, MappingProxyType(bind(node)), MappingProxyType(shapes)))
    except _NoRule:
        return None


def _shape_of(graph: Graph, name: str) -> Shape:
    meta = graph[name].outputs[0]
    return () if meta is None else meta.shape


def _lengths(shape: Shape) -> dict[Axis, int]:
    return {d + 1: s for d, s in enumerate(shape)}


def getitem_dims(source: OpDims, element: int, shape: Shape) -> OpDims:
    """``getitem(t, e)``: its dimensions are element ``e``'s, and it carries the axes
    that element sums over as its own reduce axes ``-1, -2, ...``, so that a weight
    gradient pulled out of ``convolution_backward`` still sums over the batch."""
    reduce = tuple(-(i + 1) for i in range(len(source.reductions[element])))
    lengths = _lengths(shape)
    for own, axis in zip(reduce, sorted(source.reductions[element])):
        lengths[own] = source.lengths[axis]
    own_axes = identity(len(shape)) + reduce
    return OpDims((own_axes,), (identity(len(shape)),), (frozenset(reduce),), MappingProxyType(lengths))


def opaque_dims(node: Node) -> OpDims:
    """Dims of a node without a rule: one fresh axis per output dimension, no input linked.

    Its outputs still have D-Graph vertices (its consumers may link to them), but no
    axis runs through it.
    """
    outputs: list[AxisMap | None] = []
    lengths: dict[Axis, int] = {}
    for meta in node.outputs:
        if meta is None:
            outputs.append(None)
            continue
        start = len(lengths)
        axes = tuple(start + d + 1 for d in range(len(meta.shape)))
        lengths.update(zip(axes, meta.shape))
        outputs.append(axes)
    return OpDims((), tuple(outputs), (frozenset(),) * len(outputs), MappingProxyType(lengths))


def scale_sizes(node: Node, dims: OpDims, axis: Axis, parts: int) -> Node:
    """``node`` with every size constant of ``axis`` divided by ``parts`` (one part's shapes)."""
    if not any(size_axis == axis for _, size_axis in dims.sizes):
        return node
    args = list(node.args)
    kwargs = dict(node.kwargs)
    names = _positional_names(node.target)
    for (arg, index), size_axis in dims.sizes:
        if size_axis != axis:
            continue
        position = names.index(arg)
        holder = args if position < len(args) else kwargs
        key = position if holder is args else arg
        value = holder[key]
        if index is None:
            holder[key] = _divide(value, parts)
        else:
            value = list(value)
            value[index] = _divide(value[index], parts)
            holder[key] = value
    return replace(node, args=tuple(args), kwargs=tuple(sorted(kwargs.items())))


def _divide(size: int, parts: int) -> int:
    if size % parts:
        raise ValueError(f"size {size} is not divisible by {parts}")
    return size // parts
