"""Modules users build from torch's own parts, none of them ours, trained through
``magis.planned`` in a loop with their optimizer inside the plan: three steps give eager's
losses, weights and buffers (float64), including the parts that change a model during its
forward (spectral norm's power iteration), reparametrize it (weight norm), draw random
numbers inside the step, or checkpoint by the user's own hand."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn
from torch.nn.utils import parametrizations

import magis

Batches = list[tuple[torch.Tensor, ...]]


class SpectralNormRegressor(nn.Module):
    """Its power iteration updates the ``_u``/``_v`` buffers in every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = parametrizations.spectral_norm(nn.Linear(8, 16))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x))).squeeze(-1)


class WeightNormRegressor(SpectralNormRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = parametrizations.weight_norm(nn.Linear(8, 16))


class CausalEncoderLM(nn.Module):
    """torch's own pre-norm encoder layers with dropout under a causal mask."""

    def __init__(self, vocab: int = 40, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=self.head.weight.dtype)
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))


class CheckpointedBlocks(nn.Module):
    """The user checkpoints each block with torch.utils.checkpoint (dropout inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.out(x).squeeze(-1)


class FlowMatching(nn.Module):
    """Time and noise drawn inside the step, as diffusion and flow-matching training does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 8))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        t = torch.rand(x0.shape[0], 1, dtype=x0.dtype)
        noise = torch.randn_like(x0)
        return F.mse_loss(self.net(torch.cat([(1 - t) * x0 + t * noise, t], -1)), noise - x0)


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 16, mode="mean")
        self.out = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.bag(ids)).squeeze(-1)


def _regression(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _language_model(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1, ignore_index=0)


def _own_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _bag_of_words(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(ids), labels)


def _batches(make: Callable[[], tuple[torch.Tensor, ...]]) -> Batches:
    return [make() for _ in range(3)]


Case = tuple[Callable[[], nn.Module], Callable, Callable[[], Batches], Callable]


def _regressor(build: Callable[[], nn.Module], width: int, make_optimizer: Callable) -> Case:
    """A module regressing one number from ``width`` features, on batches of six."""
    return build, _regression, lambda: _batches(lambda: (torch.randn(6, width), torch.randn(6))), make_optimizer


CASES: dict[str, Case] = {
    "spectral-norm": _regressor(SpectralNormRegressor, 8, lambda p: torch.optim.Adam(p, 1e-2)),
    "weight-norm": _regressor(WeightNormRegressor, 8, lambda p: torch.optim.SGD(p, 0.1, momentum=0.9)),
    "user-checkpoint": _regressor(CheckpointedBlocks, 16, lambda p: torch.optim.AdamW(p, 1e-2)),
    "causal-encoder": (
        CausalEncoderLM,
        _language_model,
        lambda: _batches(lambda: (torch.randint(0, 40, (4, 12)), torch.randint(0, 40, (4, 12)))),
        lambda p: torch.optim.AdamW(p, 1e-3, weight_decay=0.1),
    ),
    "noise-in-step": (
        FlowMatching,
        _own_loss,
        lambda: _batches(lambda: (torch.randn(6, 8),)),
        lambda p: torch.optim.Adam(p, 1e-2),
    ),
    "embedding-bag": (
        BagOfWords,
        _bag_of_words,
        lambda: _batches(lambda: (torch.randint(0, 40, (8, 5)), torch.rand(8))),
        lambda p: torch.optim.SGD(p, 0.1),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_three_steps_of_a_users_module_equal_eagers(case: str):
    build, training_step, batches, make_optimizer = CASES[case]
    torch.manual_seed(0)
    model = build().double()
    twin = copy.deepcopy(model)
    optimizer, twin_optimizer = make_optimizer(model.parameters()), make_optimizer(twin.parameters())
    data = [tuple(t.double() if t.is_floating_point() else t for t in batch) for batch in batches()]
    step = magis.planned(
        model, training_step=training_step, optimizer=optimizer, latency_limit=1.2, max_states=20, progress=False
    )
    for i, batch in enumerate(data):
        torch.manual_seed(100 + i)  # the same draws for the step's dropout and noise
        loss = step(*batch)
        torch.manual_seed(100 + i)
        expected = training_step(twin, *batch)
        expected.backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
        assert torch.allclose(loss, expected, rtol=1e-12, atol=0), (i, loss.item(), expected.item())
    for (name, ours), theirs in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12), name
    assert all(p.grad is None for p in model.parameters())
