"""Gradient accumulation: exact where every micro-batch's mean is over equally many labels, and
named, with its measured difference, where masked labels come in uneven numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from magis.backend.eager import eager_step, max_relative_error
from magis.frontend.capture import capture
from yardstick.peers.accumulation import gradient_differences


class MaskedTokens(nn.Module):
    """A tiny token classifier trained with a mean cross-entropy that ignores label -100."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), labels.flatten(), ignore_index=-100)


def _step_difference(labels: torch.Tensor) -> tuple[str | None, float]:
    torch.manual_seed(0)
    model = MaskedTokens()
    ids = torch.randint(0, 16, (4, 6))
    inputs = (ids, labels)
    note = gradient_differences(capture(model, inputs), inputs, 2)
    full = eager_step(model, inputs)
    accumulated = eager_step(model, inputs, micro_batches=2)
    error = max_relative_error(
        {**full.gradients, "<loss>": full.loss}, {**accumulated.gradients, "<loss>": accumulated.loss}
    )
    return note, error


def test_accumulation_is_exact_with_equal_label_counts():
    note, error = _step_difference(torch.randint(0, 16, (4, 6)))
    assert note is None
    assert error < 1e-6


def test_uneven_masked_labels_are_named_and_the_difference_measured():
    labels = torch.randint(0, 16, (4, 6))
    labels[0, :5] = -100  # micro-batch 1 (rows 0-1) counts 7 labels, micro-batch 2 counts 12
    note, error = _step_difference(labels)
    assert note is not None and "7/12 labels" in note
    # each micro-batch's mean weighs its labels 1/(2*7) and 1/(2*12) instead of 1/19 each
    assert 0.1 < error < 1.0, error


def test_a_batch_the_micro_batches_do_not_divide_is_refused():
    model = MaskedTokens()
    inputs = (torch.zeros(4, 6, dtype=torch.int64), torch.zeros(4, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="3 micro-batches do not divide the batch of 4"):
        eager_step(model, inputs, micro_batches=3)


class _SharedGradient(torch.autograd.Function):
    """``x @ a + x[:, :m] @ b``, whose backward returns b's gradient in the first rows of a's
    storage (they are equal), as a compiled backward may: two gradients in one storage, the
    second no view (autograd would copy a view) but a tensor set on the same memory."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x @ a + x[:, : b.shape[0]] @ b

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        (x,) = ctx.saved_tensors
        grad_a = x.t() @ grad
        rows, cols = grad_a.shape
        grad_b = grad_a.new_empty(0).set_(grad_a.untyped_storage(), 0, (rows // 2, cols), (cols, 1))
        return None, grad_a, grad_b


class SharedGradient(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.a = nn.Parameter(torch.randn(6, 3))
        self.b = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return _SharedGradient.apply(x, self.a, self.b).square().mean()
        return (x @ self.a + x[:, :3] @ self.b).square().mean()


def test_gradients_returned_in_one_storage_are_accumulated_apart():
    """Without separating them, the second micro-batch's gradient of ``a`` is added into ``b``'s
    ``.grad`` too (and the other way round)."""
    torch.manual_seed(0)
    x = torch.randn(8, 6, dtype=torch.float64)
    plain, fused = SharedGradient(fused=False).double(), SharedGradient(fused=True).double()
    fused.load_state_dict(plain.state_dict())
    reference = eager_step(plain, (x,))
    accumulated = eager_step(fused, (x,), micro_batches=4)
    assert max_relative_error(reference.gradients, accumulated.gradients) < 1e-12
