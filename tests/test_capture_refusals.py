"""Steps a graph cannot hold are refused by name, the model left as the user gave it.

A forward that changes a parameter in place (nn.Embedding's max_norm, weight clipping inside
forward), an embedding's sparse gradient and reentrant activation checkpointing: each would
otherwise plan a step unlike eager's, or fail with a message of torch's internals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import magis
from magis.frontend.capture import CaptureError

OPTIONS = {"time_budget": 2, "progress": False}


class ClippedCritic(nn.Module):
    """A WGAN critic that clips its weight inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.l.weight.clamp_(-0.1, 0.1)
        return self.l(x)


def _embedding_max_norm() -> nn.Module:
    return nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Linear(8, 20))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"{name} changed"


def _tokens_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).reshape(-1, 20), ids.reshape(-1))


CHANGED = [
    pytest.param(ClippedCritic, lambda: torch.randn(2, 4), "'l.weight'", id="clamp_-in-forward"),
    pytest.param(_embedding_max_norm, lambda: torch.randint(0, 20, (4, 6)), "'0.weight'", id="embedding-max_norm"),
]
CAUSES = r"in place.*max_norm.*clamp_.*after optimizer\.step\(\)"


@pytest.mark.parametrize(("make", "batch", "name"), CHANGED)
def test_inference_refuses_a_forward_that_changes_a_parameter(make, batch, name):
    torch.manual_seed(0)
    model = make().eval()
    before = _state(model)
    with pytest.raises(CaptureError, match=f"parameter {name} {CAUSES}"):
        magis.optimize(model, (batch(),), inference=True, **OPTIONS)
    _assert_unchanged(model, before)


@pytest.mark.parametrize(("make", "batch", "name"), CHANGED)
def test_training_refuses_a_forward_that_changes_a_parameter(make, batch, name):
    torch.manual_seed(0)
    model = make()
    before = _state(model)
    with pytest.raises(CaptureError, match=f"parameter {name} {CAUSES}") as refused:
        magis.optimize(model, (batch(),), training_step=lambda m, x: m(x).float().square().mean(), **OPTIONS)
    assert refused.value.__cause__ is not None  # AOTAutograd's own refusal, kept as the cause
    _assert_unchanged(model, before)


def test_training_refuses_a_frozen_parameter_changed_in_forward():
    """AOTAutograd refuses a frozen parameter changed in place with an assertion naming neither."""
    torch.manual_seed(0)
    model = ClippedCritic()
    model.l.weight.requires_grad_(False)
    before = _state(model)
    with pytest.raises(CaptureError, match=f"parameter 'l.weight' {CAUSES}"):
        magis.optimize(model, (torch.randn(2, 4),), training_step=lambda m, x: m(x).square().mean(), **OPTIONS)
    _assert_unchanged(model, before)


def test_a_buffer_changed_in_forward_is_still_written_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plan = magis.optimize(model, (torch.randn(8, 4),), inference=True, **OPTIONS)
    mean = model[1].running_mean.clone()
    plan(torch.randn(8, 4))
    assert not torch.equal(model[1].running_mean, mean)


def test_training_refuses_a_sparse_embedding_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Linear(8, 20))
    ids = torch.randint(0, 20, (4, 6))
    with pytest.raises(CaptureError, match=r"gradient of the parameter '0\.weight' is sparse.*Use sparse=False"):
        magis.optimize(model, (ids,), training_step=_tokens_loss, **OPTIONS)


def test_inference_plans_a_sparse_embedding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Linear(8, 20)).eval()
    ids = torch.randint(0, 20, (4, 6))
    plan = magis.optimize(model, (ids,), inference=True, **OPTIONS)
    with torch.no_grad():
        torch.testing.assert_close(plan(ids), model(ids))


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.i, self.b, self.o = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda h: F.gelu(self.b(h)), self.i(x), use_reentrant=self.use_reentrant)
        return self.o(h)


def _classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def test_training_refuses_reentrant_checkpointing():
    torch.manual_seed(0)
    batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    refusal = r"use_reentrant=True\): reentrant activation checkpointing cannot be captured.*Pass use_reentrant=False"
    with pytest.raises(CaptureError, match=refusal) as refused:
        magis.optimize(Checkpointed(True), batch, training_step=_classification_loss, **OPTIONS)
    assert "use_reentrant" in str(refused.value.__cause__)  # torch's own message stays the cause
    plan = magis.optimize(Checkpointed(False), batch, training_step=_classification_loss, **OPTIONS)
    assert torch.isfinite(plan(*batch))


def test_a_teacher_model_the_step_calls_from_its_closure_is_refused_naming_the_remedy():
    torch.manual_seed(0)
    student, teacher = nn.Linear(16, 4).double(), nn.Linear(16, 4).double().requires_grad_(False)

    def distilled(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(x)
        return F.cross_entropy(model(x), y) + F.mse_loss(model(x), target)

    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 4, (8,))
    with pytest.raises(CaptureError, match=r"a module outside the model that the step calls \(a teacher: make it a"):
        magis.optimize(student, (x, y), training_step=distilled, **OPTIONS)
