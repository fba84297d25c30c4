"""A user's own loop on a CUDA GPU, as they would write it: their model and optimizer, a data
set whose last batch is short, ``compile=True`` (each segment tried against its operators on
the GPU, the whole step against its generated code). The plans train as eager does (float16
with a ``GradScaler`` on CUDA: ``tests/test_user_hunt3.py``). Skipped without a CUDA device (CI
has none; run on a lent GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import magis

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Dropout2d(0.1),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.BatchNorm2d(32),
            nn.GELU(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, label_smoothing=0.1)


def batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A data set of 37 images in batches of 16: the last holds 5."""
    images, labels = torch.randn(37, 3, 16, 16, dtype=dtype, device="cuda"), torch.randint(0, 10, (37,), device="cuda")
    return [(images[i : i + 16], labels[i : i + 16]) for i in range(0, 37, 16)]


@cuda
def test_a_compiled_plan_with_the_optimizer_inside_trains_as_eager_on_cuda(tmp_path):
    torch.manual_seed(0)
    model = SmallConvNet().double().cuda()
    twin = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (model, twin)]
    step = magis.planned(
        model,
        training_step=classify,
        optimizer=optimizers[0],
        compile=True,
        time_budget=2,
        progress=False,
        cache_dir=tmp_path,
    )
    data = batches(torch.float64)
    for epoch in range(2):
        for i, (x, y) in enumerate(data):
            torch.manual_seed(100 * epoch + i)
            loss = step(x, y)
            torch.manual_seed(100 * epoch + i)
            eager_loss = classify(twin, x, y)
            eager_loss.backward()
            optimizers[1].step()
            optimizers[1].zero_grad()
            torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-9, atol=1e-12)
    assert step.searches == 2  # one plan per batch shape
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)
    runtime = step.plan_for(*data[0]).report().runtime
    assert runtime["name"] == "compiled" and runtime["segments"] > 0
    # an update inside the step reads its step count and learning rate on the host: no graph
    assert "optimizer" in runtime["cuda_graph"]["fallback"]
