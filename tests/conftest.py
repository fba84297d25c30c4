"""Small models shared by the tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

# property tests assert behaviour, not speed: on a loaded 2-core machine one draw of a list of
# floats took 1.9 s (the other worker compiling), which hypothesis's timing checks call a failure
settings.register_profile("magis", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("magis")


@pytest.fixture(autouse=True, scope="session")
def private_latency_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests time operators into their own cache, never the user's ``~/.cache/magis``."""
    patch = pytest.MonkeyPatch()
    patch.setenv("MAGIS_CACHE_DIR", str(tmp_path_factory.mktemp("magis-cache")))
    yield
    patch.undo()


def _torch_threads(n: int) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread_module() -> Iterator[None]:
    """One torch thread for a whole test file: tiny models run faster on one thread, above all
    on a shared, busy machine (``pytestmark = pytest.mark.usefixtures("one_thread_module")``)."""
    yield from _torch_threads(1)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for one test: the yardstick's protocol then times on the process's CPU
    clock, which other jobs on the machine (a parallel test worker) do not disturb."""
    yield from _torch_threads(1)


class ConvNet(nn.Module):
    """Conv + BatchNorm + ReLU + Dropout + Linear: buffers, a random op, views."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.bn(self.conv(x)))).mean((2, 3))
        return self.fc(y)


class ConvRegressor(nn.Module):
    """A convolution, batch norm, ReLU and dropout, then a linear head (a regression: its labels
    reach the loss through :func:`regression_step`)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.conv(x)))).mean((2, 3))).squeeze(-1)


def regression_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (model(x) - target).square().mean()


class TwoDropoutMLP(nn.Module):
    """Two dropouts in a row: the RNG stream must be consumed in eager's order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 1)
        self.d1 = nn.Dropout(0.5)
        self.d2 = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.d1(torch.tanh(self.a(x)))
        h2 = self.d2(torch.relu(self.b(h1)))
        return self.c(h2 + h1).pow(2).mean()


@pytest.fixture
def convnet() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    torch.manual_seed(0)
    return ConvNet(), (torch.randn(4, 3, 12, 12),), (lambda out: out.square().mean())


@pytest.fixture
def mlp() -> tuple[nn.Module, tuple[torch.Tensor], None]:
    torch.manual_seed(0)
    return TwoDropoutMLP(), (torch.randn(8, 16),), None


def ten_steps_beside_eager(
    model: nn.Module, twin: nn.Module, plan_step, eager_step, make_optimizer
) -> tuple[list[float], list[float]]:
    """Ten optimizer steps of ``twin`` in eager PyTorch (``eager_step()`` then ``backward``) and of
    ``model`` through a plan (``plan_step()``), each step from the same seed (the same dropout
    masks for both, new masks each step): the two runs' losses, eager's first."""
    losses = []
    for step_model, step in ((twin, eager_step), (model, plan_step)):
        optimizer = make_optimizer(step_model.parameters())
        run = []
        for k in range(10):
            torch.manual_seed(100 + k)
            loss = step()
            if step_model is twin:
                loss.backward()
            run.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(run)
    return losses[0], losses[1]
