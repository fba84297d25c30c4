"""Bit-packed masks (Echo §IV-B, Algorithm 1 line 21: 1-bit encode and decode of the masks of
dropout and ReLU, magis.rules.compact): a bool mask saved for the backward is packed eight
to a byte and unpacked right before its readers.

Every rewritten step runs with dropout live and computes eager PyTorch's loss and gradients
bit for bit (same seed, the same masks: nothing is drawn again); the simulated peak drops by
the mask bytes less the packed bytes (7/8 of them where no padding is needed), and the live
tensors measured around the run peak exactly where the simulator says.
"""

from __future__ import annotations

import math
from weakref import WeakKeyDictionary

import pytest
import torch
from test_fission import SEED, eager_reference, in_float64
from test_scheduling_rules import GeluMLP, ReluDropoutMLP
from torch import nn

from magis.analysis.ftree import update_ftree
from magis.backend.eager import buffers_snapshot, max_relative_error, restore_buffers
from magis.backend.meter import CudaPeakMeter, LiveTensorMeter, resident_tensors
from magis.backend.runtime import run_step
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.ir.graph import Graph, TensorMeta
from magis.models import WORKLOADS, Built
from magis.rules.compact import BITS, bit_layout, bit_mask_proposals, compact
from magis.rules.ftree_mutation import apply_ftree
from magis.rules.remat import remat
from magis.rules.rewrite import Rewrite, Timeline
from magis.rules.separable import make_separable
from magis.rules.swap import swap
from magis.search.single_fission import separable_step

aten = torch.ops.aten


def packing(rewrites: list[Rewrite]) -> list[Rewrite]:
    return [r for r in rewrites if r.description.startswith("pack bits of ")]


def bool_hotspots(graph: Graph, order: tuple[str, ...]) -> int:
    """Bytes of the bool storages live at the peak of ``order``."""
    profile = simulate_memory(graph, order)
    return sum(
        graph.storage_bytes[key] for key in profile.hotspots if graph[key[0]].outputs[key[1]].dtype is torch.bool
    )


#: eager PyTorch's loss and gradients, by the model they were taken for
_EAGER: WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = WeakKeyDictionary()


def assert_bitwise_like_eager(built: Built, graph: Graph, order: tuple[str, ...], tolerance: float = 0.0) -> int:
    """Loss and every gradient equal to eager PyTorch's bit for bit (dropout live, same seed), or
    within ``tolerance`` relative to it (sums reordered); the measured peak of live tensors equal
    to the simulated one. Returns that peak."""
    snapshot = buffers_snapshot(built.model)
    with LiveTensorMeter(resident_tensors(built.model, built.example_inputs)) as meter:
        torch.manual_seed(SEED)
        result = run_step(graph, built.model, built.example_inputs, order)
    restore_buffers(built.model, snapshot)
    if built.model not in _EAGER:
        _EAGER[built.model] = eager_reference(built)
    expected = _EAGER[built.model]
    got = {**result.gradients, "<loss>": result.loss}
    assert expected.keys() == got.keys()
    if tolerance:
        assert max_relative_error(expected, got) <= tolerance
    for name, want in expected.items():
        assert tolerance or torch.equal(got[name], want), name
    simulated = simulate_memory(graph, order).peak
    assert meter.peak_bytes == simulated
    return simulated


def packed_bytes(graph: Graph) -> dict[str, int]:
    """The packed masks of ``graph`` (uint8 sums of eight lanes), by node, and their bytes."""
    return {
        n.name: n.meta.nbytes
        for n in graph.nodes
        if n.target is aten.sum.dim_IntList and n.meta.dtype is torch.uint8 and "_packed" in n.name
    }


@pytest.fixture(scope="module")
def bert() -> tuple[Built, Graph]:
    """Tiny BERT in float64 and its captured step."""
    built = in_float64(WORKLOADS["bert-base"].build("tiny", seed=0))
    return built, capture(built.model, built.example_inputs, built.loss_fn)


def test_bert_dropout_masks_packed_together_run_like_eager_bit_for_bit(bert):
    """Tiny BERT's captured step: only the backward reads a dropout's mask, and every mask saved
    past the peak is packed in one rewrite, right where it is made. The peak drops by 7/8 of
    the mask bytes less the eight bytes of lane weights, and no bool is live at the peak."""
    built, graph = bert
    order = tuple(n.name for n in graph.nodes)
    timeline = Timeline.of(graph, order)
    proposals = bit_mask_proposals(graph, timeline)
    masks = sum(p.saved.nbytes for p in proposals)
    assert len(proposals) == sum(n.target is aten.native_dropout.default for n in graph.nodes) == 7
    assert masks == bool_hotspots(graph, order) > 0
    together = packing(compact(graph, order))[0]
    assert together.description.startswith(f"pack bits of {len(proposals)} masks where made")
    assert len(packed_bytes(together.graph)) == len(proposals)
    assert sum(packed_bytes(together.graph).values()) == masks // BITS
    peak = assert_bitwise_like_eager(built, together.graph, together.order)
    assert timeline.peak - peak == masks - masks // BITS - BITS == together.saving
    assert bool_hotspots(together.graph, together.order) == 0
    # each dropout's backward reads an unpacked copy
    backwards = [n for n in together.graph.nodes if n.target is aten.native_dropout_backward.default]
    assert len(backwards) == 7 and all("_unbits" in n.args[1].name for n in backwards)


def test_predrawn_masks_are_packed_after_their_forward_reader_or_where_drawn(bert):
    """Tiny BERT made separable: each mask is drawn ahead and applied in the forward
    (``native_dropout_backward(x, mask, scale)``) before its backward reads it again. One
    rewrite packs every mask after the forward applied it, the other where it is drawn, the
    forward applying an unpacked copy too (what a fission region should read). Both compute
    eager's loss and gradients bit for bit and lower the peak by the same bytes."""
    built, captured = bert
    graph = make_separable(captured)
    order = tuple(n.name for n in graph.nodes)
    timeline = Timeline.of(graph, order)
    masks = bool_hotspots(graph, order)
    after_forward, where_drawn = packing(compact(graph, order))[:2]
    assert "after the last forward reader" in after_forward.description and "where made" in where_drawn.description
    applies = [n.name for n in graph.nodes if n.target is aten.native_dropout_backward.default]
    for rewrite, unpacked in ((after_forward, 7), (where_drawn, 14)):
        readers = [rewrite.graph[n] for n in applies]
        assert sum("_unbits" in n.args[1].name for n in readers) == unpacked
        peak = assert_bitwise_like_eager(built, rewrite.graph, rewrite.order)
        assert timeline.peak - peak == masks - masks // BITS - BITS
        assert bool_hotspots(rewrite.graph, rewrite.order) == 0


def test_relu_sign_masks_and_odd_sized_dropout_masks_are_packed():
    """The ReLU rule keeps a bool mask (1 byte an element) of each ReLU; the bit rule then packs
    those and the dropout masks, 61 x 13 = 793 elements each (padded to 800: 100 bytes). Each
    step of the way runs like eager bit for bit and the measured peak equals the simulated."""
    torch.manual_seed(0)
    model = ReluDropoutMLP(width=13).double()  # odd widths: no mask fills whole bytes per row
    built = Built(model, (torch.randn(61, 13, dtype=torch.float64),))
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    start = Timeline.of(graph).peak
    while relu := [r for r in compact(graph) if "ReLU backward" in r.description]:
        graph = relu[0].graph
    signs = [n for n in graph.nodes if n.target is aten.le.Scalar]
    assert len(signs) == 3
    order = tuple(n.name for n in graph.nodes)
    before = assert_bitwise_like_eager(built, graph, order)
    assert before < start
    timeline = Timeline.of(graph, order)
    proposals = bit_mask_proposals(graph, timeline)
    assert {p.target for p in proposals} >= {n.name for n in signs}
    assert all(p.layout.pad == 7 and p.layout.packed_bytes == 100 for p in proposals)
    masks = bool_hotspots(graph, order)
    together = packing(compact(graph, order))[0]
    after = assert_bitwise_like_eager(built, together.graph, together.order)
    assert before - after == masks - 100 * len(proposals) - BITS > 0.8 * (BITS - 1) / BITS * masks
    assert bool_hotspots(together.graph, together.order) == 0
    # each mask alone, too: the same values, a smaller drop
    for single in packing(compact(graph, order))[1:]:
        assert 0 < before - simulate_memory(single.graph, single.order).peak < before - after


class DropoutOnPermuted(nn.Module):
    """A linear layer, its output permuted (not contiguous), dropout on that, then a second
    linear layer: the dropout's mask follows the permuted layout of its input."""

    def __init__(self, features: int, perm: tuple[int, ...]) -> None:
        super().__init__()
        self.first = nn.Linear(features, features)
        self.second = nn.Linear(features, 4)
        self.perm = perm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.dropout(self.first(x).permute(self.perm), 0.5, training=True)
        return torch.tanh(self.second(y.transpose(-1, self.perm.index(len(self.perm) - 1)))).square().sum()


@pytest.mark.parametrize(
    "shape, perm",
    [((16, 12, 10), (1, 0, 2)), ((7, 5, 3), (1, 0, 2)), ((3, 5, 6, 7), (0, 3, 1, 2))],
    ids=["rows-of-120", "padded", "last-dim-moved"],
)
def test_dropout_on_a_permuted_tensor_is_packed_in_memory_order(shape, perm):
    """The mask is read in memory order (a permute, a view), so the packing is dense; unpacked,
    it has the dropout's own shape and strides, and the backward computes eager's gradients."""
    torch.manual_seed(0)
    built = Built(DropoutOnPermuted(shape[-1], perm).double(), (torch.randn(*shape, dtype=torch.float64),))
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    (dropout,) = [n for n in graph.nodes if n.target is aten.native_dropout.default]
    mask = dropout.outputs[1]
    assert mask.strides != torch.empty(mask.shape).stride()  # not row-major
    order = tuple(n.name for n in graph.nodes)
    (proposal,) = bit_mask_proposals(graph, Timeline.of(graph, order))
    assert proposal.layout.moves and proposal.layout.packed_bytes == math.ceil(mask.numel / BITS)
    (single,) = packing(compact(graph, order))
    unpacked = [n for n in single.graph.nodes if "_unbits" in n.name][-1]
    assert unpacked.meta.shape == mask.shape and unpacked.meta.strides == mask.strides
    before = simulate_memory(graph, order).peak
    after = assert_bitwise_like_eager(built, single.graph, single.order)
    assert before - after == mask.nbytes - proposal.layout.packed_bytes - BITS


def test_bit_layout_packs_dense_masks_in_memory_order_and_refuses_the_rest():
    def meta(shape: tuple[int, ...], strides: tuple[int, ...] | None, dtype: torch.dtype = torch.bool) -> TensorMeta:
        return TensorMeta(shape, dtype, math.prod(shape) * dtype.itemsize, strides)

    layout = bit_layout(meta((4, 6, 16), (96, 16, 1)))
    assert layout is not None and not layout.moves and layout.lead == (4, 6) and layout.packed_shape == (4, 6, 2)
    layout = bit_layout(meta((4, 6, 3), (18, 3, 1)))  # 18 per row: no trailing block of whole bytes but 72
    assert layout is not None and layout.lead == () and layout.row == 72 and layout.pad == 0
    layout = bit_layout(meta((3, 1, 5), (1, 1, 3)))  # transposed, a size-1 dimension anywhere
    assert layout is not None and layout.perm == (2, 0, 1) and layout.pad == 1 and layout.packed_shape == (2,)
    assert bit_layout(meta((4, 8), None)) is None  # layout unknown
    assert bit_layout(meta((4, 8), (16, 1))) is None  # a strided view: not dense
    assert bit_layout(meta((4, 8), (8, 1), torch.uint8)) is None  # not a bool
    assert bit_layout(meta((7,), (1,))) is None  # under a byte's elements: nothing to gain


def test_packed_masks_compose_with_recomputation_and_swapping():
    """Masks packed first; then two dropout outputs recomputed from their masks, which keeps
    those bool masks alive for the copies; then packing again reads the bits packed already
    (no mask is packed twice) for the copies too; then a saved tensor swapped out. Still
    eager's gradients bit for bit, measured peak = simulated, and each step lowers the peak."""
    torch.manual_seed(0)
    built = Built(GeluMLP(width=24).double(), (torch.randn(64, 24, dtype=torch.float64),))
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    peaks, taken = [simulate_memory(graph, [n.name for n in graph.nodes]).peak], []
    for rule in (lambda g: packing(compact(g)), remat, remat, lambda g: packing(compact(g)), swap):
        best = max(rule(graph), key=lambda c: c.saving)
        graph, _ = best.graph, taken.append(best.description)
        peaks.append(simulate_memory(graph, best.order).peak)
        if len(taken) == 4:
            assert taken[3].startswith("pack bits of 2 masks as packed already")
            copies = [n for n in graph.nodes if n.target is aten.native_dropout_backward.default and "remat" in n.name]
            assert len(copies) == 2 and all("_unbits" in n.args[1].name for n in copies)
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert len(packed_bytes(graph)) == 3
    assert_bitwise_like_eager(built, graph, tuple(n.name for n in graph.nodes))


class SelfAttention(nn.Module):
    """Attention layers with dropout on their probabilities and on their outputs, as BERT's."""

    def __init__(self, layers: int = 3, width: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.heads = heads
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
            probs = self.drop((q @ k.transpose(-1, -2) / math.sqrt(w // self.heads)).softmax(-1))
            x = x + self.drop(out((probs @ v).transpose(1, 2).reshape(b, s, w)))
        return x.square().mean()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_masks_on_cuda_compute_the_same_gradients_and_lower_the_allocator_peak():
    """float32 attention on the GPU: the packed step's gradients equal the unpacked step's bit
    for bit (and eager's to rounding), and the allocator's peak drops, by no more than the
    simulated peak does and at least half as much."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    built = Built(SelfAttention().to(device), (torch.randn(8, 256, 128, device=device),))
    graph = capture(built.model, built.example_inputs, built.loss_fn)
    order = tuple(n.name for n in graph.nodes)
    together = packing(compact(graph, order))[0]
    reference = eager_reference(built)
    results, peaks = [], []
    for g, o in ((graph, order), (together.graph, together.order)):
        with CudaPeakMeter(device, resident_tensors(built.model, built.example_inputs)) as meter:
            torch.manual_seed(SEED)
            result = run_step(g, built.model, built.example_inputs, o)
        results.append({**result.gradients, "<loss>": result.loss})
        peaks.append(meter.peak_bytes)
        assert max_relative_error(reference, results[-1]) <= 1e-4
    assert all(torch.equal(results[0][name], results[1][name]) for name in reference)
    simulated = simulate_memory(graph, order).peak - simulate_memory(together.graph, together.order).peak
    assert simulated == together.saving > 0
    # the allocator's peak holds kernel temporaries the simulator leaves out, and may fall at
    # another step: on an H200 it dropped by 3.08 MB where the simulated peak drops by 4.13 MB
    assert 0.5 * simulated <= peaks[0] - peaks[1] <= 1.05 * simulated, (peaks, simulated)


def test_a_fissioned_region_stays_fissioned_when_the_masks_it_reads_are_packed(bert):
    """``Analyze`` after a rewrite inside an enabled region (:func:`magis.analysis.ftree.update_ftree`):
    tiny BERT made separable, the F-Tree root along its samples fissioned in two, then every
    mask packed where drawn, which gives the region unpacked copies to read. The region's heir
    (the re-analysed candidate holding most of what the rewrite left of it, along the same axes) keeps
    its two parts, so the packed and fissioned step is one state, not two steps of which the
    first, unfissioned, peaks far above the best. It runs eager's loss and gradients (float64;
    the weight gradients summed over two parts) and peaks where simulated."""
    built, captured_graph = bert
    step = separable_step(captured_graph, tuple(n.name for n in captured_graph.nodes))
    root = next(i for i, c in enumerate(step.tree.candidates) if c.parent is None and c.length % 2 == 0)
    region = step.tree.candidates[root]
    enabled = step.tree.with_parts({root: 2})
    where_drawn = next(r for r in packing(compact(step.graph, step.order)) if "where made" in r.description)
    assert not region.nodes.isdisjoint(where_drawn.touched)  # the rewrite reaches into the region
    profile = simulate_memory(where_drawn.graph, where_drawn.order)
    updated = update_ftree(enabled, where_drawn.graph, profile, where_drawn.touched)
    heirs = [i for i in range(len(updated)) if updated.enabled(i)]
    assert len(heirs) == 1 and updated.parts[heirs[0]] == 2
    heir = updated.candidates[heirs[0]]
    left = {(name, axis) for name, axis in region.axes if name in where_drawn.graph and name not in where_drawn.touched}
    assert len(left.intersection(heir.axes)) > 0.9 * len(left) and any("_unbits" in name for name in heir.nodes)
    applied = apply_ftree(where_drawn.graph, updated, where_drawn.order)
    assert any(node.op_name.startswith("fission[n=2") for node in applied.graph.nodes)
    assert_bitwise_like_eager(built, applied.graph, applied.order, tolerance=1e-12)
