"""Dimension rules of the operators that compute (MAGIS §4.1): elementwise ops, matrix
products, convolutions, reductions, normalisations, embeddings, losses, pooling, attention.

Each rule reads an :class:`~magis.analysis.axes.OpCall` and says how the operator's axes
run through its tensors (:class:`~magis.analysis.axes.OpDims`). Every rule links only
what is exact: the axis a softmax or a layer norm normalises over, a sliding-window axis
of a convolution (the paper's footnote 2), the batch axis of a training-mode batch norm,
the reduce axis of an ``addmm`` (its bias would be added once per part) are all left
unlinked. An output dimension is an axis only when every input either runs along it or
does not depend on it (is broadcast along it and read whole by every part).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from magis.analysis.axes import Axis, AxisMap, NoRule, OpCall, OpDims, Rule, Shape, identity, right_aligned
from magis.ir.graph import Ref

aten = torch.ops.aten


def _norm_dims(dims: Any, ndim: int) -> set[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return {d % ndim for d in dims} if ndim else set()


def pointwise(call: OpCall) -> OpDims:
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


def _depthwise(call: OpCall, channels: int) -> bool:
    """One filter per channel (``groups`` = input = output channels, not transposed): each output
    channel reads only its own input channel, so channels split like a batch, ``groups`` with them."""
    return not call.args["transposed"] and call.args["groups"] == channels == call.shape("input")[1] > 1


def _convolution(call: OpCall) -> OpDims:
    """``convolution``: batch (axis 1) and output channels (axis 2) link; input channels
    are a summable reduce axis (-1) when there is no bias; sliding windows never link. A
    depthwise convolution links its channels through input, weight, bias and output."""
    spatial = (None,) * (call.ndim("input") - 2)
    if _depthwise(call, call.out[1]):
        inputs = {"input": (1, 2, *spatial), "weight": (2, None, *spatial), "bias": (2,)}
        return call.dims(inputs, [(1, 2, *spatial)], sizes=[(("groups", None), 2)])
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
    bias gradients over the batch. A depthwise convolution's channels are one axis (2)."""
    spatial = (None,) * (call.ndim("input") - 2)
    if _depthwise(call, call.shape("grad_output")[1]):
        weight = (2, None, *spatial)
        inputs = {"grad_output": (1, 2, *spatial), "input": (1, 2, *spatial), "weight": weight}
        sizes = [(("groups", None), 2)] + ([(("bias_sizes", 0), 2)] if call.args["bias_sizes"] else [])
        reductions = [frozenset(), frozenset({1}), frozenset({1})]
        return call.dims(inputs, [(1, 2, *spatial), weight, (2,)], reductions, sizes)
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
        raise NoRule
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
        raise NoRule
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


#: aten operator -> rule, for the operators that compute
COMPUTE_RULES: dict[Any, Rule] = {
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
        pointwise,
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
}
