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


def max_relative_error(
    reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], noise_floor: float = 1e-6
) -> float:
    """Largest ``max|a-b| / max|a|`` over matching tensors (0 when all equal).

    A tensor whose reference is at float round-off level (below ``noise_floor`` times
    the largest reference magnitude, e.g. a key bias under softmax, whose exact
    gradient is zero) is scaled by that floor instead, so rounding noise does not read
    as a large relative error. Missing or extra entries count as an infinite error:
    a gradient was lost.
    """
    if set(reference) != set(other):
        return float("inf")
    largest = max((t.detach().abs().max().item() for t in reference.values() if t.numel()), default=0.0)
    floor = max(noise_floor * largest, 1e-30)
    worst = 0.0
    for k, ref in reference.items():
        if not ref.numel():
            continue
        ref = ref.detach().double()
        diff = (other[k].detach().double() - ref).abs().max().item()
        worst = max(worst, diff / max(ref.abs().max().item(), floor))
    return worst
