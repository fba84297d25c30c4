"""The reference: a plain eager PyTorch training step, as a user would write it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from magis.backend.runtime import StepResult
from magis.frontend.capture import LossFn, default_loss


def eager_step(model: torch.nn.Module, example_inputs: Sequence[Any], loss_fn: LossFn | None = None) -> StepResult:
    """``zero_grad(set_to_none)``, forward, loss, backward; gradients are detached from ``.grad``."""
    for p in model.parameters():
        p.grad = None
    output = model(*example_inputs)
    loss = default_loss(output) if loss_fn is None else loss_fn(output)
    del output
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return StepResult(loss.detach(), grads, {})


def buffers_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every buffer, to run two steps from the same state."""
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def restore_buffers(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(snapshot[k])


def max_relative_error(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """Largest ``|a-b| / max(|a|)`` over matching tensors (0 when all equal).

    Missing or extra entries count as an infinite error: a gradient was lost.
    """
    if set(reference) != set(other):
        return float("inf")
    worst = 0.0
    for k, ref in reference.items():
        ref = ref.detach().float()
        diff = (other[k].detach().float() - ref).abs().max().item() if ref.numel() else 0.0
        scale = max(ref.abs().max().item(), 1e-12) if ref.numel() else 1.0
        worst = max(worst, diff / scale)
    return worst
