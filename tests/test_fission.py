"""Fission (MAGIS §4): dimension rules against PyTorch, F-Trans exactness and memory,
the D-Graph, the F-Tree (Algorithm 1), its mutation rules and ``magis fission``.

Gradient checks run in float64, so "equal to eager" means equal up to the rounding
of a split sum (a weight gradient added over parts), not up to float32 noise that
a batch norm over two samples amplifies.
"""

from __future__ import annotations

import argparse
import json
import operator
from dataclasses import dataclass, replace
from functools import cached_property

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from magis.analysis.axes import scale_sizes
from magis.analysis.dgraph import DGraph, build_dgraph, links
from magis.analysis.dim_rules import op_dims
from magis.analysis.ftrans import FTrans, InvalidFission, is_valid, plan_fission
from magis.analysis.ftree import Candidate, FTree, build_ftree, next_divisor, unsupported_ops
from magis.analysis.layout_dims import reshape_links
from magis.backend.eager import buffers_snapshot, eager_step, restore_buffers
from magis.backend.meter import LiveTensorMeter, resident_tensors
from magis.backend.runtime import run_step
from magis.commands import fission as fission_command
from magis.cost.device_profiles import DEVICE_PROFILES
from magis.cost.latency import AnalyticCostModel, estimate_latency
from magis.cost.memory import MemoryProfile, simulate_memory
from magis.frontend.capture import capture
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta, iter_refs, map_refs
from magis.models import WORKLOADS, Built
from magis.rules.fission import FissionRegion, estimate_peak, fission
from magis.rules.ftree_mutation import apply_ftree, disable, enable, lift, mutate, mutations
from magis.rules.separable import make_separable
from magis.schedule import schedule

aten = torch.ops.aten
SEED = 7


def in_float64(built: Built) -> Built:
    inputs = tuple(x.double() if x.is_floating_point() else x for x in built.example_inputs)
    return Built(built.model.double(), inputs, built.loss_fn)


def eager_reference(built: Built) -> dict[str, torch.Tensor]:
    """Eager PyTorch's gradients and loss, seeded with :data:`SEED`; the buffers left as they were."""
    model, inputs = built.model, built.example_inputs
    snapshot = buffers_snapshot(model)
    torch.manual_seed(SEED)
    step = eager_step(model, inputs, built.loss_fn)
    restore_buffers(model, snapshot)
    return {**step.gradients, "<loss>": step.loss}


@dataclass(frozen=True)
class Captured:
    built: Built
    graph: Graph
    order: tuple[str, ...]
    profile: MemoryProfile
    dgraph: DGraph
    tree: FTree

    @cached_property
    def reference(self) -> dict[str, torch.Tensor]:
        return eager_reference(self.built)


def captured(built: Built, separable: bool = False) -> Captured:
    """The step of ``built`` captured (and made separable along its samples, as ``magis
    fission`` does, when ``separable``), in captured order, with its D-Graph and F-Tree."""
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    if separable:
        graph = make_separable(graph)
    order = tuple(n.name for n in graph.nodes)
    profile = simulate_memory(graph, order)
    dgraph = build_dgraph(graph)
    return Captured(built, graph, order, profile, dgraph, build_ftree(graph, profile, dgraph=dgraph))


def assert_runs_like_eager(c: Captured, graph: Graph, order: tuple[str, ...]) -> None:
    """Gradients and loss equal to eager PyTorch's (dropout masks too: same seed, random
    ops never split); the measured peak within 2% of the simulated one, and so the bytes
    swapped out to host memory."""
    model, inputs = c.built.model, c.built.example_inputs
    snapshot = buffers_snapshot(model)
    with LiveTensorMeter(resident_tensors(model, inputs)) as meter:
        torch.manual_seed(SEED)
        result = run_step(graph, model, inputs, order)
    restore_buffers(model, snapshot)
    expected = c.reference
    got = {**result.gradients, "<loss>": result.loss}
    assert expected.keys() == got.keys()
    # relative to each tensor's size, with a floor for gradients that are zero in exact
    # arithmetic (a key bias under softmax): rounding leaves ~1e-19 there
    scale = max(t.abs().max().item() for t in expected.values())
    for name, want in expected.items():
        error = (got[name] - want).abs().max().item()
        assert error <= 1e-9 * max(want.abs().max().item(), 1e-6 * scale), (name, error)
    simulated = simulate_memory(graph, order)
    assert abs(meter.peak_bytes - simulated.peak) <= 0.02 * simulated.peak, (meter.peak_bytes, simulated.peak)
    assert abs(meter.offloaded_bytes - simulated.host_peak) <= 0.02 * simulated.host_peak  # swapped out


# ---------------------------------------------------------------- workloads
@pytest.fixture(scope="module", params=sorted(WORKLOADS))
def workload(request) -> Captured:
    return captured(in_float64(WORKLOADS[request.param].build("tiny", seed=0)), separable=True)


def test_every_tiny_workload_candidate_runs_exactly_within_the_simulated_peak(workload):
    tree = workload.tree
    assert len(tree) > 0
    for candidate in tree.candidates:
        f = FTrans(candidate.axes, next_divisor(candidate.length, 1))
        graph = fission(workload.graph, f, workload.dgraph)
        regions = [n for n in graph.nodes if isinstance(n.target, FissionRegion)]
        assert len(regions) == 1 and regions[0].target.parts == f.parts
        assert not (f.nodes - {n.name for n in graph.nodes if n.target is operator.getitem}) & set(graph.index)
        assert_runs_like_eager(workload, graph, tuple(n.name for n in graph.nodes))


def test_ftree_is_a_laminar_tree_of_valid_candidates(workload):
    tree = workload.tree
    for i, c in enumerate(tree.candidates):
        if c.parent is not None:
            assert c.nodes < tree.candidates[c.parent].nodes
            assert c.parent < i
        for other in tree.candidates[:i]:
            assert c.nodes.isdisjoint(other.nodes) or c.nodes < other.nodes or other.nodes < c.nodes
        assert not any(workload.graph[n].random for n in c.nodes)
        assert c.nodes <= workload.dgraph.supported
        plan_fission(workload.graph, workload.dgraph, FTrans(c.axes, next_divisor(c.length, 1)))


def test_nested_enabled_nodes_run_exactly(small_models):
    """A parent and its child both enabled along the batch: the child splits one part again."""
    c = small_models[0]
    parent = max(c.tree.candidates, key=lambda cand: len(cand.nodes))
    assert parent.length % 4 == 0
    ordered = sorted(parent.axes, key=lambda item: c.graph.index[item[0]])
    # a prefix of a convex set in topological order is convex: take the longest valid one
    child_axes = next(
        dict(ordered[:k])
        for k in range(len(ordered) - 1, 1, -1)
        if is_valid(c.graph, c.dgraph, FTrans.of(dict(ordered[:k]), 2))
    )
    child = replace(parent, axes=tuple(sorted(child_axes.items())), parent=0)
    state = FTree((replace(parent, parent=None), child), (2, 2))
    applied = apply_ftree(c.graph, state, c.order)
    outer = [n for n in applied.graph.nodes if isinstance(n.target, FissionRegion)]
    assert len(outer) == 1
    assert any(isinstance(n.target, FissionRegion) for n in outer[0].target.graph.nodes)
    assert_runs_like_eager(c, applied.graph, applied.order)


# ---------------------------------------------------------------- dimension rules, op by op
def one_op(target, *args, **kwargs) -> tuple[Graph, dict[str, torch.Tensor]]:
    """A graph with one input per tensor argument and one node applying ``target``."""
    values: dict[str, torch.Tensor] = {}

    def to_ref(x):
        if isinstance(x, torch.Tensor):
            name = f"x{len(values)}"
            values[name] = x
            return Ref(name)
        if isinstance(x, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in x):
            return [to_ref(v) for v in x]
        return x

    ref_args = tuple(to_ref(a) for a in args)
    ref_kwargs = tuple(sorted((k, to_ref(v)) for k, v in kwargs.items()))
    out = target(*args, **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    nodes = [Node(n, None, outputs=(TensorMeta.of(v),), aliases=(None,), role=Role.INPUT) for n, v in values.items()]
    metas = tuple(TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in outs)
    op = Node("op", target, ref_args, ref_kwargs, metas, (None,) * len(metas), tuple_output=len(outs) > 1)
    return Graph((*nodes, op), ("op",)), values


def half(x: torch.Tensor, dim: int | None, k: int) -> torch.Tensor:
    """Half ``k`` of ``x`` along ``dim`` as a region cuts its inputs (contiguous when cut inside)."""
    if dim is None:
        return x
    piece = x.narrow(dim, k * x.shape[dim] // 2, x.shape[dim] // 2)
    return piece.clone() if any(s > 1 for s in x.shape[:dim]) else piece


def check_rule(target, *args, **kwargs) -> int:
    """Split every even axis of the op's rule in two: computing each half from sliced
    inputs (and divided size constants) gives the slice of the full output along that
    axis, or, for a reduce axis, a part to add. Returns how many axes were checked."""
    graph, values = one_op(target, *args, **kwargs)
    dims = op_dims(graph, "op")
    assert dims is not None, f"{target} has no rule"
    node = graph["op"]
    full = target(*args, **kwargs)
    full = list(full) if isinstance(full, (tuple, list)) else [full]
    checked = 0
    for axis in dims.axes:
        if dims.lengths[axis] % 2:
            continue
        part_node = scale_sizes(node, dims, axis, 2)
        cut = {
            ref.name: axes.index(axis) if axis in axes else None
            for ref, axes in zip(iter_refs((node.args, node.kwargs)), dims.inputs)
        }
        pieces = []
        for k in range(2):
            parts = {name: half(values[name], d, k) for name, d in cut.items()}
            args = map_refs(part_node.args, lambda ref, parts=parts: parts[ref.name])
            kwargs = dict(map_refs(part_node.kwargs, lambda ref, parts=parts: parts[ref.name]))
            out = part_node.target(*args, **kwargs)
            pieces.append(list(out) if isinstance(out, (tuple, list)) else [out])
        for e, whole in enumerate(full):
            if not isinstance(whole, torch.Tensor) or dims.outputs[e] is None:
                continue
            parts = [p[e] for p in pieces]
            if axis in dims.outputs[e]:
                torch.testing.assert_close(torch.cat(parts, dims.outputs[e].index(axis)), whole, msg=f"{target} {axis}")
            elif axis in dims.reductions[e]:
                torch.testing.assert_close(parts[0] + parts[1], whole, msg=f"{target} reduce {axis}")
        checked += 1
    return checked


def r(*shape, low=None, high=None):
    if low is not None:
        return torch.randint(low, high, shape)
    return torch.randn(*shape, dtype=torch.float64)


def _rule_cases():
    torch.manual_seed(0)
    x4 = r(4, 6, 6, 6)
    ln_x, ln_w, ln_b = r(4, 6, 8), r(8), r(8)
    _, ln_mean, ln_rstd = aten.native_layer_norm(ln_x, [8], ln_w, ln_b, 1e-5)
    bn = (r(6), r(6), torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64))
    _, bn_mean, bn_invstd, _, _ = aten._native_batch_norm_legit_functional(x4, *bn, True, 0.1, 1e-5)
    _, gn_mean, gn_rstd = aten.native_group_norm(x4, bn[0], bn[1], 4, 6, 36, 2, 1e-5)
    logp = torch.log_softmax(r(4, 5), 1)
    target = r(4, low=0, high=5)
    _, total = aten.nll_loss_forward(logp, target, None, 1, -100)
    logp2 = torch.log_softmax(r(4, 5, 2, 2), 1)
    target2 = r(4, 2, 2, low=0, high=5)
    _, total2 = aten.nll_loss2d_forward(logp2, target2, None, 1, -100)
    pooled, indices = aten.max_pool2d_with_indices(x4, [2, 2], [2, 2])
    q, k, v = r(4, 2, 6, 8), r(4, 2, 6, 8), r(4, 2, 6, 8)
    attn, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
    soft = torch.softmax(ln_x, -1)
    return [
        (aten.mm.default, (r(4, 6), r(6, 8)), {}),
        (aten.bmm.default, (r(4, 6, 2), r(4, 2, 8)), {}),
        (aten.addmm.default, (r(8), r(4, 6), r(6, 8)), {}),
        (aten.baddbmm.default, (r(4, 6, 8), r(4, 6, 2), r(4, 2, 8)), {}),
        (aten.convolution.default, (x4, r(8, 6, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
        (aten.convolution.default, (x4, r(8, 3, 3, 3), r(8), [1, 1], [0, 0], [1, 1], False, [0, 0], 2), {}),
        (aten.convolution.default, (x4, r(6, 4, 2, 2), r(4), [2, 2], [0, 0], [1, 1], True, [0, 0], 1), {}),
        # depthwise: channels split like a batch, ``groups`` with them
        (aten.convolution.default, (x4, r(6, 1, 3, 3), r(6), [1, 1], [2, 2], [2, 2], False, [0, 0], 6), {}),
        (aten.convolution.default, (x4, r(6, 1, 3, 3), None, [2, 2], [1, 1], [1, 1], False, [0, 0], 6), {}),
        (
            aten.convolution_backward.default,
            (r(4, 6, 6, 6), x4, r(6, 1, 3, 3), [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 6, [True, True, True]),
            {},
        ),
        (
            aten.convolution_backward.default,
            (r(4, 8, 6, 6), x4, r(8, 6, 3, 3), [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]),
            {},
        ),
        (
            aten.convolution_backward.default,
            (r(4, 4, 12, 12), x4, r(6, 4, 2, 2), [4], [2, 2], [0, 0], [1, 1], True, [0, 0], 1, [True, True, True]),
            {},
        ),
        (aten.sum.dim_IntList, (ln_x, [1]), {}),
        (aten.sum.dim_IntList, (ln_x, [0, 2], True), {}),
        (aten.sum.default, (ln_x,), {}),
        (aten.mean.dim, (ln_x, [1], True), {}),
        (aten._softmax.default, (ln_x, -1, False), {}),
        (aten._log_softmax.default, (ln_x, 1, False), {}),
        (aten._safe_softmax.default, (ln_x, -1), {}),
        (aten._softmax_backward_data.default, (r(4, 6, 8), soft, -1, torch.float64), {}),
        (aten._log_softmax_backward_data.default, (r(4, 6, 8), torch.log(soft), -1, torch.float64), {}),
        (aten.native_layer_norm.default, (ln_x, [8], ln_w, ln_b, 1e-5), {}),
        (
            aten.native_layer_norm_backward.default,
            (r(4, 6, 8), ln_x, [8], ln_mean, ln_rstd, ln_w, ln_b, [True, True, True]),
            {},
        ),
        (aten._native_batch_norm_legit_functional.default, (x4, *bn, True, 0.1, 1e-5), {}),
        (
            aten.native_batch_norm_backward.default,
            (r(4, 6, 6, 6), x4, bn[0], bn[2], bn[3], bn_mean, bn_invstd, True, 1e-5, [True, True, True]),
            {},
        ),
        (aten.native_group_norm.default, (x4, bn[0], bn[1], 4, 6, 36, 2, 1e-5), {}),
        (
            aten.native_group_norm_backward.default,
            (r(4, 6, 6, 6), x4, gn_mean, gn_rstd, bn[0], 4, 6, 36, 2, [True, True, True]),
            {},
        ),
        (aten.embedding.default, (r(10, 8), r(4, 6, low=0, high=10)), {}),
        (aten.embedding_dense_backward.default, (r(4, 6, 8), r(4, 6, low=0, high=10), 10, -1, False), {}),
        (aten.nll_loss_forward.default, (logp, target, None, 0, -100), {}),
        (aten.nll_loss_forward.default, (logp, target, None, 2, -100), {}),
        (aten.nll_loss_backward.default, (torch.ones((), dtype=torch.float64), logp, target, None, 1, -100, total), {}),
        (aten.nll_loss2d_forward.default, (logp2, target2, None, 2, -100), {}),
        (
            aten.nll_loss2d_backward.default,
            (torch.ones((), dtype=torch.float64), logp2, target2, None, 1, -100, total2),
            {},
        ),
        (aten.max_pool2d_with_indices.default, (x4, [2, 2], [2, 2]), {}),
        (
            aten.max_pool2d_with_indices_backward.default,
            (r(*pooled.shape), x4, [2, 2], [2, 2], [0, 0], [1, 1], False, indices),
            {},
        ),
        (aten.avg_pool2d.default, (x4, [2, 2], [2, 2]), {}),
        (aten.avg_pool2d_backward.default, (r(*pooled.shape), x4, [2, 2], [2, 2], [0, 0], False, True, None), {}),
        (aten._adaptive_avg_pool2d.default, (x4, [1, 1]), {}),
        (aten._adaptive_avg_pool2d_backward.default, (r(4, 6, 1, 1), x4), {}),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, False), {}),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True), {}),
        (
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            (q, k, v, 0.0, False),
            {"attn_mask": r(4, 1, 6, 6)},
        ),
        (
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            (r(4, 2, 6, 8), q, k, v, attn, lse, 0.0, False),
            {},
        ),
        (aten.view.default, (ln_x, [4, 6, 2, 4]), {}),
        (aten.view.default, (ln_x, [24, 8]), {}),
        (aten.view.default, (r(24, 8), [4, 6, 8]), {}),
        (aten._unsafe_view.default, (ln_x, [4, 48]), {}),
        (aten.reshape.default, (ln_x, [4, 3, 16]), {}),
        (aten.permute.default, (ln_x, [2, 0, 1]), {}),
        (aten.transpose.int, (ln_x, 0, 2), {}),
        (aten.t.default, (r(4, 6),), {}),
        (aten.expand.default, (r(4, 1, 8), [4, 6, 8]), {}),
        (aten.unsqueeze.default, (ln_x, 1), {}),
        (aten.squeeze.dim, (r(4, 1, 8), 1), {}),
        (aten.cat.default, ([r(4, 6), r(4, 2)], 1), {}),
        (aten.cat.default, ([r(4, 6), r(2, 6)],), {}),
        (aten.slice.Tensor, (ln_x, 1, 1, 5), {}),
        (aten.select.int, (ln_x, 1, 2), {}),
        (aten.split.Tensor, (ln_x, 3, 1), {}),
        (aten.slice_backward.default, (r(4, 4, 8), [4, 6, 8], 1, 1, 5, 1), {}),
        (aten.select_backward.default, (r(4, 8), [4, 6, 8], 1, 2), {}),
        (aten.gather.default, (r(4, 6), 1, r(4, 3, low=0, high=6)), {}),
        (aten.constant_pad_nd.default, (ln_x, [1, 1]), {}),
        (aten.add.Tensor, (ln_x, r(8)), {}),
        (aten.mul.Scalar, (ln_x, 0.5), {}),
        (aten.gelu_backward.default, (r(4, 6, 8), ln_x), {}),
        (aten.threshold_backward.default, (r(4, 6, 8), ln_x, 0.0), {}),
        (aten.where.self, (ln_x > 0, ln_x, r(6, 8)), {}),
        (aten.native_dropout_backward.default, (r(4, 6, 8), ln_x > 0, 2.0), {}),
        (aten.ones_like.default, (ln_x,), {}),
        (aten._to_copy.default, (ln_x,), {"dtype": torch.float32}),
        (aten.new_zeros.default, (ln_x, [4, 6]), {}),
        (aten.full.default, ([4, 6], 1.5), {"dtype": torch.float64}),
    ]


@pytest.mark.parametrize(("target", "args", "kwargs"), _rule_cases(), ids=lambda v: str(v) if callable(v) else "")
def test_dimension_rule_matches_pytorch(target, args, kwargs):
    check_rule(target, *args, **kwargs)


def test_rules_leave_what_is_not_exact_unlinked():
    # softmax: the normalised axis is no axis; layer norm: nor are the normalised ones
    graph, _ = one_op(aten._softmax.default, r(4, 6, 8), -1, False)
    assert op_dims(graph, "op").outputs[0] == (1, 2, None)
    # addmm: the inner axis would add the bias twice
    graph, _ = one_op(aten.addmm.default, r(8), r(4, 6), r(6, 8))
    assert op_dims(graph, "op").axes == (1, 2)
    # a 3x3 convolution: no sliding-window axis
    graph, _ = one_op(
        aten.convolution.default, r(4, 6, 6, 6), r(8, 6, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1
    )
    assert op_dims(graph, "op").outputs[0] == (1, 2, None, None)
    # training batch norm: only channels
    x = r(4, 6, 2, 2)
    graph, _ = one_op(aten._native_batch_norm_legit_functional.default, x, r(6), r(6), r(6), r(6), True, 0.1, 1e-5)
    assert op_dims(graph, "op").outputs[0] == (None, 2, None, None)
    # a mean loss is not a sum of part means
    graph, _ = one_op(aten.nll_loss_forward.default, torch.log_softmax(r(4, 5), 1), r(4, low=0, high=5), None, 1, -100)
    assert op_dims(graph, "op").axes == ()


def test_reshape_links_only_contiguous_splits():
    assert reshape_links((2, 16, 64), (2, 16, 4, 16)) == {0: 1, 1: 2, 2: 3}  # H*D -> H, outer split
    assert reshape_links((2, 16, 64), (32, 64)) == {0: 1, 2: 2}  # B -> B*S; S is inside the merge
    assert reshape_links((32, 64), (2, 16, 64)) == {0: 1, 1: 3}
    assert reshape_links((6, 4), (4, 6)) == {0: 1}


def test_ops_without_a_rule_have_none():
    graph, _ = one_op(aten.flip.default, r(4, 6), [1])
    assert op_dims(graph, "op") is None


# ---------------------------------------------------------------- D-Graph
def test_dgraph_matmul_links_are_the_papers():
    graph, _ = one_op(aten.mm.default, r(4, 6), r(6, 8))
    dgraph = build_dgraph(graph)
    assert set(links(graph, dgraph.dims, "op")) == {
        (("x0", 1), ("op", 1)),
        (("x0", 2), ("op", -1)),
        (("x1", 1), ("op", -1)),
        (("x1", 2), ("op", 2)),
    }
    assert dgraph.component[("x0", 2)] == dgraph.component[("x1", 1)] == dgraph.component[("op", -1)]
    assert len({dgraph.component[v] for v in [("x0", 1), ("x1", 2), ("op", -1)]}) == 3


class MiniBlock(nn.Module):
    """A pre-norm transformer block with a classification head: attention by bmm, dropout."""

    def __init__(self, hidden: int = 16, heads: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, -1)
        x = x + self.drop(self.out((attn @ v).transpose(1, 2).reshape(b, s, h)))
        x = x + self.mlp(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class ConvBlock(nn.Module):
    """Convolution, batch norm, ReLU, pooling, a 1x1 convolution without bias, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.mix = nn.Conv2d(8, 8, 1, bias=False)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        y = torch.relu(self.mix(y)).mean((2, 3))
        return nn.functional.cross_entropy(self.fc(y), labels)


@pytest.fixture(scope="module")
def small_models() -> list[Captured]:
    torch.manual_seed(0)
    block = Built(MiniBlock().double(), (torch.randn(4, 8, 16, dtype=torch.float64), torch.randint(0, 5, (4, 8))))
    conv = Built(ConvBlock().double(), (torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 4, (4,))))
    return [captured(block), captured(conv)]


def test_conv_sliding_window_axes_are_not_linked(small_models):
    conv = small_models[1]
    node = next(n for n in conv.graph.nodes if n.op_name == "aten.convolution.default")
    spatial = [(node.name, 3), (node.name, 4)]
    assert all(v not in conv.dgraph.component for v in spatial)  # no axis, so no vertex either
    batch = conv.dgraph.component[(node.name, 1)]
    assert conv.dgraph.dimensions[batch].length == 4


# ---------------------------------------------------------------- validity: accepted => exact
@st.composite
def subgraph_choices(draw, model_count: int):
    return (
        draw(st.integers(0, model_count - 1)),
        draw(st.integers(0, 10**6)),
        draw(st.integers(1, 30)),
        draw(st.lists(st.booleans(), min_size=60, max_size=60)),
        draw(st.sampled_from([2, 2, 4])),
    )


def grow(c: Captured, seed: int, size: int, coins: list[bool]) -> dict[str, int]:
    """A random connected node set on one dimension, each node with its single axis there."""
    dims = [d for d in c.dgraph.dimensions if d.length >= 2 and len(d.nodes) > 2]
    dimension = dims[seed % len(dims)]
    single = {n: axes[0] for n in dimension.nodes if len(axes := c.dgraph.axes_in(n, dimension.index)) == 1}
    names = sorted(single, key=c.graph.index.__getitem__)
    start = names[(seed // len(dims)) % len(names)]
    chosen, frontier = {start}, [start]
    while frontier and len(chosen) < size:
        name = frontier.pop(0)
        for other in (*c.graph[name].inputs, *c.graph.consumers[name]):
            if other in single and other not in chosen and coins[len(chosen) % len(coins)]:
                chosen.add(other)
                frontier.append(other)
    return {n: single[n] for n in chosen}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choice=subgraph_choices(2))
def test_the_validity_check_accepts_only_exact_fissions(small_models, choice):
    model, seed, size, coins, parts = choice
    c = small_models[model]
    f = FTrans.of(grow(c, seed, size, coins), parts)
    try:
        graph = fission(c.graph, f, c.dgraph)
    except InvalidFission:
        return
    assert_runs_like_eager(c, graph, tuple(n.name for n in graph.nodes))


def test_invalid_fissions_name_their_cause(small_models):
    c = small_models[0]
    dropout = next(n.name for n in c.graph.nodes if n.random)
    with pytest.raises(InvalidFission, match="random"):
        plan_fission(c.graph, c.dgraph, FTrans.of({dropout: 1}, 2))
    with pytest.raises(InvalidFission, match="at least 2"):
        plan_fission(c.graph, c.dgraph, FTrans.of({dropout: 1}, 1))
    mm = [n.name for n in c.graph.nodes if n.op_name == "aten.mm.default"]
    with pytest.raises(InvalidFission, match=r"connected|linked|convex|along"):
        plan_fission(c.graph, c.dgraph, FTrans.of({mm[0]: 1, mm[-1]: 1}, 2))


# ---------------------------------------------------------------- bad input: ops without a rule
class Flipper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).flip(-1)).square().mean()


def test_ops_without_a_rule_are_never_fissioned_and_break_nothing():
    torch.manual_seed(0)
    c = captured(Built(Flipper().double(), (torch.randn(8, 8, dtype=torch.float64),)))
    flips = [n.name for n in c.graph.nodes if n.op_name == "aten.flip.default"]
    assert flips and not set(flips) & c.dgraph.supported
    assert all(not set(flips) & cand.nodes for cand in c.tree.candidates)
    assert unsupported_ops(c.graph, c.dgraph, frozenset(c.graph.index)) == ("aten.flip.default",)
    with pytest.raises(InvalidFission, match=r"aten\.flip\.default.*no dimension rule"):
        plan_fission(c.graph, c.dgraph, FTrans.of({flips[0]: 1}, 2))
    ordered = schedule(c.graph, time_limit_s=2.0)
    assert c.graph.is_schedule(ordered.order)
    for cand in c.tree.candidates:
        graph = fission(c.graph, FTrans(cand.axes, 2), c.dgraph)
        assert_runs_like_eager(c, graph, tuple(n.name for n in graph.nodes))


# ---------------------------------------------------------------- memory and latency of a region
def test_region_memory_and_latency(small_models):
    c = small_models[0]
    cand = max(c.tree.candidates, key=lambda cand: len(cand.nodes))
    graph = fission(c.graph, FTrans(cand.axes, 4), c.dgraph)
    node = next(n for n in graph.nodes if isinstance(n.target, FissionRegion))
    region = node.target
    order = [n.name for n in region.graph.nodes]
    streaming = simulate_memory(replace(region.graph, outputs=()), order)  # results merged as made
    assert node.workspace == max(streaming.timeline) - streaming.persistent_bytes
    held = simulate_memory(region.graph, order)  # what holding a part's results to its end would cost
    assert node.workspace <= max(held.timeline) - held.persistent_bytes
    model = AnalyticCostModel(DEVICE_PROFILES["h200"])
    part = sum(model.node_seconds(region.graph, n.name) for n in region.graph.nodes)
    merge = sum(model.node_seconds(region.merge_graph, n.name) for n in region.merge_graph.nodes)
    assert region.estimate_seconds(model) == pytest.approx(4 * (part + merge))
    latency = estimate_latency(graph, [n.name for n in graph.nodes], model)
    assert latency.per_node_s[[n.name for n in graph.nodes].index(node.name)] == pytest.approx(4 * (part + merge))


def test_region_runs_parts_one_after_another(small_models):
    """The measured peak of the region's step equals the simulated one, part by part."""
    c = small_models[0]
    cand = max(c.tree.candidates, key=lambda cand: len(cand.nodes))
    for parts in (2, 4):
        graph = fission(c.graph, FTrans(cand.axes, parts), c.dgraph)
        order = [n.name for n in graph.nodes]
        snapshot = buffers_snapshot(c.built.model)
        with LiveTensorMeter(resident_tensors(c.built.model, c.built.example_inputs)) as meter:
            run_step(graph, c.built.model, c.built.example_inputs, order, apply_buffer_updates=False)
        restore_buffers(c.built.model, snapshot)
        assert meter.peak_bytes == simulate_memory(graph, order).peak


def test_peak_estimate_is_equation_1():
    # a -> b -> c, hot-spots {a, b}; S = {b, c}, input a: M_f = |a| + |b|/n
    meta = TensorMeta((4,), torch.float32, 16)
    nodes = (
        Node("a", None, outputs=(meta,), aliases=(None,), role=Role.INPUT),
        Node("b", aten.neg.default, (Ref("a"),), outputs=(meta,), aliases=(None,)),
        Node("c", aten.neg.default, (Ref("b"),), outputs=(meta,), aliases=(None,)),
    )
    graph = Graph(nodes, ("c",))
    profile = MemoryProfile(("a", "b", "c"), (32, 32, 32), 32, (1,), frozenset({("a", 0), ("b", 0)}), 16)
    estimate = estimate_peak(graph, profile, {"b", "c"}, 4)
    assert estimate.before == 32
    assert estimate.after == 16 + 16 / 4
    assert estimate.reduction == 12


# ---------------------------------------------------------------- mutation rules
def toy_tree(parts: tuple[int, ...] = (1, 1, 1)) -> FTree:
    """root (12) > child (12) > leaf (12), all on one dimension; plus a disjoint leaf (6)."""

    def cand(names: str, parent: int | None, length: int = 12) -> Candidate:
        return Candidate(tuple((n, 1) for n in names), 0, "d", length, 1.0, names[0], parent=parent)

    candidates = (cand("abcd", None), cand("bcd", 0), cand("cd", 1), cand("xy", None, 6))
    return FTree(candidates, (*parts, 1) if len(parts) == 3 else parts)


def test_enable_picks_disabled_leaves_and_parents_of_enabled_nodes():
    assert {t.parts for t in enable(toy_tree())} == {(1, 1, 2, 1), (1, 1, 1, 2)}
    assert {t.parts for t in enable(toy_tree((1, 1, 3)))} == {(1, 2, 3, 1), (1, 1, 3, 2)}
    # enabling the parent would leave 12 / 2 = 6 for the child, which 12 parts do not divide
    assert {t.parts for t in enable(toy_tree((1, 1, 12)))} == {(1, 1, 12, 2)}


def test_lift_disable_and_mutate():
    assert {t.parts for t in lift(toy_tree((1, 1, 2)))} == {(1, 2, 1, 1)}
    assert {t.parts for t in disable(toy_tree((1, 2, 3)))} == {(1, 2, 1, 1)}
    chain = [2]
    tree = toy_tree((1, 1, 2))
    while grown := mutate(tree):
        (tree,) = grown
        chain.append(tree.parts[2])
    assert chain == [2, 3, 4, 6, 12]
    assert next_divisor(12, 12) is None
    assert all(t.parts != toy_tree((1, 1, 2)).parts for t in mutations(toy_tree((1, 1, 2))))


# ---------------------------------------------------------------- the command
def test_fission_command_json(capsys):
    parser = argparse.ArgumentParser()
    fission_command.add_arguments(parser)
    args = parser.parse_args(["vit-base", "--preset", "tiny", "--device", "h200", "--schedule-seconds", "1", "--json"])
    assert fission_command.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("model", "baseline_peak_bytes", "baseline_latency_s", "ftree_seconds", "blocked_by", "candidates"):
        assert key in report, key
    assert report["candidates"]
    for row in report["candidates"]:
        for key in ("nodes", "dimension", "length", "score", "n", "simulated_peak_bytes", "simulated_latency_s"):
            assert key in row, key
        assert row["length"] % row["n"] == 0
