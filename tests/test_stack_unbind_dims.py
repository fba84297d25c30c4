"""Dimension rules of ``stack`` and ``unbind`` (MAGIS §4.1), the ops an unrolled recurrent
layer (``magis.frontend.rnn``) is made of, and fission (MAGIS §4) through them.

Gradient checks run in float64 (see ``test_fission``): a fissioned step equals eager's up
to the rounding of a weight gradient summed over parts.
"""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
from test_fission import assert_runs_like_eager, captured, check_rule, in_float64, one_op, r
from torch import nn

from magis.analysis.dim_rules import op_dims
from magis.analysis.ftrans import FTrans, convexity_breakers, plan_fission, weak_components
from magis.analysis.ftree import _unfit, next_divisor, unsupported_ops
from magis.models import Built
from magis.rules.fission import FissionRegion, fission

aten = torch.ops.aten


# ---------------------------------------------------------------- the rules, op by op
def _stack_unbind_cases():
    torch.manual_seed(0)
    a, b, c = r(4, 6), r(4, 6), r(4, 6)
    x = r(4, 3, 6)
    return [
        (aten.stack.default, ([a, b, c], 0)),
        (aten.stack.default, ([a, b, c], 1)),
        (aten.stack.default, ([a, b, c], -1)),
        (aten.unbind.int, (x, 0)),
        (aten.unbind.int, (x, 1)),
        (aten.unbind.int, (x, -1)),
    ]


@pytest.mark.parametrize(("target", "args"), _stack_unbind_cases())
def test_stack_and_unbind_rules_match_pytorch(target, args):
    """Each half of every even axis, computed from sliced inputs, is that half of the output."""
    assert check_rule(target, *args) >= 1


def test_stack_inserts_an_unlinked_dimension():
    # inputs [4, 6] stacked along 1: input dim 0 -> output dim 0, input dim 1 -> output dim 2
    graph, _ = one_op(aten.stack.default, [r(4, 6), r(4, 6), r(4, 6)], 1)
    dims = op_dims(graph, "op")
    assert dims.inputs == ((1, 3), (1, 3), (1, 3))
    assert dims.outputs == ((1, None, 3),)  # the stacked dimension concatenates whole inputs
    assert dims.lengths == {1: 4, 3: 6}
    graph, _ = one_op(aten.stack.default, [r(4, 6), r(4, 6)], 0)
    assert op_dims(graph, "op").outputs == ((None, 2, 3),)


def test_unbind_drops_its_dimension_from_every_piece():
    graph, _ = one_op(aten.unbind.int, r(4, 3, 6), 1)
    dims = op_dims(graph, "op")
    assert dims.inputs == ((1, None, 2),)
    assert dims.outputs == ((1, 2),) * 3
    graph, _ = one_op(aten.unbind.int, r(5, 4, 6), 0)
    dims = op_dims(graph, "op")
    assert dims.inputs == ((None, 1, 2),)
    assert dims.outputs == ((1, 2),) * 5


# ---------------------------------------------------------------- fission through them
class LSTMLoss(nn.Module):
    """``nn.LSTM`` (sequence-major, as ``magis.models.nmt`` uses it), a linear, a mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return self.fc(y).mean()


class BatchFirstRecurrence(nn.Module):
    """A recurrence written with ``unbind`` over time and ``stack`` of its states, batch first
    (so the input projection's ``[B, T, H] -> [B*T, H]`` keeps the batch an outer split)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hid = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[:, 0, :1]).expand(-1, 16)
        states = []
        for x_t in self.inp(x).unbind(1):
            h = torch.tanh(x_t + self.hid(h))
            states.append(h)
        return self.out(torch.stack(states, 1)).sum()


def _lstm_step():
    torch.manual_seed(0)
    return captured(in_float64(Built(LSTMLoss(), (torch.randn(5, 4, 8),))), separable=True)


def _largest_valid_piece(c, axes: dict[str, int]) -> dict[str, int]:
    """Drop what an F-Trans cannot hold (``_unfit``, then what breaks convexity) until the
    set is stable; keep its largest weakly connected piece."""
    keep = dict(axes)
    while drop := _unfit(c.graph, c.dgraph, keep) or convexity_breakers(c.graph, set(keep)):
        keep = {n: a for n, a in keep.items() if n not in drop}
    piece = max(weak_components(c.graph, keep), key=len)
    return {n: keep[n] for n in piece}


def test_lstm_batch_axis_runs_through_stack_and_unbind_and_fissions_exactly():
    c = _lstm_step()
    graph, dgraph = c.graph, c.dgraph
    everything = frozenset(n.name for n in graph.nodes)
    assert unsupported_ops(graph, dgraph, everything) == ()  # stack and unbind were the only ones
    ops = {n.name: n.op_name for n in graph.nodes}
    stacks = [n for n, op in ops.items() if op == "aten.stack.default"]
    unbinds = [n for n, op in ops.items() if op == "aten.unbind.int"]
    assert stacks and unbinds
    # the initial state h0 [layers, B, H] and every stacked state share one batch dimension
    h0 = next(n for n, op in ops.items() if op == "aten.zeros.default")
    batch = dgraph.component[(h0, 2)]
    assert dgraph.dimensions[batch].length == 4
    for name in stacks:
        assert dgraph.axes_in(name, batch), name
    # an F-Trans along it over the first layer's forward recurrence, its stack inside
    first_stack = min(stacks, key=graph.index.__getitem__)
    upto = graph.index[first_stack]
    axes = {
        n: a[0]
        for n in dgraph.dimensions[batch].nodes
        if graph.index[n] <= upto
        and not graph[n].is_input
        and ops[n] != "aten.zeros.default"  # read by later layers' unbind: kept out, as an input
        and n in dgraph.supported
        and len(a := dgraph.axes_in(n, batch)) == 1
    }
    axes = _largest_valid_piece(c, axes)
    assert first_stack in axes
    assert Counter(ops[n] for n in axes)["aten.addmm.default"] == 5  # one hidden projection per step
    f = FTrans.of(axes, 2)
    plan_fission(graph, dgraph, f)
    fissioned = fission(graph, f, dgraph)
    assert sum(isinstance(n.target, FissionRegion) for n in fissioned.nodes) == 1
    assert_runs_like_eager(c, fissioned, tuple(n.name for n in fissioned.nodes))


def test_ftree_offers_a_batch_candidate_through_unbind_and_stack():
    torch.manual_seed(0)
    c = captured(in_float64(Built(BatchFirstRecurrence(), (torch.randn(4, 3, 8),))), separable=True)
    x = c.graph.signature.user_inputs[0]
    batch = c.dgraph.component[(x, 1)]
    ops = {n.name: n.op_name for n in c.graph.nodes}
    spanning = [
        cand
        for cand in c.tree.candidates
        if cand.dimension == batch and {"aten.stack.default", "aten.unbind.int"} <= {ops[n] for n in cand.nodes}
    ]
    assert spanning, [(cand.label, len(cand.nodes)) for cand in c.tree.candidates]
    candidate = max(spanning, key=lambda cand: len(cand.nodes))
    assert candidate.length == 4
    f = FTrans(candidate.axes, next_divisor(candidate.length, 1))
    fissioned = fission(c.graph, f, c.dgraph)
    regions = [n for n in fissioned.nodes if isinstance(n.target, FissionRegion)]
    assert len(regions) == 1 and regions[0].target.parts == 2
    inner = {n.op_name for n in regions[0].target.graph.nodes if n.target is not operator.getitem}
    assert {"aten.stack.default", "aten.unbind.int"} <= inner
    assert_runs_like_eager(c, fissioned, tuple(n.name for n in fissioned.nodes))
