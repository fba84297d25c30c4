"""Spatial tiling (:mod:`magis.rules.tiling`, MCUNetV2's patch-based inference): a chain of
convolutions computed in bands of rows gives eager's output, within its simulated peak, on odd
sizes, strides, dilations and band counts; the search takes it where a batch of one has nothing
else to split."""

from __future__ import annotations

import pytest
import torch
from test_inference import SEARCH, Stem
from torch import nn

import magis
from magis.api import measure_against_eager
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture_forward
from magis.rules.tiling import find_chains, rows_needed, tiled

#: float64 rounding of a convolution summed in another order on fewer rows
REORDERED_SUM = 1e-13


class Chain(nn.Module):
    """A stride-2 convolution, batch norm, ReLU6, a dilated depthwise convolution, batch norm,
    SiLU and a 1x1 convolution: one chain, whose output two readers share."""

    def __init__(self) -> None:
        super().__init__()
        self.chain = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU6(),
            nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8),
            nn.BatchNorm2d(8),
            nn.SiLU(),
            nn.Conv2d(8, 16, 1),
        )

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.chain(images)
        return features.amax((2, 3)), features[:, :, 1:-1:3]


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Chain().double().eval()
    for norm in (model.chain[1], model.chain[4]):  # statistics that are not the identity
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    return model, torch.randn(1, 3, 37, 41, dtype=torch.float64)


@pytest.mark.parametrize("bands", [2, 3, 5, 19])
def test_a_chain_in_bands_of_rows_gives_eagers_output_within_its_simulated_peak(bands):
    model, images = build()
    graph = capture_forward(model, (images,)).graph
    (chain,) = find_chains(graph)
    assert len(chain.ops) == 7
    split = tiled(graph, chain, bands)
    order = tuple(n.name for n in split.nodes)
    measured = measure_against_eager(split, order, model, (images,), None)
    assert measured["max_output_error"] <= REORDERED_SUM
    assert measured["measured_peak_bytes"] == simulate_memory(split, order).peak
    convolutions = [n for n in split.nodes if n.target is torch.ops.aten.convolution.default]
    assert len(convolutions) == 3 * bands


def test_the_rows_a_band_needs_are_its_receptive_field():
    """Brute force: the input rows a band of the output depends on (found by perturbing each
    input row) are the rows the walk back from the band reads, padding aside."""
    model, images = build()
    graph = capture_forward(model, (images,)).graph
    (chain,) = find_chains(graph)
    with torch.no_grad():
        reference = model.chain(images)
        for first, stop in [(0, 3), (5, 9), (15, 19)]:
            depends = []
            for row in range(images.shape[2]):
                poked = images.clone()
                poked[:, :, row] += 1.0
                if not torch.equal(model.chain(poked)[:, :, first:stop], reference[:, :, first:stop]):
                    depends.append(row)
            a, b, _, _ = rows_needed(graph, chain, first, stop)[0]
            assert (min(depends), max(depends) + 1) == (a, b)


def test_the_search_tiles_a_stem_at_batch_one():
    torch.manual_seed(0)
    model = Stem(bias=False).double().eval()
    images = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    plan = magis.optimize(model, (images,), inference=True, memory_limit=0.7, device="a100", **SEARCH)
    assert plan.peak_bytes <= plan.objective.memory_bytes
    assert "tile" in [step.rule for step in plan.search.best.steps]
    with torch.no_grad():
        reference = model(images)
    torch.testing.assert_close(plan(images), reference, rtol=0, atol=REORDERED_SUM)
    measured = measure_against_eager(plan.graph, plan.order, model, (images,), None)
    assert measured["measured_peak_bytes"] == plan.peak_bytes
