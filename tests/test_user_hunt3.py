"""A third hunt for silent differences from eager PyTorch: users' own models and loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import magis
from magis.frontend.step import CaptureError


def test_a_step_that_changes_its_batch_in_place_is_refused_naming_the_argument() -> None:
    # eager doubles the user's tensor at every call; a plan reads a copy and would leave it as it was
    def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return F.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    before = x.clone()
    for verify in (True, False):
        with pytest.raises(CaptureError, match="changes argument 0 of the batch in place"):
            magis.optimize(model, (x, y), training_step=training_step, time_budget=1, progress=False, verify=verify)
    assert torch.equal(x, before)  # the trace ran on fake tensors


def test_an_inference_forward_that_changes_its_input_in_place_is_refused() -> None:
    class Scales(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
            extra["mask"].clamp_(0, 1)
            return self.linear(x) * extra["mask"]

    batch = (torch.randn(2, 4), {"mask": torch.randn(2, 4)})
    with pytest.raises(CaptureError, match=r"changes argument 1\['mask'\] of the batch in place"):
        magis.optimize(Scales(), batch, inference=True, time_budget=1, progress=False)
