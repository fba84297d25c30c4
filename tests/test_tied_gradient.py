"""A tied weight's gradient summed in place, its embedding term a vocabulary slice at a time
(magis.rules.tied_gradient): eager's gradients bit for bit, one vocabulary matrix less held at
the end of the backward (measured as simulated), and plans that use it train as eager does."""

from __future__ import annotations

import pytest
import torch
from conftest import ten_steps_beside_eager
from torch import nn

import magis
from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.ir.graph import is_view, writes
from magis.rules.tied_gradient import PIECES, EmbeddingGradientInto, tied_gradient_rewrites, tied_sums

pytestmark = pytest.mark.usefixtures("one_thread_module")

VOCAB, WIDTH = 2003, 64  # a vocabulary PIECES does not divide: the last slice is shorter


class TiedLM(nn.Module):
    """A language model whose head is its embedding (GPT-2's, GPT-Neo's weight tying); with a
    vocabulary this much wider than the batch, the gradient's sum is the step's peak."""

    def __init__(self, tied: bool = True, padding_idx: int | None = None, scale_grad_by_freq: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def lm_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 12))
    ids[0, :4] = 7  # a repeated token (its row sums several gradients) and, where asked, the padding
    ids[1, 3] = VOCAB - 1  # a token of the last, shorter slice
    return ids, torch.randint(0, VOCAB, (2, 12))


@pytest.mark.parametrize(
    "padding_idx, scale_grad_by_freq", [(None, False), (7, False), (None, True), (VOCAB - 1, True)]
)
def test_the_sum_in_place_is_eagers_bit_for_bit_one_matrix_lower(padding_idx, scale_grad_by_freq):
    torch.manual_seed(0)
    model = TiedLM(padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    graph = capture(model, batch(), training_step=lm_step)
    [(total, _, _)] = tied_sums(graph)
    [rewrite] = tied_gradient_rewrites(graph)
    [node] = [n for n in rewrite.graph.nodes if isinstance(n.target, EmbeddingGradientInto)]
    assert writes(node) == (node.args[0].name,) and rewrite.graph.signature.gradients["embed.weight"] == node.name
    assert not is_view(rewrite.graph[node.args[0].name]), "written into the matmul's own tensor: .grad as it is"
    assert total not in rewrite.graph.index

    before = simulate_memory(graph, [n.name for n in graph.nodes]).peak
    after = simulate_memory(rewrite.graph, rewrite.order).peak
    matrix = VOCAB * WIDTH * 4
    assert after <= before - matrix * (1 - 1 / PIECES), "the embedding's term and the sum no longer held at once"

    torch.manual_seed(1)
    measured = measure_against_eager(rewrite.graph, rewrite.order, model, batch(), None, training_step=lm_step)
    assert measured["max_grad_error"] == 0.0
    assert measured["measured_peak_bytes"] == after


class ThreeWayTied(nn.Module):
    """One embedding for the source, the target and the head (T5's shared weight): its gradient
    is two sums, the second adding into the first."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        context = self.shared(source).mean(1, keepdim=True).expand(-1, target.shape[1], -1)
        return self.head(torch.tanh(self.mix(torch.cat([self.shared(target), context], -1))))


def test_a_weight_tied_three_ways_sums_twice_in_place_as_eager():
    """A rewrite whose second sum reads the first (renamed by the same rewrite) reads it by its
    new name: before, building the rewrite failed on T5 ("added nodes read unknown nodes")."""
    torch.manual_seed(0)
    model = ThreeWayTied()
    source, (target, labels) = torch.randint(0, VOCAB, (2, 9)), batch()

    def step(model: nn.Module, source: torch.Tensor, target: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(source, target).flatten(0, 1), labels.flatten())

    graph = capture(model, (source, target, labels), training_step=step)
    assert len(tied_sums(graph)) == 2
    [rewrite] = tied_gradient_rewrites(graph)
    written = [n for n in rewrite.graph.nodes if isinstance(n.target, EmbeddingGradientInto)]
    assert len(written) == 2 and written[1].args[0].name == written[0].name  # the second writes into the first
    torch.manual_seed(1)
    measured = measure_against_eager(
        rewrite.graph, rewrite.order, model, (source, target, labels), None, training_step=step
    )
    assert measured["max_grad_error"] == 0.0
    assert measured["measured_peak_bytes"] == simulate_memory(rewrite.graph, rewrite.order).peak


def test_an_untied_model_has_no_sum_to_rewrite():
    graph = capture(TiedLM(tied=False), batch(), training_step=lm_step)
    assert tied_sums(graph) == [] and tied_gradient_rewrites(graph) == []


def test_a_plan_below_the_sums_peak_trains_ten_steps_as_eager(tmp_path):
    """The public API on a user's tied model: a memory limit that only the rule reaches (the
    captured step's peak is the sum's), ten SGD steps with the losses and weights of eager's,
    and the plan saved and loaded runs the same."""
    torch.manual_seed(0)
    model = TiedLM().double()
    twin = TiedLM().double()
    twin.load_state_dict(model.state_dict())
    ids, labels = batch()
    plan = magis.optimize(
        model, (ids, labels), training_step=lm_step, memory_limit=0.7, device="h100", max_states=40, progress=False
    )
    assert any(step["rule"] == "tied-gradient" for step in plan.report().transformations["steps"])
    assert plan.report().peak_ratio <= 0.7

    path = plan.save(tmp_path / "tied.magis")
    loaded = magis.load_plan(path, model)
    eager, planned = ten_steps_beside_eager(
        model, twin, lambda: loaded(ids, labels), lambda: lm_step(twin, ids, labels), lambda p: torch.optim.SGD(p, 0.1)
    )
    assert planned == eager
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
