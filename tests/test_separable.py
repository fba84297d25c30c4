"""The rewrites that make a training step separable along its samples (magis.rules.separable).

Each must keep every value of the captured step (loss, gradients, dropout masks)
and must open the way to a fission region that holds a forward, the loss and the
backward together, which is what shrinks the activations a step saves.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_fission import assert_runs_like_eager, captured, in_float64
from torch import nn

from magis.analysis.ftrans import FTrans
from magis.cost.memory import simulate_memory
from magis.ir.graph import Graph, TensorMeta
from magis.models import WORKLOADS, Built
from magis.rules.fission import fission
from magis.rules.separable import (
    make_separable,
    normalise_loss_by_labels,
    predraw_dropout_masks,
    seed_backward_with_constant,
)

aten = torch.ops.aten


def ops(graph: Graph, target) -> list[str]:
    return [n.name for n in graph.nodes if n.target is target]


@pytest.mark.parametrize("name", ["bert-base", "unet", "gpt-neo-1.3b"])
def test_separable_step_equals_eager(name):
    """Loss, gradients and dropout masks equal to eager's; measured peak == simulated."""
    c = captured(in_float64(WORKLOADS[name].build("tiny", seed=0)), separable=True)
    assert_runs_like_eager(c, c.graph, c.order)


def test_each_rewrite_removes_its_coupling():
    built = in_float64(WORKLOADS["bert-base"].build("tiny", seed=0))
    original = captured(built).graph
    graph = make_separable(original)
    loss = graph[graph.signature.loss]
    # 1. the seed reads nothing computed
    assert not ops(graph, aten.ones_like.default)
    (seed,) = ops(graph, aten.new_full.default)
    assert all(graph[p].is_input for p in graph[seed].inputs)
    # 2. the loss is a summed nll divided by a count read from the labels only
    assert loss.target is aten.div.Tensor
    (nll,) = ops(graph, aten.nll_loss_forward.default)
    assert graph[nll].args[3] == 2  # Reduction::Sum
    count = graph[loss.args[1].name]
    assert count.target is aten.sum.default and graph[graph[count.name].inputs[0]].target is aten.ne.Scalar
    (backward,) = ops(graph, aten.nll_loss_backward.default)
    assert graph[backward].args[-1].name == count.name
    # 3. every dropout draws on a stand-in, in the captured order of random ops
    draws = ops(graph, aten.native_dropout.default)
    assert len(draws) == len(ops(original, aten.native_dropout.default)) > 0
    assert all(graph[graph[d].inputs[0]].target is aten.new_empty_strided.default for d in draws)
    assert [n.name for n in graph.nodes if n.random] == draws
    assert graph.order_edges == tuple(itertools.pairwise(draws))
    # each is idempotent, and the separable graph is made by the three together
    for rewrite in (seed_backward_with_constant, normalise_loss_by_labels, predraw_dropout_masks):
        assert rewrite(graph) is graph


class DropoutOnTransposed(nn.Module):
    """Dropout on a non-contiguous tensor: its mask follows the input's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).transpose(0, 1)
        return (nn.functional.dropout(y, 0.3, training=True) * torch.arange(6.0, dtype=x.dtype)[:, None, None]).sum()


def test_predrawn_masks_follow_the_layout_of_the_dropout_input():
    c = captured(Built(DropoutOnTransposed().double(), (torch.randn(4, 6, 6, dtype=torch.float64),)), separable=True)
    (draw,) = ops(c.graph, aten.native_dropout.default)
    stand_in = c.graph[c.graph[draw].inputs[0]]
    assert stand_in.args[2] != list(torch.empty(stand_in.meta.shape).stride())  # not row-major
    assert_runs_like_eager(c, c.graph, c.order)


def test_dropout_of_unknown_layout_is_left_alone():
    graph = captured(in_float64(WORKLOADS["bert-base"].build("tiny", seed=0))).graph
    blinded = {}
    for name in ops(graph, aten.native_dropout.default):
        source = graph[graph[name].inputs[0]]
        meta = source.meta
        blinded[source.name] = dataclasses.replace(source, outputs=(TensorMeta(meta.shape, meta.dtype, meta.nbytes),))
    blind = Graph(tuple(blinded.get(n.name, n) for n in graph.nodes), graph.outputs, graph.signature, graph.order_edges)
    assert predraw_dropout_masks(blind) is blind


@pytest.mark.parametrize("name", ["bert-base", "unet"])
def test_a_region_can_span_forward_loss_and_backward(name):
    """The F-Tree of the separable step offers a candidate holding the loss and both
    passes (Figure 16's F-Trans covering the whole graph); run at the largest n that
    divides the batch, it is exact. (Its peak gain is a paper-size figure: experiments/fission.py.)"""
    c = captured(in_float64(WORKLOADS[name].build("tiny", seed=0)), separable=True)
    graph = c.graph
    nll = next(
        n.name for n in graph.nodes if n.target in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
    )
    backward = next(
        n.name for n in graph.nodes if n.target in (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
    )
    spanning = [cand for cand in c.tree.candidates if {nll, backward} <= cand.nodes]
    assert spanning
    whole = max(spanning, key=lambda cand: len(cand.nodes))
    parts = max(d for d in range(2, whole.length + 1) if whole.length % d == 0)
    result = fission(graph, FTrans(whole.axes, parts), c.dgraph)
    order = tuple(n.name for n in result.nodes)
    assert_runs_like_eager(c, result, order)


class DropoutOnSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x)[:, 1:], 0.3, training=True).sum()


def test_dropout_of_a_view_inside_its_storage_is_left_alone():
    """A slice starts inside its storage: CUDA's fused dropout could vectorise it differently
    from a fresh stand-in, so its mask is not drawn ahead."""
    x = torch.randn(4, 6, dtype=torch.float64)
    graph = predraw_dropout_masks(captured(Built(DropoutOnSlice().double(), (x,))).graph)
    (dropout,) = ops(graph, aten.native_dropout.default)
    assert graph[graph[dropout].inputs[0]].target is aten.slice.Tensor


class LSTMTagger(nn.Module):
    """Token ids -> embedding -> time-major LSTM -> a wide vocabulary head -> cross entropy.
    The LSTM projects every time step at once as ``[T*B, E]`` (batch inside): the batch of
    the ids stops there and starts again at the LSTM's per-step inputs."""

    def __init__(self, vocab: int = 96, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids.t()))
        logits = self.head(hidden.transpose(0, 1))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_the_head_after_an_lstm_is_one_region_with_its_backward():
    """Where the batch restarts inside the step (Echo's NMT), the F-Tree enters the batch at
    the node it restarts from that reaches the most (:func:`magis.analysis.ftree.component_entries`),
    not at the labels, which reach only the loss and the backward: the vocabulary head, its
    loss and their backward are one candidate, and fissioned it lowers the peak exactly."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 96, (4, 3)), torch.randint(0, 96, (4, 3))
    c = captured(in_float64(Built(LSTMTagger(), (ids, labels))), separable=True)
    graph = c.graph
    head = {
        *ops(graph, aten._log_softmax.default),
        *ops(graph, aten.nll_loss_forward.default),
        *ops(graph, aten.nll_loss_backward.default),
        *ops(graph, aten._log_softmax_backward_data.default),
    }
    spanning = [cand for cand in c.tree.candidates if head <= cand.nodes]
    assert spanning, [sorted(cand.nodes) for cand in c.tree.candidates]
    whole = max(spanning, key=lambda cand: len(cand.nodes))
    result = fission(graph, FTrans(whole.axes, 2), c.dgraph)
    order = tuple(n.name for n in result.nodes)
    assert simulate_memory(result, order).peak < c.profile.peak
    assert_runs_like_eager(c, result, order)
