"""U-Net and U-Net++ as plain modules: the two segmentation workloads of MAGIS §7.1 (Table 2).

Neither has a class in transformers, so they are written here after their papers:

- U-Net (Ronneberger et al., MICCAI 2015): a contracting path of ``depth`` levels,
  each a double 3x3 convolution then 2x2 max-pooling, a bottleneck, and an expanding
  path that up-samples with a 2x2 transposed convolution, concatenates the skip
  connection of the same level and applies a double convolution. Convolutions are
  padded so the output has the input's height and width (the common PyTorch form).
  Base width 64 gives the paper's 64-128-256-512-1024 channels, ~31.0M parameters.
- U-Net++ (Zhou et al., DLMIA 2018): the same encoder, with the skip connections
  replaced by nested dense pathways. Node X[i][j] (level i, column j) reads the
  concatenation of every earlier node of its level, X[i][0..j-1], and the up-sampled
  X[i+1][j-1]; the prediction comes from X[0][depth] (no deep supervision). Base
  width 32 as in the authors' reference implementation (filters 32-64-128-256-512).

Both use conv-ReLU blocks and take ``width`` and ``depth`` so that small
presets can shrink them; both return per-pixel class logits ``(N, classes, H, W)``.
The height and width of the input must be divisible by ``2**depth``.
"""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Sequential):
    """(3x3 convolution, ReLU) twice: the basic block of both networks (no batch
    normalisation, as in both papers and in the networks MAGIS evaluates)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1),
            nn.ReLU(inplace=True),
        )


def _level_widths(width: int, depth: int) -> list[int]:
    if width <= 0 or depth <= 0:
        raise ValueError(f"width and depth must be positive, got width={width}, depth={depth}")
    return [width * 2**level for level in range(depth + 1)]


class UNet(nn.Module):
    """Classic U-Net with ``depth`` down/up levels and ``width`` channels at the top level."""

    def __init__(self, in_channels: int = 3, num_classes: int = 2, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        widths = _level_widths(width, depth)
        self.pool = nn.MaxPool2d(2)
        self.encoder = nn.ModuleList(
            DoubleConv(c_in, c_out) for c_in, c_out in zip([in_channels, *widths[:-1]], widths)
        )
        # Expanding path, from the bottleneck upwards.
        self.upsample = nn.ModuleList(nn.ConvTranspose2d(w * 2, w, 2, stride=2) for w in reversed(widths[:-1]))
        self.decoder = nn.ModuleList(DoubleConv(w * 2, w) for w in reversed(widths[:-1]))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        skips = []
        x = images
        for level, block in enumerate(self.encoder):
            x = block(x if level == 0 else self.pool(x))
            skips.append(x)
        x = skips.pop()
        for upsample, block in zip(self.upsample, self.decoder):
            x = block(torch.cat([skips.pop(), upsample(x)], dim=1))
        return self.head(x)


class UNetPlusPlus(nn.Module):
    """U-Net++ with nested dense skip pathways, ``depth`` levels and ``width`` top-level channels."""

    def __init__(self, in_channels: int = 3, num_classes: int = 2, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        widths = _level_widths(width, depth)
        self.depth = depth
        self.pool = nn.MaxPool2d(2)
        self.encoder = nn.ModuleList(
            DoubleConv(c_in, c_out) for c_in, c_out in zip([in_channels, *widths[:-1]], widths)
        )
        # Node X[i][j] for j >= 1 is keyed "i_j": its up-sampling of X[i+1][j-1], and its block,
        # which reads j earlier nodes of level i plus the up-sampled one, each widths[i] channels.
        self.upsample = nn.ModuleDict()
        self.nested = nn.ModuleDict()
        for column in range(1, depth + 1):
            for level in range(depth + 1 - column):
                key = f"{level}_{column}"
                self.upsample[key] = nn.ConvTranspose2d(widths[level + 1], widths[level], 2, stride=2)
                self.nested[key] = DoubleConv(widths[level] * (column + 1), widths[level])
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        grid: list[list[torch.Tensor]] = []  # grid[i][j] = X[i][j]
        x = images
        for level, block in enumerate(self.encoder):
            x = block(x if level == 0 else self.pool(x))
            grid.append([x])
        for column in range(1, self.depth + 1):
            for level in range(self.depth + 1 - column):
                key = f"{level}_{column}"
                up = self.upsample[key](grid[level + 1][column - 1])
                grid[level].append(self.nested[key](torch.cat([*grid[level], up], dim=1)))
        return self.head(grid[0][self.depth])
