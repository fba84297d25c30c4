"""Random ops next to dropouts whose masks are drawn ahead (:func:`magis.rules.separable.
predraw_dropout_masks`): each draw takes its dropout's place in the chain of random ops in the
graph's node list too, which the rules that read that list as a schedule (``canonical``'s
merge of duplicates, the two dropouts' stand-ins among them) rely on."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import magis
from magis.frontend.capture import capture
from magis.rules.separable import make_separable


class Noisy(nn.Module):
    """Dropout, noise, another dropout and a keep-mask: four random ops, two of them drawn
    ahead as dropouts of like-shaped stand-ins, the keep-mask right after the second."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.a(x)))
        h = torch.tanh(self.b(h + 0.01 * torch.randn_like(h)))
        h = F.dropout(h, 0.2, self.training)
        keep = torch.rand(h.shape[0], 1, dtype=h.dtype) > 0.25
        return self.o(h * keep)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def noisy() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = Noisy().double()
    torch.manual_seed(1)
    return model, (torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 4, (8,)))


def test_predrawn_masks_keep_the_node_list_a_schedule_of_the_random_chain():
    model, batch = noisy()
    graph = make_separable(capture(model, batch, training_step=step))
    names = [n.name for n in graph.nodes]
    assert graph.is_schedule(names)
    randoms = [name for name in names if graph[name].random]
    assert [graph[name].op_name for name in randoms] == [
        "aten.native_dropout.default",
        "aten.randn_like.default",
        "aten.native_dropout.default",
        "aten.rand.default",
    ]


def test_a_plan_with_dropouts_noise_and_a_keep_mask_draws_as_eager_does():
    """Planned on the CPU cost model, the search's canonical step merges the two dropouts'
    stand-ins (like-shaped empty tensors); the plan's loss and gradients are eager's."""
    model, (x, y) = noisy()
    plan = magis.optimize(
        model,
        (x, y),
        training_step=step,
        latency_limit=2.0,
        time_budget=5.0,
        max_states=40,
        device="cpu",
        progress=False,
    )
    twin = copy.deepcopy(model)
    torch.manual_seed(3)
    expected = step(twin, x, y)
    expected.backward()
    torch.manual_seed(3)
    loss = plan(x, y)
    assert torch.equal(loss, expected.detach())
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14), name
